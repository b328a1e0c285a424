"""`atoll bench …`: measurements printed as one JSON object.

Rates are best-of-N wall times on one thread; each figure that has an anchor is
quoted beside it from the same run (memcpy of the same float32 bytes), because this
machine is shared and absolute numbers drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from wire import codec


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def outer_gradient_like(num_params: int, seed: int = 0) -> np.ndarray:
    """Gaussian values at a typical outer-gradient magnitude (float32, flat)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(num_params, dtype=np.float32) * np.float32(1e-3))


def bench_codec(num_params: int = 64 << 20, repeats: int = 3, seed: int = 0) -> dict:
    """Encode and decode+accumulate rates, wire size and error of every 4-bit codec.

    encode_*: x -> frame (kernel + zstd); encode_ef_*: the learner's path with error
    feedback; decode_accumulate_*: frame -> out += w * values (zstd + kernel), the
    shard's hot path. *_kernel_* leave zstd out, to show where the time goes.
    """
    x = outer_gradient_like(num_params, seed)
    scratch = np.empty_like(x)
    memcpy_s = _best_seconds(lambda: np.copyto(scratch, x), repeats)
    memcpy_gbps = x.nbytes / memcpy_s / 1e9
    result: dict = {
        "params": num_params,
        "repeats": repeats,
        "memcpy_gbps": round(memcpy_gbps, 3),
        "default_codec": codec.DEFAULT_CODEC.name.lower(),
        "codecs": {},
    }
    from wire import _kernels

    for c in (codec.Codec.INT4, codec.Codec.MXFP4):
        fmt = codec._KERNEL_FORMAT[c]
        body = np.empty(codec.body_bytes(c, num_params), np.uint8)
        frame = codec.encode(x, c)
        encode_s = _best_seconds(lambda: codec.encode(x, c), repeats)
        ef = codec.ErrorFeedback(num_params, c)
        ef_s = _best_seconds(lambda: ef.encode(x), repeats)
        kernel_enc_s = _best_seconds(lambda: _kernels.encode(fmt, x, None, None, body), repeats)
        scratch[...] = 0.0
        decode_s = _best_seconds(lambda: codec.decode_into(frame, scratch, 0.5), repeats)
        kernel_dec_s = _best_seconds(lambda: _kernels.decode(fmt, body, scratch, 0.5, True), repeats)
        decoded = codec.decode(frame)
        rel_error = float(np.linalg.norm((decoded - x).astype(np.float64)) /
                          np.linalg.norm(x.astype(np.float64)))
        mp = num_params / 1e6
        result["codecs"][c.name.lower()] = {
            "encode_mparams_per_s": round(mp / encode_s, 1),
            "encode_ef_mparams_per_s": round(mp / ef_s, 1),
            "decode_accumulate_mparams_per_s": round(mp / decode_s, 1),
            "encode_kernel_mparams_per_s": round(mp / kernel_enc_s, 1),
            "decode_accumulate_kernel_mparams_per_s": round(mp / kernel_dec_s, 1),
            # float32 bytes read per second by encode, as a fraction of memcpy's rate
            "encode_vs_memcpy": round((x.nbytes / encode_s / 1e9) / memcpy_gbps, 3),
            "decode_accumulate_vs_memcpy": round((x.nbytes / decode_s / 1e9) / memcpy_gbps, 3),
            "bits_per_param": round(len(frame) * 8 / num_params, 4),
            "rel_error": round(rel_error, 5),
        }
    return result
