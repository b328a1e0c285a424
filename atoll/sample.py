"""`atoll sample`: text from a built-in preset model that `atoll export` or `atoll up` wrote.

    atoll sample --model runs/20261122-043926/model --prompt "def main(" --tokens 200

The built-in model is byte-level (learner/trainer/data.py reads text as its UTF-8 bytes): the
prompt's bytes are the first tokens, and each token drawn is one byte, printed as it
comes (bytes that are not valid UTF-8 print as U+FFFD). The model sees at most its
context's worth of the newest tokens.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from atoll.commands import non_negative_int, positive_int


def generate(
    params: dict[str, Any],
    cfg: Any,
    prompt_L: np.ndarray,
    num_tokens: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> Iterator[int]:
    """Draws `num_tokens` tokens after `prompt_L`, one at a time.

    Args:
      params: the built-in model's parameters (`atoll.learner.trainer.model.init_params`' tree).
      cfg: its ModelConfig.
      prompt_L: int token ids in [0, cfg.vocab), at least one.
      num_tokens: how many to draw.
      temperature: softmax temperature, > 0; 0 picks the likeliest token every time.
      seed: the draws' random seed (the same seed gives the same text).

    Yields:
      Each token id as it is drawn.

    Example:
      >>> bytes(generate(params, PRESETS["tiny"], np.frombuffer(b"def ", np.uint8), 8))
      b'self, n'
    """
    import jax

    C = cfg.context
    params = jax.device_put(params)
    next_logits = _next_logits(cfg)
    tokens = [int(t) for t in prompt_L]
    key = jax.random.key(seed)
    # one compiled shape: the newest C tokens at the window's start, zeros after them (the
    # attention is causal, so what follows position `last` cannot change its logits)
    window_1xC = np.zeros((1, C), np.int32)
    for _ in range(num_tokens):
        seen = tokens[-C:]
        window_1xC[0, : len(seen)] = seen
        window_1xC[0, len(seen) :] = 0
        logits_V = next_logits(params, window_1xC, len(seen) - 1)
        if temperature == 0:
            token = int(np.argmax(np.asarray(logits_V)))
        else:
            key, draw = jax.random.split(key)
            token = int(jax.random.categorical(draw, logits_V / temperature))
        tokens.append(token)
        yield token


@functools.cache
def _next_logits(cfg: Any) -> Callable[..., Any]:
    """The jitted logits of the token after position `last` of a (1, C) window."""
    import jax

    from atoll.learner.trainer.model import forward

    @jax.jit
    def next_logits(params: Any, window_1xC: Any, last: Any) -> Any:
        return forward(params, window_1xC, cfg)[0, last]

    return next_logits


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll sample`."""
    p.add_argument(
        "--model",
        type=pathlib.Path,
        required=True,
        metavar="DIR",
        help="an export of a built-in preset: `atoll export --out DIR`, or a run's model/",
    )
    p.add_argument("--prompt", required=True, help="the text to continue (its UTF-8 bytes)")
    p.add_argument(
        "--tokens", type=positive_int, default=200, help="bytes to draw (default %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature, >= 0; 0 takes the likeliest byte (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="random seed (default %(default)s)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll sample`: prints the prompt and its continuation; exit 2 for a model it cannot run."""
    from atoll import model_dir

    if not args.prompt:
        parser.error("--prompt is empty: give at least one character to continue")
    if not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    try:
        exported = model_dir.load(args.model)
    except model_dir.ModelDirError as e:
        parser.error(f"--model: {e}")
    cfg = exported.model_config()
    if cfg is None:
        parser.error(
            f"--model: {args.model} holds a model that is not a built-in preset (its tensors "
            "match none); atoll sample runs only those. Load params/ with Orbax in your own code"
        )
    if cfg.vocab != 256:
        parser.error(f"--model: its vocabulary has {cfg.vocab} tokens, not the 256 bytes text is")
    prompt = args.prompt.encode("utf-8", "surrogateescape")  # argv's bytes, as given
    out = sys.stdout
    out.write(prompt.decode("utf-8", "replace"))
    out.flush()
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in generate(
        exported.params,
        cfg,
        np.frombuffer(prompt, np.uint8),
        args.tokens,
        args.temperature,
        args.seed,
    ):
        out.write(text.decode(bytes([token])))
        out.flush()
    out.write(text.decode(b"", final=True) + "\n")
    return 0
