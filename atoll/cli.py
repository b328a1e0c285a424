"""The `atoll` command: parses flags and hands over to one library function."""

from __future__ import annotations

import argparse
import json
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll",
        description="Decoupled DiLoCo training across islands of accelerators.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    syncer = commands.add_parser("syncer", help="run one syncer shard")
    from server.main import add_arguments

    add_arguments(syncer)

    learner = commands.add_parser("learner", help="run one learner (an island training a replica)")
    from learner.main import add_arguments as add_learner_arguments

    add_learner_arguments(learner)

    up = commands.add_parser("up", help="a whole run on this machine: shards and learners as processes, "
                             "a live table, then a report with plots")
    from atoll.up import add_arguments as add_up_arguments

    add_up_arguments(up)

    bench = commands.add_parser("bench", help="measure a component; prints JSON")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    codec = benches.add_parser("codec", help="4-bit codec speed, wire size and error")
    codec.add_argument("--params", type=_positive_int, default=64 << 20,
                       help="values per measurement (default 67108864)")
    codec.add_argument("--repeats", type=_positive_int, default=3,
                       help="timed runs per figure; the best is kept (default 3)")
    codec.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    codec.add_argument("--json", action="store_true",
                       help="print one JSON object (the only output format)")
    ingest = benches.add_parser("ingest", help="one shard process's push ingest rate vs raw gRPC, "
                                "fsync latency and memory per parameter")
    ingest.add_argument("--params", type=_positive_int, default=100_000_000,
                        help="model size; a transformer-shaped tensor list of at least this "
                             "many parameters (default 100000000)")
    ingest.add_argument("--learners", type=_positive_int, default=4,
                        help="simulated learner processes, also the quorum (default 4)")
    ingest.add_argument("--fragments", type=_positive_int, default=8, help="fragments (default 8)")
    ingest.add_argument("--rounds", type=_positive_int, default=4,
                        help="measured pushes per learner per fragment (default 4)")
    ingest.add_argument("--warmup-rounds", type=int, choices=range(0, 10), default=1, metavar="N",
                        help="unmeasured rounds first, 0-9 (default 1)")
    ingest.add_argument("--json", action="store_true",
                        help="print one JSON object (the only output format)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "syncer":
        import logging

        from server.config import ConfigError
        from server.main import config_from_args, run

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            cfg = config_from_args(args)
        except ConfigError as e:
            parser.error(str(e))
        return run(cfg)
    if args.command == "learner":
        from learner.main import main as learner_main

        return learner_main(args, parser)
    if args.command == "up":
        from atoll.up import main as up_main

        return up_main(args, parser)
    if args.command == "bench" and args.bench == "codec":
        from atoll.bench import bench_codec

        print(json.dumps(bench_codec(args.params, args.repeats, args.seed), indent=2))
        return 0
    if args.command == "bench" and args.bench == "ingest":
        from atoll.bench_ingest import bench_ingest

        try:
            result = bench_ingest(args.params, args.learners, args.fragments, args.rounds,
                                  args.warmup_rounds)
        except ValueError as e:
            parser.error(str(e))
        print(json.dumps(result, indent=2))
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
