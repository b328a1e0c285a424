/* Kernels for wire/codec.py: blockwise 4-bit encode with error feedback, and, over the
 * checked codes of one frame chunk, decode, per-range sums of squares, and per-range
 * scaled accumulation, with no float32 copy of the decoded values; decode and
 * accumulation also by runs (a part of a push placed in its fragment, wire/assembled.py).
 *
 * A chunk's body (before zstd), for n values in nb = ceil(n/32) blocks: nb scales
 * (int4: uint16 bfloat16 bits; mxfp4: uint8 E8M0), then nb*16 bytes of codes, 16 per
 * block: byte j holds element j of the block in its low nibble and element j + 16 in
 * its high nibble (both halves load and store as contiguous vectors; no lane
 * shuffles). FP32 chunks are little-endian float32 values and have no scales.
 *
 * Determinism: decoded values are (code value) * scale, both exact in float32, then
 * out += weight * value with one rounding each; built with -ffp-contract=off so no
 * platform fuses them. A learner that rebuilds published weights from deltas gets
 * the shard's bytes exactly. Sums of squares are exact per block (see block_sq) and
 * summed in block order, so they do not depend on the vector width either.
 *
 * Speed: the hot loops are written with GCC/Clang vector extensions (8 float lanes, a
 * block as four vectors), which the x86-64-v3 clone runs as AVX2 and the baseline as
 * SSE2 pairs; INT4 encode computes the scales of 8 blocks with one vector division.
 * Every function here releases the GIL; wire/codec.py runs chunks on threads.
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
/* Helpers are always inlined: only HOT functions are cloned per target, and a helper
 * called out of line would run the baseline (SSE2) code. */
#define INLINE static inline __attribute__((always_inline))

typedef enum { FMT_INT4 = 0, FMT_MXFP4 = 1, FMT_FP32 = 2 } fmt_t;

/* A block's 32 values as four 8-lane vectors (GCC/Clang vector extensions: AVX2 in the
 * x86-64-v3 clone, SSE2 pairs otherwise). Lane order is element order. */
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef struct { f32x8 v[4]; } blk_t;

static float POW2[255]; /* POW2[k] = 2^(k-127), the E8M0 value of code k */

INLINE uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE float rne(float v) { return (v + RNE_MAGIC) - RNE_MAGIC; }
INLINE Py_ssize_t smin(Py_ssize_t a, Py_ssize_t b) { return a < b ? a : b; }
INLINE Py_ssize_t smax(Py_ssize_t a, Py_ssize_t b) { return a > b ? a : b; }

/* y = x + r over one block; returns the max of |y| as float bits (>= INF_BITS: non-finite).
 * Integer max over the bit patterns: one vector compare per 8 lanes, no NaN branches. */
INLINE uint32_t load_block(const float *restrict x, const float *restrict r, float *restrict y, int sub) {
    uint32_t bits[BLOCK];
    if (r && sub)
        for (int i = 0; i < BLOCK; i++) y[i] = x[i] - r[i];
    else if (r)
        for (int i = 0; i < BLOCK; i++) y[i] = x[i] + r[i];
    else
        memcpy(y, x, sizeof(float) * BLOCK);
    for (int i = 0; i < BLOCK; i++) bits[i] = f2u(y[i]) & ABS_MASK;
    uint32_t amax = 0;
    for (int i = 0; i < BLOCK; i++) amax = bits[i] > amax ? bits[i] : amax;
    return amax;
}

/* mask ? a : b, lane-wise, for a mask from a vector comparison (all bits set or clear).
 * A cast between vector types of one size keeps the bits. Macros: a function passing
 * 32-byte vectors by value has another ABI in the baseline build. */
#define USEL(mask, a, b) (((a) & (u32x8)(mask)) | ((b) & ~(u32x8)(mask)))
#define FSEL(mask, a, b) ((f32x8)USEL(mask, (u32x8)(a), (u32x8)(b)))

/* out = w * v (acc = 0), out += w * v (acc = 1), or out = 0 + w * v (acc = 2: what adding
 * into zeros gives, -0 becoming +0, without reading them): one rounding per operation,
 * never fused. */
INLINE void store_blk(const blk_t *b, float w, int acc, float *restrict out) {
    for (int k = 0; k < 4; k++) {
        f32x8 p = w == 1.0f ? b->v[k] : b->v[k] * w, o;
        if (acc == 1) { memcpy(&o, out + 8 * k, sizeof o); p = o + p; }
        else if (acc == 2) p = p + 0.0f;
        memcpy(out + 8 * k, &p, sizeof p);
    }
}

/* out = w * v (acc = 0) or out += w * v: one rounding per operation, never fused. */
INLINE void store_block(const float *restrict v, float w, int acc, float *restrict out) {
    if (!acc)
        for (int i = 0; i < BLOCK; i++) out[i] = w == 1.0f ? v[i] : w * v[i];
    else if (w == 1.0f)
        for (int i = 0; i < BLOCK; i++) out[i] += v[i];
    else
        for (int i = 0; i < BLOCK; i++) out[i] += w * v[i];
}

/* ---- int4: symmetric [-7, 7], bfloat16 scale >= absmax / 7 ---- */

INLINE uint16_t int4_block(const float *restrict y, uint32_t amax_bits, float *restrict r_out,
                                  uint8_t *restrict codes, int publish) {
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
        for (int i = 0; i < BLOCK; i++) r_out[i] = publish ? r_out[i] + (float)q[i] * s : y[i] - (float)q[i] * s;
    for (int j = 0; j < HALF; j++) codes[j] = (uint8_t)((q[j] & 15) | (q[j + HALF] << 4));
    return (uint16_t)(s_bits >> 16);
}

#define GROUP 8 /* blocks whose scales are computed together: one vector division for 8 */

/* int4_block for GROUP whole blocks at once, vectorized: the same bits. x (+ r) must be
 * finite (the caller checks amax first); writes GROUP scales, codes and residuals. */
INLINE void int4_group(const blk_t *restrict y, const uint32_t *restrict amax, float *restrict r_out,
                       uint8_t *restrict scales, uint8_t *restrict codes, int publish) {
    u32x8 bits;
    memcpy(&bits, amax, sizeof bits);
    bits = (u32x8)((f32x8)bits / 7.0f);
    bits += (u32x8)((bits & 0xffffu) != 0u) & 0x10000u; /* round the scale up */
    bits &= 0xffff0000u;
    u32x8 cap = (u32x8){0} + (INT4_MAX_SCALE << 16);
    bits = USEL(bits > cap, cap, bits); /* near FLT_MAX: clip at 7s */
    int32_t packed[GROUP * HALF]; /* code bytes, one per int lane */
    for (int b = 0; b < GROUP; b++) {
        uint16_t s16 = (uint16_t)(bits[b] >> 16);
        memcpy(scales + 2 * b, &s16, 2);
        float s = u2f(bits[b]);
        i32x8 q[4] = {{0}};
        if (s > 0.0f)
            for (int k = 0; k < 4; k++) {
                f32x8 v = y[b].v[k] / s; /* divide: the reciprocal would misround ties */
                v = (v + RNE_MAGIC) - RNE_MAGIC;
                v = FSEL(v > 7.0f, (f32x8){0} + 7.0f, v);
                v = FSEL(v < -7.0f, (f32x8){0} - 7.0f, v);
                q[k] = __builtin_convertvector(v, i32x8);
            }
        if (r_out)
            for (int k = 0; k < 4; k++) {
                f32x8 v = __builtin_convertvector(q[k], f32x8) * s, d = y[b].v[k] - v;
                if (publish) { memcpy(&d, r_out + b * BLOCK + 8 * k, sizeof d); d = d + v; }
                memcpy(r_out + b * BLOCK + 8 * k, &d, sizeof d);
            }
        i32x8 lo = (q[0] & 15) | ((q[2] & 15) << 4), hi = (q[1] & 15) | ((q[3] & 15) << 4);
        memcpy(packed + b * HALF, &lo, sizeof lo);
        memcpy(packed + b * HALF + 8, &hi, sizeof hi);
    }
    /* One narrowing loop over the group: long enough that GCC vectorizes it with packs. */
    for (int j = 0; j < GROUP * HALF; j++) codes[j] = (uint8_t)packed[j];
}

