"""The learner's model: a byte-level decoder-only transformer in plain JAX.

Pre-RMSNorm blocks (causal multi-head attention with rotary position embeddings, then
a GELU MLP), a final norm and an untied output projection. Parameters are a nested
dict of float32 arrays whose "/"-joined names the fragment plan and the syncer's merge
rules read (`wire.plan`):

  embed/tokens              (V, D)  merged by plain average (the name says "embed")
  blocks/<i>/attn_norm/scale (D,)
  blocks/<i>/attn/{wq,wk,wv,wo} (D, D)
  blocks/<i>/mlp_norm/scale  (D,)
  blocks/<i>/mlp/w_in (D, F), w_out (F, D)
  final_norm/scale          (D,)
  head/w                    (D, V)  dense, merged by radial-directional averaging

Why RoPE rather than a learned positional table: it has no parameters, so the tree
and the fragment plan do not depend on the context length, and there is no question
of how to merge a position table whose rows beyond the shortest context are rarely
trained. Why an untied head: the embedding is a sparse, row-wise lookup (averaged),
the head a dense projection (RDA); keeping them apart lets each get its own merge rule
for V*D extra parameters, which is negligible at V = 256.

Layers are separate tensors (not stacked for `lax.scan`) so the plan can balance
fragments at tensor granularity; jit unrolls the Python loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]  # nested str-keyed dict with float32 array leaves
Array = jax.Array

_DTYPES = ("float32", "bfloat16")


class ModelConfigError(ValueError):
    """A model setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # token ids in [0, vocab); 256 = bytes
    d_model: int = 192  # residual width D, a multiple of n_heads
    n_layers: int = 4  # transformer blocks, >= 1
    n_heads: int = 4  # attention heads; head dim d_model / n_heads must be even (RoPE)
    d_ff: int = 768  # MLP hidden width F, >= 1 (usually 4 * d_model)
    context: int = 128  # tokens a sequence attends over, >= 1; a batch row is context + 1
    rope_base: float = 10000.0  # RoPE wavelength base, > 1
    init_std: float = 0.02  # std of the normal init of matrices, > 0
    compute_dtype: str = "float32"  # "float32" or "bfloat16" (accelerators); params stay fp32

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ModelConfigError(message)

        for field in ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "context"):
            value = getattr(self, field)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"model {field} must be an int >= 1, got {value!r}",
            )
        need(self.vocab >= 2, f"model vocab must be at least 2, got {self.vocab}")
        need(
            self.d_model % self.n_heads == 0,
            f"model d_model={self.d_model} is not a multiple of n_heads={self.n_heads}; "
            f"pick n_heads dividing d_model (e.g. {_divisor_near(self.d_model, self.n_heads)})",
        )
        need(
            (self.d_model // self.n_heads) % 2 == 0,
            f"head dim d_model/n_heads = {self.d_model // self.n_heads} must be even for "
            f"rotary embeddings; change d_model or n_heads",
        )
        need(self.rope_base > 1, f"model rope_base must be > 1, got {self.rope_base}")
        need(self.init_std > 0, f"model init_std must be > 0, got {self.init_std}")
        need(
            self.compute_dtype in _DTYPES,
            f"model compute_dtype must be one of {_DTYPES}, got {self.compute_dtype!r}",
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_params(self) -> int:
        """Parameter count, from the shapes alone."""
        D, F, V = self.d_model, self.d_ff, self.vocab
        per_layer = 4 * D * D + 2 * D * F + 2 * D
        return 2 * V * D + self.n_layers * per_layer + D


def _divisor_near(n: int, k: int) -> int:
    """The divisor of n closest to k (for error messages)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))


PRESETS: dict[str, ModelConfig] = {
    # unit tests: ~41 K params, a train step in milliseconds on one CPU core
    "tiny": ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=128, context=32),
    # `atoll up` default: ~1.9 M params, learns visibly in minutes on shared CPU cores
    "small": ModelConfig(d_model=192, n_layers=4, n_heads=4, d_ff=768, context=128),
    # ~25 M params: one accelerator, or patient CPUs
    "base": ModelConfig(d_model=512, n_layers=8, n_heads=8, d_ff=2048, context=512),
    # ~353 M params: accelerators (bfloat16 compute)
    "large": ModelConfig(
        d_model=1024, n_layers=28, n_heads=16, d_ff=4096, context=1024, compute_dtype="bfloat16"
    ),
}


def preset(name: str) -> ModelConfig:
    """The named preset; ModelConfigError listing the choices otherwise."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def init_params(cfg: ModelConfig, key: int | Array) -> Params:
    """Fresh float32 parameters.

    Matrices ~ N(0, init_std²); the residual-branch outputs (wo, w_out) are scaled by
    1/sqrt(2 n_layers) (GPT-2) so the residual stream's variance does not grow with
    depth; norm scales start at one. Drawn with numpy's PCG64 from the key's bits: on
    CPU that is milliseconds where `jax.random` would compile per shape (seconds),
    and the values are the same on every backend.

    Args:
      cfg: the model shape.
      key: an int seed, or a `jax.random.key` / `PRNGKey` (its bits seed numpy; an
        int s gives the same values as `jax.random.key(s)`).

    Returns:
      The nested parameter dict (see the module docstring for names and shapes),
      numpy float32 leaves; `jax.device_put` places them.

    Example:
      >>> params = init_params(PRESETS["tiny"], 0)
      >>> params["blocks"]["0"]["attn"]["wq"].shape
      (32, 32)
    """
    bits: Any = key
    if isinstance(key, (int, np.integer)):  # the bits jax.random.PRNGKey(key) would hold
        bits = [(int(key) >> 32) % 2**32, int(key) % 2**32]
    elif jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        bits = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(bits, np.uint64).reshape(-1).tolist())
    D, F, V = cfg.d_model, cfg.d_ff, cfg.vocab
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def normal(shape: tuple[int, int], scale: float) -> np.ndarray:
        return (scale * rng.standard_normal(shape, np.float32)).astype(np.float32)

    def ones() -> np.ndarray:
        return np.ones((D,), np.float32)

    params: Params = {"embed": {"tokens": normal((V, D), std)}, "blocks": {}}
    for i in range(cfg.n_layers):
        params["blocks"][str(i)] = {
            "attn_norm": {"scale": ones()},
            "attn": {
                "wq": normal((D, D), std),
                "wk": normal((D, D), std),
                "wv": normal((D, D), std),
                "wo": normal((D, D), out_std),
            },
            "mlp_norm": {"scale": ones()},
            "mlp": {"w_in": normal((D, F), std), "w_out": normal((F, D), out_std)},
        }
    params["final_norm"] = {"scale": ones()}
    params["head"] = {"w": normal((D, V), std)}
    return params


def _rms_norm(x_BxLxD: Array, scale_D: Array, eps: float = 1e-6) -> Array:
    """RMSNorm, computed in float32 whatever the activations' dtype."""
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale_D).astype(x_BxLxD.dtype)


