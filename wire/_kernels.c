/* Blockwise 4-bit kernels for wire/codec.py: encode with error feedback, and
 * validate-then-decode-accumulate into a caller's float32 buffer.
 *
 * Payload layout of one frame body (before zstd), for n values in nb = ceil(n/32)
 * blocks: nb scales (int4: uint16 bfloat16 bits; mxfp4: uint8 E8M0), then nb*16
 * bytes of codes, 16 per block: byte j holds element j of the block in its low
 * nibble and element j + 16 in its high nibble (both halves load and store as
 * contiguous vectors; no lane shuffles).
 *
 * Determinism: decoded values are (code value) * scale, both exact in float32, then
 * out += weight * value with one rounding each; built with -ffp-contract=off so no
 * platform fuses them. A learner that rebuilds published weights from deltas gets
 * the shard's bytes exactly.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define HALF (BLOCK / 2)
#define ABS_MASK 0x7fffffffu
#define INF_BITS 0x7f800000u
#define RNE_MAGIC 12582912.0f /* 1.5 * 2^23: x + M - M rounds x to nearest even */
#define INT4_MAX_SCALE 0x7dffu /* largest bfloat16 s with 8 * s finite: every code decodes finite */
#define MXFP4_MAX_SCALE 252    /* 2^125: 6 * 2^125 is finite, and FLT_MAX needs no more */

#if defined(__GNUC__) && defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#ifndef HOT
#define HOT
#endif