INLINE float int4_scale(const uint8_t *scales, Py_ssize_t b) {
    uint16_t bits;
    memcpy(&bits, scales + 2 * b, 2); /* little-endian on every supported host */
    return u2f((uint32_t)bits << 16);
}
INLINE int int4_scale_ok(uint16_t bits) { return bits <= INT4_MAX_SCALE; } /* also: sign clear, finite */

/* A 4-bit two's complement nibble n as an int: (n ^ 8) - 8 (byte-wide ops vectorize). */
INLINE int int4_of(unsigned n) { return (int)(n ^ 8u) - 8; }

/* The 32 nibbles of a block as four 8-lane int vectors, in element order: elements
 * 0-7 and 8-15 are the low nibbles of bytes 0-7 and 8-15, elements 16-31 the high ones. */
INLINE void nibbles8(const uint8_t *restrict codes, u32x8 n[4]) {
    u8x8 a, b;
    memcpy(&a, codes, 8);
    memcpy(&b, codes + 8, 8);
    n[0] = __builtin_convertvector(a & 15, u32x8);
    n[1] = __builtin_convertvector(b & 15, u32x8);
    n[2] = __builtin_convertvector(a >> 4, u32x8);
    n[3] = __builtin_convertvector(b >> 4, u32x8);
}

INLINE void int4_blk(float s, const uint8_t *restrict codes, blk_t *out) {
    u32x8 n[4];
    nibbles8(codes, n);
    for (int k = 0; k < 4; k++) out->v[k] = __builtin_convertvector((i32x8)(n[k] ^ 8u) - 8, f32x8) * s;
}

/* ---- mxfp4: E2M1 elements, E8M0 scale 2^(floor(log2 absmax) - 2) ---- */

/* The E8M0 shared exponent of a block: floor(log2 absmax) - 2, at least -127. */
INLINE int mxfp4_exponent(uint32_t amax_bits) {
    int e;
    if (amax_bits == 0) e = -127;
    else if (amax_bits < 0x00800000u) { (void)frexpf(u2f(amax_bits), &e); e = e - 1 - 2; }
    else e = (int)(amax_bits >> 23) - 127 - 2;
    return e < -127 ? -127 : e;
}

INLINE uint8_t mxfp4_block(const float *restrict y, uint32_t amax_bits, float *restrict r_out,
                                  uint8_t *restrict codes, int publish) {
    int e = mxfp4_exponent(amax_bits);
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
        for (int i = 0; i < BLOCK; i++) r_out[i] = publish ? r_out[i] + d[i] * scale : y[i] - d[i] * scale;
    for (int j = 0; j < HALF; j++) codes[j] = (uint8_t)(c[j] | (c[j + HALF] << 4));
    return (uint8_t)(e + 127);
}

/* mxfp4_block for GROUP whole blocks, vectorized: the same bits (see int4_group). */
INLINE void mxfp4_group(const blk_t *restrict y, const uint32_t *restrict amax, float *restrict r_out,
                        uint8_t *restrict scales, uint8_t *restrict codes, int publish) {
    int32_t packed[GROUP * HALF];
    const f32x8 zero = {0};
    for (int b = 0; b < GROUP; b++) {
        int e = mxfp4_exponent(amax[b]);
        float scale = POW2[e + 127], inv = POW2[127 - e];
        scales[b] = (uint8_t)(e + 127);
        i32x8 c[4];
        for (int k = 0; k < 4; k++) {
            f32x8 v = y[b].v[k] * inv;
            u32x8 sign = (u32x8)v & 0x80000000u;
            f32x8 a = (f32x8)((u32x8)v & ABS_MASK);
            a = FSEL(a > 6.0f, zero + 6.0f, a);
            /* E2M1 steps: 0.5 below 2, 1 below 4, 2 up to 6. */
            i32x8 below4 = a < 4.0f, below2 = a < 2.0f;
            f32x8 step = FSEL(below2, zero + 0.5f, FSEL(below4, zero + 1.0f, zero + 2.0f));
            f32x8 per = FSEL(below2, zero + 2.0f, FSEL(below4, zero + 1.0f, zero + 0.5f));
            f32x8 base = FSEL(below2, zero, FSEL(below4, zero + 2.0f, zero + 4.0f));
            f32x8 kq = ((a * per) + RNE_MAGIC) - RNE_MAGIC;
            f32x8 idx = kq + base;
            f32x8 neg = FSEL(idx > 0.0f, zero + 8.0f, zero) * __builtin_convertvector((i32x8)(sign >> 31), f32x8);
            c[k] = __builtin_convertvector(idx + neg, i32x8);
            if (r_out) {
                f32x8 d = (f32x8)((u32x8)(kq * step) | sign), res = y[b].v[k] - d * scale;
                if (publish) { memcpy(&res, r_out + b * BLOCK + 8 * k, sizeof res); res = res + d * scale; }
                memcpy(r_out + b * BLOCK + 8 * k, &res, sizeof res);
            }
        }
        i32x8 lo = c[0] | (c[2] << 4), hi = c[1] | (c[3] << 4);
        memcpy(packed + b * HALF, &lo, sizeof lo);
        memcpy(packed + b * HALF + 8, &hi, sizeof hi);
    }
    for (int j = 0; j < GROUP * HALF; j++) codes[j] = (uint8_t)packed[j];
}

/* (2 * |E2M1 value|)^2 of code n: an integer (0, 1, 4, 9, 16, 36, 64 or 144). */
INLINE int fp4_sq4(uint32_t n) {
    uint32_t e = (n >> 1) & 3u, m = n & 1u, t = 2u + m;
    return (int)(e ? (t * t) << (2 * e - 2) : m);
}

INLINE void mxfp4_blk(float s, const uint8_t *restrict codes, blk_t *out) {
    u32x8 n[4];
    nibbles8(codes, n);
    for (int k = 0; k < 4; k++) { /* E2M1 from its bits: e > 0 is 2^(e-1) (1 + m/2); e == 0 is m/2 */
        u32x8 e = (n[k] >> 1) & 3u, m = n[k] & 1u;
        u32x8 normal = ((e + 126u) << 23) | (m << 22), tiny = m * 0x3f000000u;
        out->v[k] = (f32x8)(USEL(e != 0u, normal, tiny) | ((n[k] & 8u) << 28)) * s;
    }
}

/* ---- a chunk: scales + codes (4-bit) or float32 values (FP32), count values ---- */

typedef struct {
    fmt_t fmt;
    const uint8_t *scales; /* 4-bit: nb scales */
    const uint8_t *codes;  /* 4-bit: nb * 16 code bytes; FP32: count float32 values */
    Py_ssize_t count;
} chunk_t;

/* The 32 values of full block b (FP32: b * 32 + 32 <= count). */
INLINE void chunk_blk(const chunk_t *c, Py_ssize_t b, blk_t *out) {
    if (c->fmt == FMT_INT4) int4_blk(int4_scale(c->scales, b), c->codes + b * HALF, out);
    else if (c->fmt == FMT_MXFP4) mxfp4_blk(POW2[c->scales[b]], c->codes + b * HALF, out);
    else memcpy(out, (const float *)c->codes + b * BLOCK, sizeof *out);
}

