"""`atoll bench …`: measurements printed as one JSON object.

Rates are best-of-N wall times; each figure that has an anchor is quoted beside it
from the same run (memcpy of the same float32 bytes, timed in turns with it), because
this machine is shared and absolute numbers drift.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from atoll.commands import positive_int
from atoll.wire import codec

if TYPE_CHECKING:
    from atoll.server.merge import RoundAccumulator

# `atoll bench codec` targets (docs/design.md §6), INT4 frames on all cores, M params/s.
ENCODE_TARGET = 1000.0
DECODE_ACCUMULATE_TARGET = 1500.0


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(
    fn: Callable[[], object], anchor: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """(wall, cpu, anchor wall): best-of-N seconds of fn, its CPU seconds over all the
    process's threads, and the anchor's seconds, the two run in turns so that other work
    on the machine slows both alike."""
    wall = cpu = base = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        anchor()
        base = min(base, time.perf_counter() - start)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = (
            min(wall, time.perf_counter() - start),
            min(cpu, time.process_time() - start_cpu),
        )
    return wall, cpu, base


def outer_gradient_like(num_params: int, seed: int = 0) -> np.ndarray:
    """Gaussian values at a typical outer-gradient magnitude (float32, flat)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(num_params, dtype=np.float32) * np.float32(1e-3)


def transformer_like_sizes(num_params: int) -> list[int]:
    """Tensor sizes of a fragment like a transformer's: an embedding table, then blocks of
    matrices, norms and biases (some not a multiple of 32), cut to num_params."""
    d = 1024
    block = [3 * d * d, d * d, 4 * d * d + 8, 4 * d * d, d, d, 4 * d + 3, d + 17]
    sizes, left = [], num_params
    for size in [32_003 * 64] + block * (num_params // sum(block) + 1):
        take = min(size, left)
        if take:
            sizes.append(take)
        left -= take
    return sizes


def bench_codec(num_params: int = 64 << 20, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Frame rates of every 4-bit codec on one core and on all cores, with wire size and error.

    Paths, each as M params/s, as a ratio to memcpy of the same float32 bytes timed in
    turns with it, and as M params per CPU-second (all threads; what a core does when
    the machine is busy):
      encode: x -> frame (kernel + zstd, chunks on threads);
      encode_ef: the learner's path, with error feedback;
      decode_accumulate: frame -> out += w·values (zstd, checks, kernel);
      read_codes: frame -> checked codes, zstd and checks alone;
      norm_accumulate: the shard's merge straight from a frame
        (`RoundAccumulator.add_frame`: per-tensor norms, then acc += w/‖Δ_t‖·Δ_t) over
        a transformer-like tensor layout.
    """
    from atoll.server.merge import RoundAccumulator, Segments

    cores = codec.get_threads()
    x = outer_gradient_like(num_params, seed)
    scratch = np.empty_like(x)
    load_before = os.getloadavg()[0]

    def memcpy() -> None:
        np.copyto(scratch, x)

    memcpy_s = _best_seconds(memcpy, repeats)
    sizes = transformer_like_sizes(num_params)
    segments = Segments.from_sizes(sizes, embedding=[True] + [False] * (len(sizes) - 1))
    result: dict[str, Any] = {
        "params": num_params,
        "repeats": repeats,
        "cores": cores,
        "tensors": len(sizes),
        "memcpy_gbps": round(x.nbytes / memcpy_s / 1e9, 3),
        "memcpy_mparams_per_s": round(num_params / memcpy_s / 1e6, 1),
        "default_codec": codec.DEFAULT_CODEC.name.lower(),
        "codecs": {},
    }
    for c in (codec.Codec.INT4, codec.Codec.MXFP4):
        result["codecs"][c.name.lower()] = _codec_figures(
            c, x, scratch, RoundAccumulator(segments), memcpy, repeats, cores
        )
    int4 = result["codecs"]["int4"]["all_cores"]
    result["targets"] = {
        "int4_encode_mparams_per_s": ENCODE_TARGET,
        "int4_decode_accumulate_mparams_per_s": DECODE_ACCUMULATE_TARGET,
        "met": bool(
            int4["encode_mparams_per_s"] >= ENCODE_TARGET
            and int4["decode_accumulate_mparams_per_s"] >= DECODE_ACCUMULATE_TARGET
        ),
    }
    # Other work on a shared machine slows every figure of a run alike; the ratios to
    # memcpy of the same run hold better than the rates. The load says how busy it was.
    result["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def _codec_figures(
    c: codec.Codec,
    x: np.ndarray,
    scratch: np.ndarray,
    acc: RoundAccumulator,
    memcpy: Callable[[], None],
    repeats: int,
    cores: int,
) -> dict[str, Any]:
    """One codec's paths on one core and on `cores`, timed in turns with `memcpy` (which
    copies into `scratch`, the buffer decoding adds to), and its wire size and error on `x`;
    `acc`: a RoundAccumulator over x's tensor layout."""
    num_params = x.size
    frame = codec.encode(x, c)
    ef = codec.ErrorFeedback(num_params, c)
    paths = {
        "encode": lambda: codec.encode(x, c),
        "encode_ef": lambda: ef.encode(x),
        "decode_accumulate": lambda: codec.decode_into(frame, scratch, 0.5),
        "read_codes": lambda: codec.read_codes(frame),
        "norm_accumulate": lambda: acc.add_frame(frame, 1.0),
    }
    scratch[...] = 0.0
    figures: dict[str, Any] = {}
    for name, threads in (("per_core", 1), ("all_cores", cores)):
        old = codec.set_threads(threads)
        try:
            times = {path: _measure(fn, memcpy, repeats) for path, fn in paths.items()}
        finally:
            codec.set_threads(old)
        figures[name] = {"threads": threads}
        for path, (wall, cpu, base) in times.items():
            figures[name][f"{path}_mparams_per_s"] = round(num_params / wall / 1e6, 1)
            figures[name][f"{path}_vs_memcpy"] = round(base / wall, 3)
            figures[name][f"{path}_mparams_per_cpu_s"] = round(num_params / max(cpu, 1e-9) / 1e6, 1)
    decoded = codec.decode(frame)
    rel_error = float(
        np.linalg.norm((decoded - x).astype(np.float64)) / np.linalg.norm(x.astype(np.float64))
    )
    return {
        **figures,
        "bits_per_param": round(len(frame) * 8 / num_params, 4),
        "rel_error": round(rel_error, 5),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll bench codec`."""
    p.add_argument(
        "--params",
        type=positive_int,
        default=64 << 20,
        help="values per measurement (default 67108864)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs per figure; the best is kept (default 3)",
    )
    p.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    print(json.dumps(bench_codec(args.params, args.repeats, args.seed), indent=2))
    return 0