static float POW2[255]; /* POW2[k] = 2^(k-127), the E8M0 value of code k */
static const float FP4_VALUES[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float rne(float v) { return (v + RNE_MAGIC) - RNE_MAGIC; }

/* y = x + r over one block; returns the max of |y| as float bits (>= INF_BITS: non-finite). */
static inline uint32_t load_block(const float *restrict x, const float *restrict r, float *restrict y) {
    uint32_t amax = 0;
    for (int i = 0; i < BLOCK; i++) {
        y[i] = r ? x[i] + r[i] : x[i];
        uint32_t a = f2u(y[i]) & ABS_MASK;
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* out = w * v (acc = 0) or out += w * v: one rounding per operation, never fused. */
static inline void store_block(const float *restrict v, float w, int acc, float *restrict out) {
    if (!acc)
        for (int i = 0; i < BLOCK; i++) out[i] = w == 1.0f ? v[i] : w * v[i];
    else if (w == 1.0f)
        for (int i = 0; i < BLOCK; i++) out[i] += v[i];
    else
        for (int i = 0; i < BLOCK; i++) out[i] += w * v[i];
}

/* ---- int4: symmetric [-7, 7], bfloat16 scale >= absmax / 7 ---- */

static inline uint16_t int4_block(const float *restrict y, uint32_t amax_bits, float *restrict r_out,
                                  uint8_t *restrict codes) {
    uint32_t s_bits = f2u(u2f(amax_bits) / 7.0f);
    if (s_bits & 0xffffu) s_bits += 0x10000u; /* round the scale up: no value exceeds 7 */
    s_bits &= 0xffff0000u;
    if (s_bits > (INT4_MAX_SCALE << 16)) s_bits = INT4_MAX_SCALE << 16; /* near FLT_MAX: clip at 7s */
    float s = u2f(s_bits);
    int8_t q[BLOCK];
    /* Divide, not multiply by 1/s: the reciprocal is inexact and would misround ties. */
    for (int i = 0; i < BLOCK; i++) {
        float v = s > 0.0f ? rne(y[i] / s) : 0.0f;
        v = v > 7.0f ? 7.0f : (v < -7.0f ? -7.0f : v);
        q[i] = (int8_t)v;
    }
    if (r_out)
        for (int i = 0; i < BLOCK; i++) r_out[i] = y[i] - (float)q[i] * s;
    for (int j = 0; j < HALF; j++) codes[j] = (uint8_t)((q[j] & 15) | (q[j + HALF] << 4));
    return (uint16_t)(s_bits >> 16);
}

static inline float int4_scale(uint16_t bits) { return u2f((uint32_t)bits << 16); }
static inline int int4_scale_ok(uint16_t bits) { return bits <= INT4_MAX_SCALE; } /* also: sign clear, finite */

static inline void int4_decode_block(float s, float w, int acc, const uint8_t *restrict codes,
                                     float *restrict out) {
    float v[BLOCK];
    for (int j = 0; j < HALF; j++) {
        v[j] = (float)((int8_t)(codes[j] << 4) >> 4) * s;
        v[j + HALF] = (float)((int8_t)codes[j] >> 4) * s;
    }
    store_block(v, w, acc, out);
}

/* ---- mxfp4: E2M1 elements, E8M0 scale 2^(floor(log2 absmax) - 2) ---- */

static inline uint8_t mxfp4_block(const float *restrict y, uint32_t amax_bits, float *restrict r_out,
                                  uint8_t *restrict codes) {
    int e;
    if (amax_bits == 0) e = -127;
    else if (amax_bits < 0x00800000u) { (void)frexpf(u2f(amax_bits), &e); e = e - 1 - 2; }
    else e = (int)(amax_bits >> 23) - 127 - 2;
    if (e < -127) e = -127;
    float scale = POW2[e + 127], inv = POW2[127 - e];
    uint8_t c[BLOCK];
    float d[BLOCK];
    for (int i = 0; i < BLOCK; i++) { /* branch-free so it vectorizes */
        float v = y[i] * inv;
        uint32_t sign = f2u(v) & 0x80000000u;
        float a = u2f(f2u(v) & ABS_MASK);
        a = a > 6.0f ? 6.0f : a;
        /* E2M1 steps: 0.5 below 2, 1 below 4, 2 up to 6. */
        float step = a < 4.0f ? 1.0f : 2.0f, per = a < 4.0f ? 1.0f : 0.5f, base = a < 4.0f ? 2.0f : 4.0f;
        step = a < 2.0f ? 0.5f : step;
        per = a < 2.0f ? 2.0f : per;
        base = a < 2.0f ? 0.0f : base;
        float k = rne(a * per);
        float idx = k + base;
        float neg = (idx > 0.0f ? 8.0f : 0.0f) * (float)(sign >> 31);
        c[i] = (uint8_t)(int32_t)(idx + neg);
        d[i] = u2f(f2u(k * step) | sign);
    }
    if (r_out)
        for (int i = 0; i < BLOCK; i++) r_out[i] = y[i] - d[i] * scale;
    for (int j = 0; j < HALF; j++) codes[j] = (uint8_t)(c[j] | (c[j + HALF] << 4));
    return (uint8_t)(e + 127);
}

static inline void mxfp4_decode_block(float s, float w, int acc, const uint8_t *restrict codes,
                                      float *restrict out) {
    float v[BLOCK];
    for (int j = 0; j < HALF; j++) {
        v[j] = FP4_VALUES[codes[j] & 15] * s;
        v[j + HALF] = FP4_VALUES[codes[j] >> 4] * s;
    }
    store_block(v, w, acc, out);
}

/* ---- drivers over whole arrays ---- */

typedef enum { FMT_INT4 = 0, FMT_MXFP4 = 1 } fmt_t;

/* Returns -1 on success, else the index of the first non-finite input (nothing then
 * is meaningful in the outputs, and the caller discards them). */
HOT static Py_ssize_t encode_all(fmt_t fmt, const float *x, const float *r, float *r_out, Py_ssize_t n,
                                 uint8_t *scales, uint8_t *codes) {
    Py_ssize_t nb = (n + BLOCK - 1) / BLOCK;
    float y[BLOCK], tx[BLOCK], tr[BLOCK], tro[BLOCK];
    for (Py_ssize_t b = 0; b < nb; b++) {
        Py_ssize_t off = b * BLOCK, len = n - off < BLOCK ? n - off : BLOCK;
        const float *bx = x + off, *br = r ? r + off : NULL;
        float *bro = r_out ? r_out + off : NULL;
        if (len < BLOCK) { /* pad the tail block with zeros */
            memset(tx, 0, sizeof tx); memset(tr, 0, sizeof tr);
            memcpy(tx, bx, len * sizeof(float));
            if (br) { memcpy(tr, br, len * sizeof(float)); br = tr; }
            bx = tx; bro = r_out ? tro : NULL;
        }
        uint32_t amax = load_block(bx, br, y);
        if (amax >= INF_BITS) {
            for (Py_ssize_t i = 0; i < len; i++)
                if (!isfinite(y[i])) return off + i;
        }
        if (fmt == FMT_INT4) {
            uint16_t s = int4_block(y, amax, bro, codes + b * HALF);
            memcpy(scales + 2 * b, &s, 2); /* little-endian on every supported host */
        } else {
            scales[b] = mxfp4_block(y, amax, bro, codes + b * HALF);
        }
        if (bro == tro) memcpy(r_out + off, tro, len * sizeof(float));
    }
    return -1;
}

/* Returns -1 when the body is valid, else the index of the first bad block: a scale
 * out of range, or a nonzero code in the padding after the last value. */
static Py_ssize_t check_body(fmt_t fmt, const uint8_t *scales, const uint8_t *codes, Py_ssize_t n) {
    Py_ssize_t nb = (n + BLOCK - 1) / BLOCK;
    for (Py_ssize_t b = 0; b < nb; b++) {
        if (fmt == FMT_INT4) {
            uint16_t s; memcpy(&s, scales + 2 * b, 2);
            if (!int4_scale_ok(s)) return b;
        } else if (scales[b] > MXFP4_MAX_SCALE) {
            return b;
        }
    }
    Py_ssize_t tail = n % BLOCK;
    if (tail) {
        const uint8_t *last = codes + (nb - 1) * HALF;
        for (Py_ssize_t i = tail; i < BLOCK; i++) {
            uint8_t nibble = i < HALF ? last[i] & 15 : last[i - HALF] >> 4;
            if (nibble) return nb - 1;
        }
    }
    return -1;
}

HOT static void decode_all(fmt_t fmt, const uint8_t *scales, const uint8_t *codes, Py_ssize_t n,
                           float *out, float w, int acc) {
    Py_ssize_t nb = n / BLOCK;
    for (Py_ssize_t b = 0; b < nb; b++) {
        if (fmt == FMT_INT4) {
            uint16_t s; memcpy(&s, scales + 2 * b, 2);
            int4_decode_block(int4_scale(s), w, acc, codes + b * HALF, out + b * BLOCK);
        } else {
            mxfp4_decode_block(POW2[scales[b]], w, acc, codes + b * HALF, out + b * BLOCK);
        }
    }
    Py_ssize_t tail = n - nb * BLOCK;
    if (tail) {
        float t[BLOCK];
        memcpy(t, out + nb * BLOCK, tail * sizeof(float));
        if (fmt == FMT_INT4) {
            uint16_t s; memcpy(&s, scales + 2 * nb, 2);
            int4_decode_block(int4_scale(s), w, acc, codes + nb * HALF, t);
        } else {
            mxfp4_decode_block(POW2[scales[nb]], w, acc, codes + nb * HALF, t);
        }
        memcpy(out + nb * BLOCK, t, tail * sizeof(float));
    }
}

/* ---- Python bindings ---- */

static Py_ssize_t scale_bytes(fmt_t fmt) { return fmt == FMT_INT4 ? 2 : 1; }

static int get_fmt(int code, fmt_t *fmt) {
    if (code == FMT_INT4 || code == FMT_MXFP4) { *fmt = (fmt_t)code; return 0; }
    PyErr_Format(PyExc_ValueError, "unknown kernel format %d", code);
    return -1;
}

PyDoc_STRVAR(encode_doc,
"encode(fmt, x, residual, residual_out, body) -> int\n\n"
"Quantises float32 x (+ residual when not None) into body (scales then codes).\n"
"Writes x + residual - decoded into residual_out when not None. Returns -1, or the\n"
"index of the first non-finite value (outputs are then meaningless).");

static PyObject *py_encode(PyObject *self, PyObject *args) {
    int code;
    Py_buffer x, r = {0}, ro = {0}, body;
    PyObject *r_obj, *ro_obj;
    if (!PyArg_ParseTuple(args, "iy*OOw*", &code, &x, &r_obj, &ro_obj, &body)) return NULL;
    PyObject *result = NULL;
    int have_r = 0, have_ro = 0;
    fmt_t fmt;
    if (get_fmt(code, &fmt) < 0) goto done;
    if (r_obj != Py_None) { if (PyObject_GetBuffer(r_obj, &r, PyBUF_SIMPLE) < 0) goto done; have_r = 1; }
    if (ro_obj != Py_None) { if (PyObject_GetBuffer(ro_obj, &ro, PyBUF_WRITABLE) < 0) goto done; have_ro = 1; }
    if (x.len % 4) { PyErr_SetString(PyExc_ValueError, "x is not float32"); goto done; }
    Py_ssize_t n = x.len / 4, nb = (n + BLOCK - 1) / BLOCK;
    if ((have_r && r.len != x.len) || (have_ro && ro.len != x.len)) {
        PyErr_SetString(PyExc_ValueError, "residual length differs from x"); goto done;
    }
    if (body.len != nb * (scale_bytes(fmt) + HALF)) {
        PyErr_Format(PyExc_ValueError, "body holds %zd bytes, needs %zd", body.len, nb * (scale_bytes(fmt) + HALF));
        goto done;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = encode_all(fmt, x.buf, have_r ? r.buf : NULL, have_ro ? ro.buf : NULL, n, body.buf,
                     (uint8_t *)body.buf + nb * scale_bytes(fmt));
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&x); PyBuffer_Release(&body);
    if (have_r) PyBuffer_Release(&r);
    if (have_ro) PyBuffer_Release(&ro);
    return result;
}

PyDoc_STRVAR(decode_doc,
"decode(fmt, body, out, weight, accumulate) -> int\n\n"
"Checks every scale and the tail padding in body, then writes (accumulate=False) or adds (True)\n"
"weight * decoded into float32 out. Returns -1, or the index of the first block\n"
"that fails the check, in which case out is untouched.");

static PyObject *py_decode(PyObject *self, PyObject *args) {
    int code, acc;
    float w;
    Py_buffer body, out;
    if (!PyArg_ParseTuple(args, "iy*w*fp", &code, &body, &out, &w, &acc)) return NULL;
    PyObject *result = NULL;
    fmt_t fmt;
    if (get_fmt(code, &fmt) < 0) goto done;
    if (out.len % 4) { PyErr_SetString(PyExc_ValueError, "out is not float32"); goto done; }
    Py_ssize_t n = out.len / 4, nb = (n + BLOCK - 1) / BLOCK;
    if (body.len != nb * (scale_bytes(fmt) + HALF)) {
        PyErr_Format(PyExc_ValueError, "body holds %zd bytes, %zd values need %zd", body.len, n,
                     nb * (scale_bytes(fmt) + HALF));
        goto done;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = check_body(fmt, body.buf, (const uint8_t *)body.buf + nb * scale_bytes(fmt), n);
    if (bad < 0) decode_all(fmt, body.buf, (const uint8_t *)body.buf + nb * scale_bytes(fmt), n, out.buf, w, acc);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&body); PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "4-bit codec kernels.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    for (int k = 0; k < 255; k++) POW2[k] = ldexpf(1.0f, k - 127);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "INT4", FMT_INT4) < 0 || PyModule_AddIntConstant(m, "MXFP4", FMT_MXFP4) < 0 ||
        PyModule_AddIntConstant(m, "BLOCK", BLOCK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