/* The 32 values of block b (FP32: only lanes below count are read; the rest are 0). */
INLINE void block_values(const chunk_t *c, Py_ssize_t b, float *restrict v) {
    if (c->fmt != FMT_FP32) {
        blk_t t;
        chunk_blk(c, b, &t);
        memcpy(v, &t, sizeof t);
    } else {
        Py_ssize_t len = smin(c->count - b * BLOCK, BLOCK);
        memcpy(v, (const float *)c->codes + b * BLOCK, len * sizeof(float));
        if (len < BLOCK) memset(v + len, 0, (BLOCK - len) * sizeof(float));
    }
}

/* The largest |value| of block b's lanes [lo, hi); with exact = 0 a 4-bit block gives
 * the most its scale allows instead (7 or 6 times it), from the scale alone. */
INLINE double block_max_abs(const chunk_t *c, Py_ssize_t b, int lo, int hi, int exact) {
    if (!exact && c->fmt == FMT_INT4) return 7.0 * (double)int4_scale(c->scales, b);
    if (!exact && c->fmt == FMT_MXFP4) return 6.0 * (double)POW2[c->scales[b]];
    float v[BLOCK];
    block_values(c, b, v);
    uint32_t m = 0;
    for (int i = lo; i < hi; i++) { uint32_t a = f2u(v[i]) & ABS_MASK; m = a > m ? a : m; }
    return (double)u2f(m);
}

/* Sum of squares of block b's lanes [lo, hi), in float64.
 *
 * The definition is a pairwise tree: s[j] = sq[j] + sq[j + w] for w = 16, 8, 4, 2, 1,
 * lanes outside [lo, hi) counting as +0. For 4-bit codes every partial sum of that tree
 * is an integer times scale^2 (int4: sum q^2 <= 1568; mxfp4: sum (2e)^2 <= 4608, times
 * (scale/2)^2) and exact in float64, so the integer sum below is the tree's value. */
INLINE double block_sq(const chunk_t *c, Py_ssize_t b, int lo, int hi) {
    if (c->fmt == FMT_FP32) {
        const float *v = (const float *)c->codes + b * BLOCK;
        double sq[BLOCK];
        for (int i = 0; i < BLOCK; i++) sq[i] = 0.0;
        for (int i = lo; i < hi; i++) sq[i] = (double)v[i] * (double)v[i];
        for (int w = HALF; w >= 1; w /= 2)
            for (int j = 0; j < w; j++) sq[j] = sq[j] + sq[j + w];
        return sq[0];
    }
    const uint8_t *codes = c->codes + b * HALF;
    int sum = 0;
    if (c->fmt == FMT_INT4) {
        if (lo == 0 && hi == BLOCK) {
            for (int j = 0; j < HALF; j++) {
                int l = int4_of(codes[j] & 15u), h = int4_of(codes[j] >> 4);
                sum += l * l + h * h;
            }
        } else {
            for (int i = lo; i < hi; i++) {
                int q = int4_of(i < HALF ? codes[i] & 15u : codes[i - HALF] >> 4);
                sum += q * q;
            }
        }
        double s = (double)int4_scale(c->scales, b);
        return (double)sum * (s * s);
    }
    if (lo == 0 && hi == BLOCK)
        for (int j = 0; j < HALF; j++) sum += fp4_sq4(codes[j] & 15u) + fp4_sq4(codes[j] >> 4);
    else
        for (int i = lo; i < hi; i++) sum += fp4_sq4(i < HALF ? codes[i] & 15u : codes[i - HALF] >> 4);
    double s = 0.5 * (double)POW2[c->scales[b]];
    return (double)sum * (s * s);
}

/* ---- drivers ---- */

/* Returns -1 on success, else the index of the first non-finite input (nothing then
 * is meaningful in the outputs, and the caller discards them). */
HOT static Py_ssize_t encode_all(fmt_t fmt, const float *x, const float *r, float *r_out, Py_ssize_t n,
                                 uint8_t *scales, uint8_t *codes, int publish) {
    Py_ssize_t nb = (n + BLOCK - 1) / BLOCK, b = 0;
    float y[BLOCK], tx[BLOCK], tr[BLOCK], tro[BLOCK];
    for (; (b + GROUP) * BLOCK <= n; b += GROUP) { /* groups of whole blocks, vectorized */
        blk_t yg[GROUP];
        uint32_t amax[GROUP], worst = 0;
        for (int g = 0; g < GROUP; g++) {
            const float *bx = x + (b + g) * BLOCK, *br = r ? r + (b + g) * BLOCK : NULL;
            u32x8 m = {0};
            for (int k = 0; k < 4; k++) {
                f32x8 v, t;
                memcpy(&v, bx + 8 * k, sizeof v);
                if (br) { memcpy(&t, br + 8 * k, sizeof t); v = publish ? v - t : v + t; }
                yg[g].v[k] = v;
                u32x8 u = (u32x8)v & ABS_MASK;
                m = USEL(u > m, u, m); /* integer max of |y| bits: no NaN branches */
            }
            amax[g] = 0;
            for (int l = 0; l < 8; l++) amax[g] = m[l] > amax[g] ? m[l] : amax[g];
            worst = amax[g] > worst ? amax[g] : worst;
        }
        if (worst >= INF_BITS) break; /* the block-at-a-time loop finds and reports it */
        if (fmt == FMT_INT4)
            int4_group(yg, amax, r_out ? r_out + b * BLOCK : NULL, scales + 2 * b, codes + b * HALF, publish);
        else
            mxfp4_group(yg, amax, r_out ? r_out + b * BLOCK : NULL, scales + b, codes + b * HALF, publish);
    }
    for (; b < nb; b++) { /* the rest (and a group holding a non-finite value) one block at a time */
        Py_ssize_t off = b * BLOCK, len = n - off < BLOCK ? n - off : BLOCK;
        const float *bx = x + off, *br = r ? r + off : NULL;
        float *bro = r_out ? r_out + off : NULL;
        if (len < BLOCK) { /* pad the tail block with zeros */
            memset(tx, 0, sizeof tx); memset(tr, 0, sizeof tr);
            memcpy(tx, bx, len * sizeof(float));
            if (br) { memcpy(tr, br, len * sizeof(float)); br = tr; }
            bx = tx; bro = r_out ? tro : NULL;
            if (publish && r_out) memcpy(tro, r_out + off, len * sizeof(float));
        }
        uint32_t amax = load_block(bx, br, y, publish);
        if (amax >= INF_BITS) {
            for (Py_ssize_t i = 0; i < len; i++)
                if (!isfinite(y[i])) return off + i;
        }
        if (fmt == FMT_INT4) {
            uint16_t s = int4_block(y, amax, bro, codes + b * HALF, publish);
            memcpy(scales + 2 * b, &s, 2);
        } else {
            scales[b] = mxfp4_block(y, amax, bro, codes + b * HALF, publish);
        }
        if (bro == tro) memcpy(r_out + off, tro, len * sizeof(float));
    }
    return -1;
}

/* Returns -1 when the chunk is valid, else (4-bit) the index of the first bad block: a
 * scale out of range, or a nonzero code in the padding after the last value; (FP32)
 * the index of the first non-finite value. */
