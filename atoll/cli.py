"""The `atoll` command: parses flags and hands over to one library function."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def _whole(text: str, least: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole(text, 1)


def _non_negative_int(text: str) -> int:
    return _whole(text, 0)


def _parser() -> argparse.ArgumentParser:
    from atoll.server.config import OUTER_LR, OUTER_MOMENTUM, OUTER_MOMENTUM_DELAY

    parser = argparse.ArgumentParser(
        prog="atoll", description="Decoupled DiLoCo training across islands of accelerators."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    syncer = commands.add_parser("syncer", help="run one syncer shard")
    from atoll.server.main import add_arguments

    add_arguments(syncer)

    learner = commands.add_parser("learner", help="run one learner (an island training a replica)")
    from atoll.learner.main import add_arguments as add_learner_arguments

    add_learner_arguments(learner)

    up = commands.add_parser(
        "up",
        help="a whole run on this machine: shards and learners as processes, "
        "a live table, then a report with plots",
    )
    from atoll.local.up import add_arguments as add_up_arguments

    add_up_arguments(up)

    chaos = commands.add_parser(
        "chaos",
        help="a run with learners and shards killed on a schedule, the same "
        "run in lockstep, and the goodput each kept; prints JSON with --json",
    )
    from atoll.cluster.kube import add_chaos_arguments as add_kube_chaos_arguments
    from atoll.cluster.kube import add_status_arguments
    from atoll.faults.chaos import add_arguments as add_chaos_arguments

    chaos.add_argument(
        "--kubernetes",
        action="store_true",
        help="delete random learner pods in a cluster (its controllers restart them) "
        "and report goodput from the shards' metrics, instead of running processes here",
    )
    add_chaos_arguments(chaos)
    add_kube_chaos_arguments(chaos)

    plan = commands.add_parser(
        "plan",
        help="simulate goodput at datacenter scale: data-parallel, elastic "
        "data-parallel and atoll, beside the published figures",
    )
    from atoll.goodput import add_arguments as add_plan_arguments

    add_plan_arguments(plan)

    status = commands.add_parser(
        "status",
        help="shards and learners: pods, readiness, versions "
        "(--kubernetes, or --shards HOST:PORT,...)",
    )
    status.add_argument(
        "--kubernetes",
        action="store_true",
        help="find shards and learners in a cluster (the default unless --shards is given)",
    )
    add_status_arguments(status)

    reshard = commands.add_parser(
        "reshard",
        help="move fragments between live shards so N of them own about as many each "
        "(docs/resharding.md); rerun to finish a move a failure interrupted",
    )
    reshard.add_argument(
        "--shards",
        required=True,
        help="every shard's HOST:PORT, in index order (those it moves fragments to included), "
        "or a pattern such as 'atoll-syncer-{i}.atoll-syncer:50051': shards 0 to N-1, and "
        "past them those that answer",
    )
    reshard.add_argument(
        "--to", type=_positive_int, required=True, help="N: the shards that own fragments after"
    )
    reshard.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="a bearer token bound to no learner (with the shards' --token-file on)",
    )

    drain = commands.add_parser(
        "drain",
        help="the syncer pod's preStop hook: if a scale-down takes this shard away, hand "
        "its fragments to the shards that stay (docs/resharding.md)",
    )
    drain.add_argument(
        "--shards",
        default=None,
        help="the shards' address pattern, 'HOST-{i}:PORT' "
        "(env ATOLL_DRAIN_SHARDS; default atoll-syncer-{i}.atoll-syncer:50051)",
    )
    drain.add_argument(
        "--shard-index",
        type=_non_negative_int,
        default=None,
        help="this shard (default: ATOLL_SHARD_INDEX, or the ordinal ending ATOLL_POD_NAME)",
    )
    drain.add_argument(
        "--replicas",
        type=_non_negative_int,
        default=None,
        help="the shards that stay (default: the StatefulSet's spec.replicas, read from the "
        "Kubernetes API)",
    )
    drain.add_argument("--statefulset", default="atoll-syncer", help="the shards' StatefulSet")
    drain.add_argument(
        "--namespace",
        default=None,
        help="its namespace (env ATOLL_NAMESPACE; default: the pod's own)",
    )
    drain.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="the shards' token file; its first token bound to no learner is used "
        "(env ATOLL_TOKEN_FILE)",
    )
    drain.add_argument(
        "--tls-ca", type=pathlib.Path, default=None, help="PEM CA of the shards' certificates"
    )
    drain.add_argument(
        "--timeout",
        type=float,
        default=480.0,
        help="seconds a leaving shard waits for its fragments to move (keep under the pod's "
        "terminationGracePeriodSeconds)",
    )

    bench = commands.add_parser("bench", help="measure a component; prints JSON")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    codec = benches.add_parser("codec", help="4-bit codec speed, wire size and error")
    codec.add_argument(
        "--params",
        type=_positive_int,
        default=64 << 20,
        help="values per measurement (default 67108864)",
    )
    codec.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed runs per figure; the best is kept (default 3)",
    )
    codec.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    codec.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )
    quality = benches.add_parser(
        "quality",
        help="eval loss vs a data-parallel baseline at equal tokens, "
        "4-bit and fp32, and the bandwidth saved (several minutes)",
    )
    quality.add_argument("--preset", default="tiny", help="model preset (default %(default)s)")
    quality.add_argument(
        "--steps",
        type=_positive_int,
        default=4000,
        help="inner steps per learner (default %(default)s)",
    )
    quality.add_argument(
        "--learners", type=_positive_int, default=4, help="M (default %(default)s)"
    )
    quality.add_argument(
        "--batch-size",
        type=_positive_int,
        default=16,
        help="sequences per learner step (default %(default)s)",
    )
    quality.add_argument("--period", type=_positive_int, default=64, help="H (default %(default)s)")
    quality.add_argument("--overlap", type=int, default=1, help="τ (default %(default)s)")
    quality.add_argument(
        "--fragments", type=_positive_int, default=4, help="P (default %(default)s)"
    )
    quality.add_argument("--quorum", type=_positive_int, default=2, help="K (default %(default)s)")
    quality.add_argument(
        "--outer-lr", type=float, default=OUTER_LR, help="shards' outer lr (default %(default)s)"
    )
    quality.add_argument(
        "--outer-momentum",
        type=float,
        default=OUTER_MOMENTUM,
        help="shards' outer Nesterov momentum (default %(default)s)",
    )
    quality.add_argument(
        "--momentum-delay",
        type=_positive_int,
        default=OUTER_MOMENTUM_DELAY,
        help="rounds per outer momentum update (delayed Nesterov) (default %(default)s)",
    )
    quality.add_argument(
        "--seed", type=int, default=0, help="init and data-order seed (default %(default)s)"
    )
    quality.add_argument(
        "--work-dir",
        type=pathlib.Path,
        default=None,
        help="where the runs go (default: a temp dir)",
    )
    quality.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )
    ingest = benches.add_parser(
        "ingest",
        help="one shard process's push ingest rate vs raw gRPC, "
        "fsync latency and memory per parameter",
    )
    ingest.add_argument(
        "--params",
        type=_positive_int,
        default=100_000_000,
        help="model size; a transformer-shaped tensor list of at least this "
        "many parameters (default 100000000)",
    )
    ingest.add_argument(
        "--learners",
        type=_positive_int,
        default=4,
        help="simulated learner processes, also the quorum (default 4)",
    )
    ingest.add_argument("--fragments", type=_positive_int, default=8, help="fragments (default 8)")
    ingest.add_argument(
        "--rounds",
        type=_positive_int,
        default=4,
        help="measured pushes per learner per fragment (default 4)",
    )
    ingest.add_argument(
        "--warmup-rounds",
        type=int,
        choices=range(0, 10),
        default=1,
        metavar="N",
        help="unmeasured rounds first, 0-9 (default 1)",
    )
    ingest.add_argument(
        "--connections",
        type=_positive_int,
        default=None,
        help="push connections, spread evenly over the learner processes; at least "
        "--learners (default: one per learner)",
    )
    ingest.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )
    streams = benches.add_parser(
        "streams",
        help="one shard process under a crowd of open Watch and stalled "
        "Push streams: health latency, pushes and memory before, during and after",
    )
    streams.add_argument(
        "--watches", type=int, default=2000, help="open Watch streams (default %(default)s)"
    )
    streams.add_argument(
        "--stalled",
        type=int,
        default=200,
        help="Push streams that send their header, then nothing (default %(default)s)",
    )
    streams.add_argument(
        "--seconds", type=float, default=20.0, help="length of each phase (default %(default)s)"
    )
    streams.add_argument(
        "--push-interval",
        type=float,
        default=1.0,
        help="seconds between real pushes; each closes a round and notifies every "
        "watcher (default %(default)s)",
    )
    streams.add_argument(
        "--crowd-processes",
        type=_positive_int,
        default=4,
        help="client processes holding the Watch streams (default %(default)s)",
    )
    streams.add_argument(
        "--json", action="store_true", help="print one JSON object (the only output format)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "syncer":
        import logging

        from atoll.server.config import ConfigError, load_tokens
        from atoll.server.main import config_from_args, run

        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        try:
            cfg = config_from_args(args)
            if cfg.token_file is not None:
                load_tokens(cfg.token_file)  # a bad token file is a flag error, before any replay
        except ConfigError as e:
            parser.error(str(e))
        return run(cfg)
    if args.command == "learner":
        from atoll.learner.main import main as learner_main

        return learner_main(args, parser)
    if args.command == "up":
        from atoll.local.up import main as up_main

        return up_main(args, parser)
    if args.command == "chaos" and args.kubernetes:
        from atoll.cluster.kube import chaos_main as kube_chaos_main

        return kube_chaos_main(args, parser)
    if args.command == "chaos":
        from atoll.faults.chaos import main as chaos_main

        return chaos_main(args, parser)
    if args.command == "plan":
        from atoll.goodput import main as plan_main

        return plan_main(args, parser)
    if args.command == "status":
        from atoll.cluster.kube import status_main

        if args.kubernetes and args.shards:
            parser.error("give --kubernetes or --shards, not both")
        return status_main(args, parser)
    if args.command == "reshard":
        from atoll.cluster.reshard import main as reshard_main

        addresses = [a.strip() for a in args.shards.split(",") if a.strip()]
        if not addresses or any(":" not in a for a in addresses):
            parser.error(f"--shards takes HOST:PORT,... or a pattern, got {args.shards!r}")
        if "{i}" in args.shards and len(addresses) != 1:
            parser.error(f"--shards: a pattern is one address with {{i}}, got {args.shards!r}")
        from atoll.cluster.reshard import DrainError, operator_token
        from atoll.server.config import ConfigError

        try:
            token = operator_token(args.token_file) if args.token_file else None
        except (OSError, ConfigError, DrainError) as e:
            parser.error(f"--token-file: {e}")
        return reshard_main(args.shards, args.to, token)
    if args.command == "drain":
        from atoll.cluster.reshard import drain_defaults, drain_main
        from atoll.server.config import ConfigError, shard_index_from_env

        env = drain_defaults()
        spec = args.shards or env["shards"]
        if "{i}" not in spec or "," in spec or ":" not in spec:
            parser.error(f"--shards takes a pattern such as 'HOST-{{i}}:PORT', got {spec!r}")
        try:
            index = args.shard_index if args.shard_index is not None else shard_index_from_env()
        except ConfigError as e:
            parser.error(str(e))
        if index is None:
            parser.error("give --shard-index (or set ATOLL_SHARD_INDEX or ATOLL_POD_NAME)")
        token_file = args.token_file or (
            pathlib.Path(env["token_file"]) if env["token_file"] else None
        )
        if not args.timeout > 0:
            parser.error("--timeout must be above 0")
        return drain_main(
            spec,
            index,
            args.replicas,
            args.statefulset,
            args.namespace or env["namespace"],
            token_file,
            args.tls_ca,
            args.timeout,
        )
    if args.command == "bench" and args.bench == "codec":
        from atoll.bench.codec import bench_codec

        print(json.dumps(bench_codec(args.params, args.repeats, args.seed), indent=2))
        return 0
    if args.command == "bench" and args.bench == "quality":
        from atoll.bench.quality import bench_quality
        from atoll.local.config import UpConfig, UpConfigError

        try:
            cfg = UpConfig(
                learners=args.learners,
                preset=args.preset,
                steps=args.steps,
                slowdown=(1.0,) * args.learners,
                batch_size=args.batch_size,
                period=args.period,
                overlap=args.overlap,
                fragments=args.fragments,
                quorum=args.quorum,
                outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum,
                momentum_delay=args.momentum_delay,
                evals=4,
                seed=args.seed,
            )
        except UpConfigError as e:
            parser.error(str(e))
        print(json.dumps(bench_quality(cfg, args.work_dir), indent=2))
        return 0
    if args.command == "bench" and args.bench == "ingest":
        from atoll.bench.ingest import bench_ingest

        try:
            result = bench_ingest(
                args.params,
                args.learners,
                args.fragments,
                args.rounds,
                args.warmup_rounds,
                args.connections,
            )
        except ValueError as e:
            parser.error(str(e))
        print(json.dumps(result, indent=2))
        return 0
    if args.command == "bench" and args.bench == "streams":
        from atoll.bench.streams import bench_streams

        try:
            result = bench_streams(
                args.watches, args.stalled, args.seconds, args.push_interval, args.crowd_processes
            )
        except ValueError as e:
            parser.error(str(e))
        print(json.dumps(result, indent=2))
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