def _rope(x_BxLxNxH: Array, base: float) -> Array:
    """Rotary position embedding: rotates (first half, second half) pairs by position."""
    L, H = x_BxLxNxH.shape[1], x_BxLxNxH.shape[3]
    inv_freq_K = base ** (-jnp.arange(0, H // 2, dtype=jnp.float32) / (H // 2))
    angle_LxK = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq_K[None, :]
    cos, sin = jnp.cos(angle_LxK)[None, :, None, :], jnp.sin(angle_LxK)[None, :, None, :]
    x = x_BxLxNxH.astype(jnp.float32)
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxH.dtype)


def _attention(p: Params, x_BxLxD: Array, cfg: ModelConfig) -> Array:
    """Causal multi-head self-attention."""
    B, L, _ = x_BxLxD.shape
    dt = x_BxLxD.dtype

    def heads(w: Array) -> Array:
        return (x_BxLxD @ w.astype(dt)).reshape(B, L, cfg.n_heads, cfg.head_dim)

    q_BxLxNxH = _rope(heads(p["wq"]), cfg.rope_base)
    k_BxLxNxH = _rope(heads(p["wk"]), cfg.rope_base)
    v_BxLxNxH = heads(p["wv"])
    out_BxLxNxH = jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, is_causal=True)
    wo_DxD: Array = p["wo"].astype(dt)
    return out_BxLxNxH.reshape(B, L, cfg.d_model) @ wo_DxD


def _mlp(p: Params, x_BxLxD: Array) -> Array:
    dt = x_BxLxD.dtype
    h_BxLxF = jax.nn.gelu(x_BxLxD @ p["w_in"].astype(dt))
    w_out_FxD: Array = p["w_out"].astype(dt)
    return h_BxLxF @ w_out_FxD


def forward(params: Params, tokens_BxL: Array, cfg: ModelConfig) -> Array:
    """Next-token logits (float32) for every position.

    Args:
      params: from `init_params(cfg, ...)`.
      tokens_BxL: int token ids in [0, vocab), L <= cfg.context.
      cfg: the model shape.

    Returns:
      logits_BxLxV, float32; position t sees tokens 0..t only.
    """
    dt = jnp.dtype(cfg.compute_dtype)
    x_BxLxD = params["embed"]["tokens"].astype(dt)[tokens_BxL]
    for i in range(cfg.n_layers):
        block = params["blocks"][str(i)]
        x_BxLxD = x_BxLxD + _attention(
            block["attn"], _rms_norm(x_BxLxD, block["attn_norm"]["scale"]), cfg
        )
        x_BxLxD = x_BxLxD + _mlp(block["mlp"], _rms_norm(x_BxLxD, block["mlp_norm"]["scale"]))
    x_BxLxD = _rms_norm(x_BxLxD, params["final_norm"]["scale"])
    head_DxV: Array = params["head"]["w"].astype(dt)
    return (x_BxLxD @ head_DxV).astype(jnp.float32)


def loss_fn(params: Params, tokens_BxL1: Array, cfg: ModelConfig) -> Array:
    """Mean next-token cross-entropy (nats) over a (B, L+1) batch of windows.

    Row b predicts tokens_BxL1[b, 1:] from tokens_BxL1[b, :-1].
    """
    inputs_BxL, targets_BxL = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    logits_BxLxV = forward(params, inputs_BxL, cfg)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    picked_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return jnp.mean(logz_BxL - picked_BxL)