HOT static Py_ssize_t check_chunk(const chunk_t *c) {
    Py_ssize_t n = c->count, nb = (n + BLOCK - 1) / BLOCK;
    if (c->fmt == FMT_FP32) {
        const float *v = (const float *)c->codes;
        for (Py_ssize_t off = 0; off < n; off += BLOCK) { /* one vector test per block */
            Py_ssize_t len = smin(n - off, BLOCK);
            uint32_t amax = 0;
            for (Py_ssize_t i = 0; i < len; i++) { uint32_t a = f2u(v[off + i]) & ABS_MASK; amax = a > amax ? a : amax; }
            if (amax >= INF_BITS)
                for (Py_ssize_t i = 0; i < len; i++)
                    if (!isfinite(v[off + i])) return off + i;
        }
        return -1;
    }
    if (c->fmt == FMT_INT4) {
        uint16_t worst = 0; /* scan without branching, then find the block */
        for (Py_ssize_t b = 0; b < nb; b++) { uint16_t s; memcpy(&s, c->scales + 2 * b, 2); worst = s > worst ? s : worst; }
        if (!int4_scale_ok(worst))
            for (Py_ssize_t b = 0; b < nb; b++) { uint16_t s; memcpy(&s, c->scales + 2 * b, 2); if (!int4_scale_ok(s)) return b; }
    } else {
        for (Py_ssize_t b = 0; b < nb; b++)
            if (c->scales[b] > MXFP4_MAX_SCALE) return b;
    }
    Py_ssize_t tail = n % BLOCK;
    if (tail) {
        const uint8_t *last = c->codes + (nb - 1) * HALF;
        for (Py_ssize_t i = tail; i < BLOCK; i++) {
            uint8_t nibble = i < HALF ? last[i] & 15 : last[i - HALF] >> 4;
            if (nibble) return nb - 1;
        }
    }
    return -1;
}

/* out[0:count] = w * values (acc = 0) or += (acc = 1). The chunk must have passed check_chunk. */
HOT static void decode_chunk(const chunk_t *c, float *out, float w, int acc) {
    Py_ssize_t n = c->count, nb = n / BLOCK;
    blk_t v;
    for (Py_ssize_t b = 0; b < nb; b++) {
        chunk_blk(c, b, &v);
        store_blk(&v, w, acc, out + b * BLOCK);
    }
    Py_ssize_t tail = n - nb * BLOCK;
    if (tail) {
        float t[BLOCK];
        block_values(c, nb, (float *)&v);
        memcpy(t, out + nb * BLOCK, tail * sizeof(float));
        store_block((const float *)&v, w, acc, t);
        memcpy(out + nb * BLOCK, t, tail * sizeof(float));
    }
}

