"""Benchmarks (`atoll bench ...`), each printing one JSON object."""

from __future__ import annotations

import argparse

from atoll.commands import Command, add_commands, run

BENCHES = (
    Command("codec", "4-bit codec speed, wire size and error", "atoll.bench.codec"),
    Command(
        "quality",
        "the quality / bandwidth frontier at equal tokens: data-parallel, atoll, synchronous "
        "DiLoCo and mixed-speed learners for each sync period (about 20 minutes)",
        "atoll.bench.quality",
    ),
    Command(
        "cadence",
        "outer steps per fragment against steps / H and pull bits per sync, with the host "
        "loaded on purpose by CPU-burning processes (about 2 minutes per seed)",
        "atoll.bench.cadence",
    ),
    Command(
        "ingest",
        "one shard process's push ingest rate vs raw gRPC, fsync latency and memory per parameter",
        "atoll.bench.ingest",
    ),
    Command(
        "streams",
        "one shard process under a crowd of open Watch and stalled Push streams: health "
        "latency, pushes and memory before, during and after",
        "atoll.bench.streams",
    ),
    Command(
        "learners",
        "one shard process under 10 to 10,000 simulated learners, steady and coming and "
        "going: shard CPU per push, push latency, rounds per second, RSS per learner",
        "atoll.bench.learners",
    ),
    Command(
        "learner",
        "what atoll.Learner costs a training loop against a real shard: per-step overhead "
        "with no sync due and the pause at a sync point",
        "atoll.bench.learner",
    ),
    Command(
        "wan",
        "data-parallel training vs atoll across the same emulated regions (root): speed at "
        "equal loss, each link's bytes and rate, the rate data-parallel would need",
        "atoll.bench.wan",
    ),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_commands(p, BENCHES, "bench")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return run(args, BENCHES, "bench")
