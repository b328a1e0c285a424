"""The `atoll` command: a table of subcommands, each owned by the module that runs it."""

from __future__ import annotations

import argparse
import sys

from atoll.commands import Command, add_commands, run

COMMANDS = (
    Command("syncer", "run one syncer shard", "atoll.server.main"),
    Command(
        "learner", "run one learner (an island training a replica)", "atoll.learner.trainer.main"
    ),
    Command(
        "up",
        "a whole run on this machine: shards and learners as processes, a live table, then a "
        "report with plots",
        "atoll.local.up",
    ),
    Command(
        "chaos",
        "a run with learners and shards killed on a schedule, the same run in lockstep, and "
        "the goodput each kept; prints JSON with --json",
        "atoll.faults.chaos",
    ),
    Command(
        "plan",
        "simulate goodput at datacenter scale: data-parallel, elastic data-parallel and atoll, "
        "beside the published figures",
        "atoll.plan",
    ),
    Command(
        "status",
        "shards and learners: pods, readiness, versions (--kubernetes, or --shards HOST:PORT,...)",
        "atoll.cluster.kube",
        add="add_status_arguments",
        main="status_main",
    ),
    Command(
        "reshard",
        "move fragments between live shards so N of them own about as many each "
        "(docs/resharding.md); rerun to finish a move a failure interrupted",
        "atoll.cluster.reshard",
    ),
    Command(
        "drain",
        "the syncer pod's preStop hook: if a scale-down takes this shard away, hand its "
        "fragments to the shards that stay (docs/resharding.md)",
        "atoll.cluster.drain",
        add="add_drain_arguments",
        main="drain_command",
    ),
    Command(
        "export",
        "write the global model, one version of every fragment read from the shards, as an "
        "Orbax checkpoint with its fragment plan; prints what it read as JSON",
        "atoll.export",
    ),
    Command(
        "sample",
        "print text from a built-in preset model written by `atoll export` or `atoll up`",
        "atoll.sample",
    ),
    Command("bench", "measure a component; prints JSON", "atoll.bench"),
)


def parser() -> argparse.ArgumentParser:
    """The `atoll` command's parser (each command's flags load when it parses or helps)."""
    p = argparse.ArgumentParser(
        prog="atoll", description="Decoupled DiLoCo training across islands of accelerators."
    )
    add_commands(p, COMMANDS, "command")
    return p


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv), COMMANDS, "command")


if __name__ == "__main__":
    sys.exit(main())