/* block_sq's pairwise tree over 32 float32 values, four lanes at a time: the same sums. */
INLINE double tree_sq(const float *v) {
    f64x4 q[8];
    for (int k = 0; k < 8; k++) {
        f32x4 x;
        memcpy(&x, v + 4 * k, sizeof x);
        f64x4 d = __builtin_convertvector(x, f64x4);
        q[k] = d * d;
    }
    for (int k = 0; k < 4; k++) q[k] = q[k] + q[k + 4]; /* sq[j] + sq[j + 16] */
    for (int k = 0; k < 2; k++) q[k] = q[k] + q[k + 2]; /* sq[j] + sq[j + 8] */
    f64x4 t = q[0] + q[1];                              /* sq[j] + sq[j + 4] */
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* Sum of squares of the 32 values of full block b, as block_sq(c, b, 0, 32). */
INLINE double full_block_sq(const chunk_t *c, Py_ssize_t b) {
    if (c->fmt == FMT_FP32) return tree_sq((const float *)c->codes + b * BLOCK);
    if (c->fmt == FMT_INT4) {
        /* q^2 of each nibble from a 16-entry table (one byte shuffle for 16 codes), a
         * byte's two added as bytes (<= 128), then the 16 summed: integers, exact */
        const u8x16 sq = {0, 1, 4, 9, 16, 25, 36, 49, 64, 49, 36, 25, 16, 9, 4, 1};
        u8x16 x;
        memcpy(&x, c->codes + b * HALF, sizeof x);
        u8x16 t = __builtin_shuffle(sq, x & 15) + __builtin_shuffle(sq, x >> 4);
        int total = 0;
        for (int k = 0; k < HALF; k++) total += t[k];
        double s = (double)int4_scale(c->scales, b);
        return (double)total * (s * s);
    }
    u32x8 n[4];
    i32x8 sum = {0};
    nibbles8(c->codes + b * HALF, n);
    for (int k = 0; k < 4; k++) { /* fp4_sq4, lane-wise */
        u32x8 e = (n[k] >> 1) & 3u, m = n[k] & 1u, t = 2u + m;
        i32x8 normal = e != 0u;
        sum += (i32x8)USEL(normal, (t * t) << ((2u * e - 2u) & (u32x8)normal), m);
    }
    double s = 0.5 * (double)POW2[c->scales[b]];
    int total = 0; /* integers: any order is exact */
    for (int k = 0; k < 8; k++) total += sum[k];
    return (double)total * (s * s);
}

/* The bound block_max_abs(exact = 0) gives over the blocks of values [a, b) of a 4-bit
 * chunk, the largest of them (0.0 for none), read from the scales as integers: a scale's
 * bits order as its value where the sign is clear (others give no bound above 0).
 * Returns 0 (nothing written) where a scale is not finite: the block loop then decides. */
INLINE int scale_peak(const chunk_t *c, Py_ssize_t a, Py_ssize_t b, double *out) {
    Py_ssize_t b0 = a / BLOCK, b1 = a < b ? (b + BLOCK - 1) / BLOCK : b0;
    unsigned top = 0;
    if (c->fmt == FMT_INT4) {
        uint16_t m = 0;
        for (Py_ssize_t k = b0; k < b1; k++) {
            uint16_t s;
            memcpy(&s, c->scales + 2 * k, 2);
            s = s < 0x8000u ? s : 0; /* a negative scale bounds nothing above 0 */
            m = s > m ? s : m;
        }
        if (m >= 0x7f80u) return 0; /* inf or NaN */
        top = m;
        *out = top ? 7.0 * (double)u2f((uint32_t)top << 16) : 0.0;
        return 1;
    }
    uint8_t m = 0;
    for (Py_ssize_t k = b0; k < b1; k++) m = c->scales[k] > m ? c->scales[k] : m;
    if (m > 254) return 0; /* not an E8M0 value POW2 holds */
    *out = b1 > b0 ? 6.0 * (double)POW2[m] : 0.0;
    return 1;
}

/* Σ block_sq over the blocks of values [a, b) (a < b) of the chunk, from 0.0 in block
 * order: what range_stats' block loop sums, taking a full block's sum from known (per
 * block of the vector; start is a multiple of BLOCK) where it is >= 0. */
INLINE double known_sq(const chunk_t *c, Py_ssize_t start, Py_ssize_t a, Py_ssize_t b, const double *known) {
    Py_ssize_t first = (a + BLOCK - 1) / BLOCK, last = b / BLOCK; /* full blocks [first, last) */
    const double *k = known + start / BLOCK;
    double total = 0.0;
    if (first > last) /* a and b within one block */
        return total + block_sq(c, a / BLOCK, (int)(a % BLOCK), (int)(b - (a / BLOCK) * BLOCK));
    if (a % BLOCK) total += block_sq(c, a / BLOCK, (int)(a % BLOCK), BLOCK);
    for (Py_ssize_t blk = first; blk < last; blk++) total += k[blk] >= 0.0 ? k[blk] : full_block_sq(c, blk);
    if (b % BLOCK) total += block_sq(c, last, 0, (int)(b % BLOCK));
    return total;
}

/* sq[r] = sum over the blocks of range r in this chunk, in block order from 0.0, of
 * block_sq; max_abs[r] = the largest |value| there (exact = 0: a bound from the scales).
 * Ranges are [offsets[r] - start, ends[r] - start) clipped to the chunk. known (or NULL):
 * per block of the whole vector (start is a multiple of BLOCK), the sum of squares of a
 * full block where it is already known (>= 0; decode_runs leaves it), taken as it is. */
HOT static void range_stats(const chunk_t *c, Py_ssize_t start, const int64_t *offsets, const int64_t *ends,
                            Py_ssize_t nr, double *sq, double *max_abs, int exact, const double *known) {
    for (Py_ssize_t r = 0; r < nr; r++) {
        Py_ssize_t a = smax(offsets[r] - start, 0), b = smin(ends[r] - start, c->count);
        double total = 0.0, m = 0.0;
        if (!sq && max_abs && !exact && c->fmt != FMT_FP32 && scale_peak(c, a, b, &m)) { max_abs[r] = m; continue; }
        if (sq && !max_abs && known && a < b) { sq[r] = known_sq(c, start, a, b, known); continue; }
        for (Py_ssize_t blk = a / BLOCK; a < b && blk * BLOCK < b; blk++) {
            int lo = (int)smax(a - blk * BLOCK, 0), hi = (int)smin(b - blk * BLOCK, BLOCK);
            if (sq && lo == 0 && hi == BLOCK) {
                double k = known ? known[start / BLOCK + blk] : -1.0;
                total += k >= 0.0 ? k : full_block_sq(c, blk);
            } else if (sq) {
                total += block_sq(c, blk, lo, hi);
            }
            if (max_abs) { double x = block_max_abs(c, blk, lo, hi, exact); m = x > m ? x : m; }
        }
        if (sq) sq[r] = total;
        if (max_abs) max_abs[r] = m;
    }
}

/* out[start + i] += w[r] * value_i for i in range r (w[r] == 0: skipped). add = 0 writes
 * out[start + i] = 0 + w[r] * value_i instead, the same bits as adding into zeros, without
 * reading out (w[r] == 0: zeros). check = 1 only computes the sums and returns the first
 * global index where one is not finite (-1: none). */
HOT static Py_ssize_t accumulate_ranges(const chunk_t *c, Py_ssize_t start, const int64_t *offsets,
                                        const int64_t *ends, const float *ws, Py_ssize_t nr, float *out,
                                        int check, int add) {
    float v[BLOCK];
    for (Py_ssize_t r = 0; r < nr; r++) {
        float w = ws[r];
        Py_ssize_t a = smax(offsets[r] - start, 0), b = smin(ends[r] - start, c->count);
        if (a >= b) continue;
        if (w == 0.0f) {
            if (!add && !check) memset(out + start + a, 0, (size_t)(b - a) * sizeof(float));
            continue;
        }
        for (Py_ssize_t blk = a / BLOCK; blk * BLOCK < b; blk++) {
            int lo = (int)smax(a - blk * BLOCK, 0), hi = (int)smin(b - blk * BLOCK, BLOCK);
            float *o = out + start + blk * BLOCK;
            if (!check && lo == 0 && hi == BLOCK) { /* the bulk: whole blocks as vectors */
                blk_t t;
                chunk_blk(c, blk, &t);
                store_blk(&t, w, add ? 1 : 2, o);
                continue;
            }
            block_values(c, blk, v);
            if (check) {
                uint32_t worst = 0;
                for (int i = lo; i < hi; i++) {
                    float p = w * v[i];
                    uint32_t t = f2u(add ? o[i] + p : p) & ABS_MASK;
                    worst = t > worst ? t : worst;
                }
                if (worst >= INF_BITS)
                    for (int i = lo; i < hi; i++) {
                        float p = w * v[i];
                        if (!isfinite(add ? o[i] + p : p)) return start + blk * BLOCK + i;
                    }
            } else {
                for (int i = lo; i < hi; i++) {
                    float p = w * v[i]; /* multiply, then add: never fused */
                    o[i] = (add ? o[i] : 0.0f) + p;
                }
            }
        }
    }
    return -1;
}

/* Writes the values of chunk values [a, b) (within one run: out index i + shift) into out,
 * block by block of the chunk: the bits decode_chunk writes (w = 1). */
INLINE void write_values(const chunk_t *c, Py_ssize_t a, Py_ssize_t b, Py_ssize_t shift, float *out) {
    float v[BLOCK];
    for (Py_ssize_t blk = a / BLOCK; a < b && blk * BLOCK < b; blk++) {
        int lo = (int)smax(a - blk * BLOCK, 0), hi = (int)smin(b - blk * BLOCK, BLOCK);
        Py_ssize_t at = blk * BLOCK + shift + lo; /* out index of lane lo */
        if (lo == 0 && hi == BLOCK) { /* the bulk: whole blocks as vectors */
            blk_t t;
            chunk_blk(c, blk, &t);
            store_blk(&t, 1.0f, 0, out + at);
            continue;
        }
        block_values(c, blk, v);
        memcpy(out + at, v + lo, (size_t)(hi - lo) * sizeof(float));
    }
}

/* Run r of a part: values [src[r], src[r] + len[r]) of the part's vector go to
 * [dst[r], dst[r] + len[r]) of out. Writes the values of this chunk (part values
 * [start, start + count)) that the runs hold into their places in out: the bits
 * decode_chunk writes (w = 1), with no copy of the part between. known (or NULL): each
 * whole block of out that this chunk's values of one run fill gets its sum of squares
 * (block_sq's pairwise tree over its 32 values: from the codes where one block of the
 * chunk fills it, full_block_sq, exact for 4-bit codes; else tree_sq over the values of
 * the two chunk blocks it straddles, assembled on the stack), so range_stats over out need
 * not read it; with skip_known such a block is not written at all (accumulate_runs reads
 * the codes again for its sums). The blocks of out no one run fills whole within this
 * chunk (a run's ends) are always written. */
HOT static void decode_runs(const chunk_t *c, Py_ssize_t start, const int64_t *src, const int64_t *dst,
                            const int64_t *len, Py_ssize_t nr, float *out, double *known, int skip_known) {
    float buf[2 * BLOCK];
    for (Py_ssize_t r = 0; r < nr; r++) {
        Py_ssize_t a = smax(src[r] - start, 0), b = smin(src[r] + len[r] - start, c->count);
        Py_ssize_t shift = dst[r] - src[r] + start; /* out index of chunk value i: i + shift */
        if (a >= b) continue;
        if (!known) { write_values(c, a, b, shift, out); continue; }
        /* out blocks [f0, f1) lie whole within out [a + shift, b + shift) */
        Py_ssize_t f0 = (a + shift + BLOCK - 1) / BLOCK, f1 = (b + shift) / BLOCK;
        if (f0 >= f1) { write_values(c, a, b, shift, out); continue; }
        write_values(c, a, f0 * BLOCK - shift, shift, out); /* the run's head */
        Py_ssize_t held = -1; /* the chunk block whose values buf[BLOCK:] holds */
        for (Py_ssize_t f = f0; f < f1; f++) {
            Py_ssize_t i0 = f * BLOCK - shift, b0 = i0 / BLOCK; /* chunk values [i0, i0 + 32) */
            int off = (int)(i0 - b0 * BLOCK);
            float *o = out + f * BLOCK;
            if (off == 0) { /* one chunk block fills it: its sum from the codes */
                known[f] = full_block_sq(c, b0);
                if (!skip_known) { blk_t t; chunk_blk(c, b0, &t); store_blk(&t, 1.0f, 0, o); }
                continue;
            }
            if (held == b0) memcpy(buf, buf + BLOCK, sizeof(float) * BLOCK);
            else block_values(c, b0, buf);
            block_values(c, b0 + 1, buf + BLOCK); /* exists: i0 + 31 < b <= count */
            held = b0 + 1;
            known[f] = tree_sq(buf + off); /* the 32 values, in L1 */
            if (!skip_known) memcpy(o, buf + off, sizeof(float) * BLOCK);
        }
        write_values(c, f1 * BLOCK - shift, b, shift, out); /* the run's tail */
    }
}

/* accumulate_ranges over a part's runs (see decode_runs): out[dst[r] + j] += ws[r] *
 * value[src[r] + j] for the values of this chunk (add = 0: 0 + ws[r] * value, zeros where
 * ws[r] is 0, without reading out). The same operations on the same values as
 * accumulate_ranges over the vector the runs assemble: the same bits. No check: the
 * caller has bounded every sum (or uses accumulate_ranges' check). */
HOT static void accumulate_runs(const chunk_t *c, Py_ssize_t start, const int64_t *src, const int64_t *dst,
                                const int64_t *len, const float *ws, Py_ssize_t nr, float *out, int add) {
    float v[BLOCK];
    for (Py_ssize_t r = 0; r < nr; r++) {
        float w = ws[r];
        Py_ssize_t a = smax(src[r] - start, 0), b = smin(src[r] + len[r] - start, c->count);
        Py_ssize_t shift = dst[r] - src[r] + start; /* out index of chunk value i: i + shift */
        if (a >= b) continue;
        if (w == 0.0f) {
            if (!add) memset(out + (a + shift), 0, (size_t)(b - a) * sizeof(float));
            continue;
        }
        for (Py_ssize_t blk = a / BLOCK; blk * BLOCK < b; blk++) {
            int lo = (int)smax(a - blk * BLOCK, 0), hi = (int)smin(b - blk * BLOCK, BLOCK);
            float *o = out + (blk * BLOCK + shift + lo); /* lane lo's place */
            if (lo == 0 && hi == BLOCK) { /* the bulk: whole blocks as vectors */
                blk_t t;
                chunk_blk(c, blk, &t);
                store_blk(&t, w, add ? 1 : 2, o);
                continue;
            }
            block_values(c, blk, v);
            for (int i = lo; i < hi; i++) {
                float p = w * v[i]; /* multiply, then add: never fused */
                o[i - lo] = (add ? o[i - lo] : 0.0f) + p;
            }
        }
    }
}

/* ---- Python bindings ---- */

static Py_ssize_t scale_bytes(fmt_t fmt) { return fmt == FMT_INT4 ? 2 : fmt == FMT_MXFP4 ? 1 : 0; }

static int get_fmt(int code, fmt_t *fmt) {
    if (code == FMT_INT4 || code == FMT_MXFP4 || code == FMT_FP32) { *fmt = (fmt_t)code; return 0; }
    PyErr_Format(PyExc_ValueError, "unknown kernel format %d", code);
    return -1;
}

/* Fills a chunk from (fmt, scales, codes, count) buffers, checking their lengths. */
static int get_chunk(int code, Py_buffer *scales, Py_buffer *codes, Py_ssize_t count, chunk_t *c) {
    if (get_fmt(code, &c->fmt) < 0) return -1;
    if (count < 0) { PyErr_SetString(PyExc_ValueError, "negative count"); return -1; }
    Py_ssize_t nb = (count + BLOCK - 1) / BLOCK;
    Py_ssize_t want_s = c->fmt == FMT_FP32 ? 0 : nb * scale_bytes(c->fmt);
    Py_ssize_t want_c = c->fmt == FMT_FP32 ? 4 * count : nb * HALF;
    if (scales->len != want_s || codes->len != want_c) {
        PyErr_Format(PyExc_ValueError, "chunk of %zd values needs %zd scale and %zd code bytes, got %zd and %zd",
                     count, want_s, want_c, scales->len, codes->len);
        return -1;
    }
    if (c->fmt == FMT_FP32 && ((uintptr_t)codes->buf % 4)) {
        PyErr_SetString(PyExc_ValueError, "float32 values are not 4-byte aligned");
        return -1;
    }
    c->scales = scales->buf;
    c->codes = codes->buf;
    c->count = count;
    return 0;
}

/* Checks that nr runs (a part's src[r], its place dst[r] and length n[r]) each lie within
   an output of out_n values; sets ValueError naming the first that does not. */
static int runs_within(const int64_t *s, const int64_t *d, const int64_t *n, Py_ssize_t nr, Py_ssize_t out_n) {
    for (Py_ssize_t r = 0; r < nr; r++)
        if (s[r] < 0 || n[r] < 0 || d[r] < 0 || d[r] > out_n - n[r]) {
            PyErr_Format(PyExc_ValueError, "run %zd ([%lld, +%lld) to %lld) lies outside out", r, (long long)s[r],
                         (long long)n[r], (long long)d[r]);
            return -1;
        }
    return 0;
}

/* Checks a ranges triple: int64 offsets and ends of nr ranges, and an output of nr items. */
static int get_ranges(Py_buffer *offsets, Py_buffer *ends, Py_buffer *per_range, Py_ssize_t item, Py_ssize_t *nr) {
    *nr = offsets->len / 8;
    if (offsets->len % 8 || ends->len != offsets->len || per_range->len != *nr * item ||
        ((uintptr_t)offsets->buf % 8) || ((uintptr_t)ends->buf % 8) || ((uintptr_t)per_range->buf % item)) {
        PyErr_SetString(PyExc_ValueError, "offsets and ends must be aligned int64 arrays with one output per range");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(encode_doc,
"encode(fmt, x, residual, residual_out, body, publish=False) -> int\n\n"
"Quantises float32 x (+ residual when not None) into body (scales then codes; 4-bit\n"
"formats only). Writes x + residual - decoded into residual_out when not None. Returns\n"
"-1, or the index of the first non-finite value (outputs are then meaningless).\n"
"publish=True quantises x - residual instead and adds each decoded value to\n"
"residual_out (residual_out[i] + 1.0 * value, the bits decode_into gives); residual_out\n"
"may be residual itself.");

static PyObject *py_encode(PyObject *self, PyObject *args) {
    int code, publish = 0;
    Py_buffer x, r = {0}, ro = {0}, body;
    PyObject *r_obj, *ro_obj;
    if (!PyArg_ParseTuple(args, "iy*OOw*|p", &code, &x, &r_obj, &ro_obj, &body, &publish)) return NULL;
    PyObject *result = NULL;
    int have_r = 0, have_ro = 0;
    fmt_t fmt;
    if (get_fmt(code, &fmt) < 0) goto done;
    if (fmt == FMT_FP32) { PyErr_SetString(PyExc_ValueError, "encode takes a 4-bit format"); goto done; }
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
                     (uint8_t *)body.buf + nb * scale_bytes(fmt), publish);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&x); PyBuffer_Release(&body);
    if (have_r) PyBuffer_Release(&r);
    if (have_ro) PyBuffer_Release(&ro);
    return result;
}

PyDoc_STRVAR(check_doc,
"check(fmt, scales, codes, count) -> int\n\n"
"Checks one chunk: every scale in range and the tail block's padding zero (4-bit), or\n"
"every value finite (FP32). Returns -1, else the first bad block (4-bit) or value (FP32).");

static PyObject *py_check(PyObject *self, PyObject *args) {
    int code;
    Py_ssize_t count;
    Py_buffer scales, codes;
    if (!PyArg_ParseTuple(args, "iy*y*n", &code, &scales, &codes, &count)) return NULL;
    PyObject *result = NULL;
    chunk_t c;
    if (get_chunk(code, &scales, &codes, count, &c) == 0) {
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = check_chunk(&c);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&scales); PyBuffer_Release(&codes);
    return result;
}

PyDoc_STRVAR(decode_doc,
"decode(fmt, scales, codes, out, weight, accumulate) -> None\n\n"
"Writes (accumulate=False) or adds (True) weight * values of a checked chunk into\n"
"float32 out, which holds exactly the chunk's values.");

static PyObject *py_decode(PyObject *self, PyObject *args) {
    int code, acc;
    float w;
    Py_buffer scales, codes, out;
    if (!PyArg_ParseTuple(args, "iy*y*w*fp", &code, &scales, &codes, &out, &w, &acc)) return NULL;
    PyObject *result = NULL;
    chunk_t c;
    if (out.len % 4 || (uintptr_t)out.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "out is not aligned float32");
    } else if (get_chunk(code, &scales, &codes, out.len / 4, &c) == 0) {
        Py_BEGIN_ALLOW_THREADS
        decode_chunk(&c, out.buf, w, acc);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&scales); PyBuffer_Release(&codes); PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(range_stats_doc,
"range_stats(fmt, scales, codes, count, start, offsets, ends, sq, max_abs, exact, known=None) -> None\n\n"
"For the chunk holding values [start, start + count) of a vector and int64 ranges\n"
"[offsets[r], ends[r]) of that vector: sq[r] (float64, or None) = the range's sum of\n"
"squares within the chunk, in block order; max_abs[r] (float64, or None) = the largest\n"
"|value| there (exact=False: for 4-bit, 7 or 6 times the largest scale, a bound).\n"
"known (float64 per block of the vector, or None): full blocks' sums of squares where\n"
"already known (>= 0), taken instead of reading their values.");

static PyObject *py_range_stats(PyObject *self, PyObject *args) {
    int code, exact;
    Py_ssize_t count, start;
    Py_buffer scales, codes, offsets, ends, sq = {0}, mx = {0}, kn = {0};
    PyObject *sq_obj, *mx_obj, *kn_obj = Py_None;
    if (!PyArg_ParseTuple(args, "iy*y*nny*y*OOp|O", &code, &scales, &codes, &count, &start, &offsets, &ends,
                          &sq_obj, &mx_obj, &exact, &kn_obj)) return NULL;
    PyObject *result = NULL;
    int have_sq = 0, have_mx = 0, have_kn = 0;
    chunk_t c;
    Py_ssize_t nr;
    if (get_chunk(code, &scales, &codes, count, &c) < 0) goto done;
    if (sq_obj != Py_None) { if (PyObject_GetBuffer(sq_obj, &sq, PyBUF_WRITABLE) < 0) goto done; have_sq = 1; }
    if (mx_obj != Py_None) { if (PyObject_GetBuffer(mx_obj, &mx, PyBUF_WRITABLE) < 0) goto done; have_mx = 1; }
    if (get_ranges(&offsets, &ends, have_sq ? &sq : &mx, 8, &nr) < 0) goto done;
    if (have_sq && have_mx && mx.len != sq.len) { PyErr_SetString(PyExc_ValueError, "sq and max_abs differ"); goto done; }
    if (kn_obj != Py_None) {
        if (PyObject_GetBuffer(kn_obj, &kn, PyBUF_SIMPLE) < 0) goto done;
        have_kn = 1;
        if (kn.len % 8 || (uintptr_t)kn.buf % 8 || start % BLOCK || start < 0 ||
            kn.len / 8 < (start + count + BLOCK - 1) / BLOCK) {
            PyErr_SetString(PyExc_ValueError, "known must be aligned float64, one per block of the vector");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    range_stats(&c, start, offsets.buf, ends.buf, nr, have_sq ? sq.buf : NULL, have_mx ? mx.buf : NULL, exact,
                have_kn ? kn.buf : NULL);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&scales); PyBuffer_Release(&codes); PyBuffer_Release(&offsets); PyBuffer_Release(&ends);
    if (have_sq) PyBuffer_Release(&sq);
    if (have_mx) PyBuffer_Release(&mx);
    if (have_kn) PyBuffer_Release(&kn);
    return result;
}

PyDoc_STRVAR(accumulate_doc,
"accumulate(fmt, scales, codes, count, start, offsets, ends, weights, out, check, add=True) -> int\n\n"
"For the chunk holding values [start, start + count) of float32 vector out and int64\n"
"ranges [offsets[r], ends[r)): out[i] += float32 weights[r] * value_i (multiply, then\n"
"add; ranges with weight 0 skipped). check=True writes nothing and returns the first\n"
"index whose sum would not be finite (-1: none). add=False writes 0 + weights[r] * value_i\n"
"over every range (zeros where the weight is 0) without reading out: the bits adding into\n"
"zeros gives.");

static PyObject *py_accumulate(PyObject *self, PyObject *args) {
    int code, check, add = 1;
    Py_ssize_t count, start;
    Py_buffer scales, codes, offsets, ends, ws, out;
    if (!PyArg_ParseTuple(args, "iy*y*nny*y*y*w*p|p", &code, &scales, &codes, &count, &start, &offsets, &ends,
                          &ws, &out, &check, &add)) return NULL;
    PyObject *result = NULL;
    chunk_t c;
    Py_ssize_t nr;
    if (get_chunk(code, &scales, &codes, count, &c) < 0 || get_ranges(&offsets, &ends, &ws, 4, &nr) < 0) goto done;
    if (out.len % 4 || (uintptr_t)out.buf % 4 || start < 0 || start + count > out.len / 4) {
        PyErr_SetString(PyExc_ValueError, "out is not an aligned float32 vector holding the chunk");
        goto done;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = accumulate_ranges(&c, start, offsets.buf, ends.buf, ws.buf, nr, out.buf, check, add);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&scales); PyBuffer_Release(&codes); PyBuffer_Release(&offsets); PyBuffer_Release(&ends);
    PyBuffer_Release(&ws); PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(decode_runs_doc,
"decode_runs(fmt, scales, codes, count, start, src, dst, lengths, out, known=None,\n"
"            skip_known=False) -> None\n\n"
"For the chunk holding values [start, start + count) of a part and int64 runs (values\n"
"[src[r], src[r] + lengths[r]) of the part belong at [dst[r], dst[r] + lengths[r]) of\n"
"float32 out): writes every value of the chunk that a run holds into its place in out,\n"
"the bits decode writes. Runs must lie within out. known (float64, one per block of out,\n"
"or None) gets the sum of squares of each whole block of out that the chunk's values of\n"
"one run fill (range_stats' known); skip_known=True leaves such blocks unwritten.");

static PyObject *py_decode_runs(PyObject *self, PyObject *args) {
    int code;
    Py_ssize_t count, start, nr;
    Py_buffer scales, codes, src, dst, lens, out, kn = {0};
    PyObject *kn_obj = Py_None;
    int skip = 0;
    if (!PyArg_ParseTuple(args, "iy*y*nny*y*y*w*|Op", &code, &scales, &codes, &count, &start, &src, &dst, &lens,
                          &out, &kn_obj, &skip)) return NULL;
    PyObject *result = NULL;
    int have_kn = 0;
    chunk_t c;
    if (get_chunk(code, &scales, &codes, count, &c) < 0 || get_ranges(&src, &dst, &lens, 8, &nr) < 0) goto done;
    if (out.len % 4 || (uintptr_t)out.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "out is not an aligned float32 vector");
        goto done;
    }
    if (kn_obj != Py_None) {
        if (PyObject_GetBuffer(kn_obj, &kn, PyBUF_WRITABLE) < 0) goto done;
        have_kn = 1;
        if (kn.len % 8 || (uintptr_t)kn.buf % 8 || kn.len / 8 < (out.len / 4 + BLOCK - 1) / BLOCK) {
            PyErr_SetString(PyExc_ValueError, "known must be aligned float64, one per block of out");
            goto done;
        }
    }
    const int64_t *s = src.buf, *d = dst.buf, *n = lens.buf;
    if (runs_within(s, d, n, nr, out.len / 4) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    decode_runs(&c, start, s, d, n, nr, out.buf, have_kn ? kn.buf : NULL, skip);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&scales); PyBuffer_Release(&codes); PyBuffer_Release(&src); PyBuffer_Release(&dst);
    PyBuffer_Release(&lens); PyBuffer_Release(&out);
    if (have_kn) PyBuffer_Release(&kn);
    return result;
}

PyDoc_STRVAR(accumulate_runs_doc,
"accumulate_runs(fmt, scales, codes, count, start, src, dst, lengths, weights, out, add) -> None\n\n"
"accumulate's sums over a part's runs (see decode_runs): out[dst[r] + j] += float32\n"
"weights[r] * value[src[r] + j] for the chunk's values (add=False: 0 + weights[r] * value,\n"
"zeros where the weight is 0, without reading out). No overflow check. Runs must lie\n"
"within out.");

static PyObject *py_accumulate_runs(PyObject *self, PyObject *args) {
    int code, add;
    Py_ssize_t count, start, nr;
    Py_buffer scales, codes, src, dst, lens, ws, out;
    if (!PyArg_ParseTuple(args, "iy*y*nny*y*y*y*w*p", &code, &scales, &codes, &count, &start, &src, &dst, &lens,
                          &ws, &out, &add)) return NULL;
    PyObject *result = NULL;
    chunk_t c;
    if (get_chunk(code, &scales, &codes, count, &c) < 0 || get_ranges(&src, &dst, &lens, 8, &nr) < 0) goto done;
    if (ws.len != nr * 4 || (uintptr_t)ws.buf % 4 || out.len % 4 || (uintptr_t)out.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "want aligned float32 weights, one per run, and float32 out");
        goto done;
    }
    const int64_t *s = src.buf, *d = dst.buf, *n = lens.buf;
    if (runs_within(s, d, n, nr, out.len / 4) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    accumulate_runs(&c, start, s, d, n, ws.buf, nr, out.buf, add);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&scales); PyBuffer_Release(&codes); PyBuffer_Release(&src); PyBuffer_Release(&dst);
    PyBuffer_Release(&lens); PyBuffer_Release(&ws); PyBuffer_Release(&out);
    return result;
}

/* ---- the outer step: SGD with (delayed) Nesterov momentum, one pass ---- */

/* The outer optimiser's step over n values, the same bits as the XLA program
 * atoll.server.merge.reference_step runs (optax's Nesterov for delay 1, delayed Nesterov
 * after it): XLA contracts each multiply-add below into one fused operation and turns
 * g / delay into g * float32(1 / delay), so this spells out exactly those roundings.
 *   delay 1:  m' = fma(beta, m, g),            p' = fma(-lr, fma(beta, m', g), p)
 *   delay N:  m' = fma(g, 1/N, round(beta * m)) on a cycle's first round, fma(g, 1/N, m) after;
 *             p' = fma(-lr, fma(beta, m', g), p) on its last round, fma(-lr, g, p) before.
 * The outputs may be the inputs (p_out = p, m_out = m): each value is read before it is
 * written, at the same index. */
/* One value of the step (see outer_step); inlined into both loops below. */
INLINE void outer_value(float p, float g, float m, float *p_out, float *m_out, float lr, float beta,
                        long delay, float r, int first, int due) {
    float mi = delay == 1 ? __builtin_fmaf(beta, m, g) : __builtin_fmaf(g, r, first ? beta * m : m);
    *m_out = mi;
    *p_out = __builtin_fmaf(-lr, due ? __builtin_fmaf(beta, mi, g) : g, p);
}

HOT static void outer_step(const float *restrict p, const float *restrict g, const float *restrict m,
                           float *restrict p_out, float *restrict m_out, Py_ssize_t n, float lr,
                           float beta, long delay, int first, int due) {
    float r = 1.0f / (float)delay;
    for (Py_ssize_t i = 0; i < n; i++) outer_value(p[i], g[i], m[i], p_out + i, m_out + i, lr, beta, delay, r, first, due);
}

/* outer_step with p_out = p and m_out = m: each value is read before it is written. */
HOT static void outer_step_in_place(float *restrict p, const float *restrict g, float *restrict m,
                                    Py_ssize_t n, float lr, float beta, long delay, int first, int due) {
    float r = 1.0f / (float)delay;
    for (Py_ssize_t i = 0; i < n; i++) outer_value(p[i], g[i], m[i], p + i, m + i, lr, beta, delay, r, first, due);
}

PyDoc_STRVAR(outer_step_doc,
"outer_step(params, grad, momentum, params_out, momentum_out, lr, beta, delay, first, due)\n\n"
"One outer step over equal-length float32 vectors: params_out and momentum_out get the\n"
"new params and momentum (see the C source for the exact roundings). delay >= 1; first:\n"
"the first round of a momentum cycle; due: its last (both true for delay 1). The outputs\n"
"may be the inputs themselves (an update in place).");

INLINE int buffers_overlap(const Py_buffer *x, const Py_buffer *y) {
    const char *a = x->buf, *b = y->buf;
    return a < b + y->len && b < a + x->len;
}

static PyObject *py_outer_step(PyObject *self, PyObject *args) {
    Py_buffer b[5] = {{0}};
    float lr, beta;
    long delay;
    int first, due;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*fflpp", &b[0], &b[1], &b[2], &b[3], &b[4], &lr, &beta, &delay,
                          &first, &due)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t len = b[0].len;
    for (int k = 0; k < 5; k++)
        if (b[k].len != len || len % 4 || (uintptr_t)b[k].buf % 4) {
            PyErr_SetString(PyExc_ValueError, "outer_step: want five aligned float32 vectors of one length");
            goto done;
        }
    if (delay < 1) { PyErr_SetString(PyExc_ValueError, "outer_step: delay must be >= 1"); goto done; }
    /* in place: params_out is params and momentum_out is momentum; otherwise no output may
     * share a byte with another buffer (the loops assume no aliasing) */
    int in_place = b[3].buf == b[0].buf && b[4].buf == b[2].buf, n = in_place ? 3 : 5;
    for (int i = 0; i < n; i++)
        for (int k = i + 1; k < n; k++)
            if ((in_place || i >= 3 || k >= 3) && buffers_overlap(&b[i], &b[k])) {
                PyErr_SetString(PyExc_ValueError, "outer_step: buffers overlap other than in place");
                goto done;
            }
    Py_BEGIN_ALLOW_THREADS
    if (in_place) outer_step_in_place(b[3].buf, b[1].buf, b[4].buf, len / 4, lr, beta, delay, first, due);
    else outer_step(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, len / 4, lr, beta, delay, first, due);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (int k = 0; k < 5; k++) PyBuffer_Release(&b[k]);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"check", py_check, METH_VARARGS, check_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {"range_stats", py_range_stats, METH_VARARGS, range_stats_doc},
    {"accumulate", py_accumulate, METH_VARARGS, accumulate_doc},
    {"decode_runs", py_decode_runs, METH_VARARGS, decode_runs_doc},
    {"accumulate_runs", py_accumulate_runs, METH_VARARGS, accumulate_runs_doc},
    {"outer_step", py_outer_step, METH_VARARGS, outer_step_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "4-bit codec kernels.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    for (int k = 0; k < 255; k++) POW2[k] = ldexpf(1.0f, k - 127);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "INT4", FMT_INT4) < 0 || PyModule_AddIntConstant(m, "MXFP4", FMT_MXFP4) < 0 ||
        PyModule_AddIntConstant(m, "FP32", FMT_FP32) < 0 || PyModule_AddIntConstant(m, "BLOCK", BLOCK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
