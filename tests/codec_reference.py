"""Plain numpy (+ ml_dtypes) statements of the 4-bit formats, written from their
definitions, to check the C kernels against value by value."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32
INT4_MAX_SCALE = 0x7DFF  # largest bfloat16 s with 8 * s finite in float32


def _blocks(x: np.ndarray) -> np.ndarray:
    pad = (-x.size) % BLOCK
    return np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, BLOCK)


def int4_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (bfloat16 scales as uint16 bits, int8 codes per value) for flat float32 x."""
    xb = _blocks(x)
    amax = np.abs(xb).max(axis=1)
    s = (amax / np.float32(7)).astype(np.float32)
    bits = s.view(np.uint32)
    # bfloat16 rounded up (toward +inf): never lets |x| / s exceed 7
    up = np.where(bits & 0xFFFF, bits + 0x10000, bits) & 0xFFFF0000
    # capped where 8 * s would overflow: every code must decode to a finite value
    up = np.minimum(up, np.uint32(INT4_MAX_SCALE) << 16)
    s_bf = up.astype(np.uint32).view(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s_bf[:, None] > 0, np.rint(xb / s_bf[:, None]), 0)
    q = np.clip(q, -7, 7).astype(np.int8)
    return (up >> 16).astype(np.uint16), q.reshape(-1)


def int4_values(scales: np.ndarray, q: np.ndarray) -> np.ndarray:
    s = (scales.astype(np.uint32) << 16).view(np.float32)
    return (q.reshape(-1, BLOCK).astype(np.float32) * s[:, None]).reshape(-1)


def mxfp4_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (E8M0 scale codes, E2M1 values as float32) per OCP MX v1.0."""
    xb = _blocks(x)
    amax = np.abs(xb).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax.astype(np.float64))) - 2, -127)
    e = np.clip(e, -127, 127).astype(np.int32)
    scaled = xb.astype(np.float64) * np.exp2(-e.astype(np.float64))[:, None]
    clipped = np.clip(scaled, -6, 6).astype(np.float32)
    vals = clipped.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)  # round to nearest even
    return (e + 127).astype(np.uint8), vals.reshape(-1)


def mxfp4_values(scales: np.ndarray, vals: np.ndarray) -> np.ndarray:
    s = np.exp2(scales.astype(np.float64) - 127).astype(np.float32)
    return (vals.reshape(-1, BLOCK) * s[:, None]).reshape(-1)
