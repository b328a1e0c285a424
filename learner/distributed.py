"""A learner that spans every host of its slice: one JAX process per host, one island.

Every process runs the same training loop on its part of the global batch (XLA
all-reduces the gradients over the slice, learner/trainer/train.py); exactly one process,
process 0, talks to the syncer. After each step process 0 broadcasts what it decided
(stop or go on, which fragments it adopted, and their values) over JAX collectives,
so every process holds the same parameters and the outer gradient is computed once,
on process 0, from the replicated parameters.

That is the path of params replicated on every process. A learner whose params are
split over its processes (FSDP, tensor parallel) instead has every process push and
adopt its own shards, with process 0 deciding only the schedule (learner/sharded.py).

How a process learns its place, first that applies:
  * flags --coordinator HOST:PORT --num-processes N --process-id I, each defaulting to
    the JobSet's environment: ATOLL_COORDINATOR (e.g. the pod of job index 0 and a
    port), ATOLL_NUM_PROCESSES, ATOLL_PROCESS_ID (DistributedConfig's fields);
  * with none of them, a multi-host TPU slice (TPU_WORKER_HOSTNAMES lists more than one host):
    `jax.distributed.initialize()` with no arguments, which reads the TPU metadata.
Otherwise the learner is one process and nothing here runs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from atoll.wire.settings import setting

ENV_COORDINATOR = "ATOLL_COORDINATOR"  # HOST:PORT of process 0's coordination service
ENV_NUM_PROCESSES = "ATOLL_NUM_PROCESSES"  # processes (hosts) in this learner, >= 1
ENV_PROCESS_ID = "ATOLL_PROCESS_ID"  # this process, in [0, num_processes)
ENV_TPU_HOSTS = "TPU_WORKER_HOSTNAMES"  # set by GKE on every host of a TPU slice


class DistributedConfigError(ValueError):
    """A multi-process setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where this process stands among its learner's processes: `atoll learner`'s
    multi-host flags (wire/settings.py), each defaulting to its ATOLL_* variable."""

    # HOST:PORT of process 0; None: from the TPU metadata
    coordinator: str | None = setting(
        None,
        "HOST:PORT of process 0 of a multi-host learner (a multi-host TPU slice needs none)",
        env=ENV_COORDINATOR,
    )
    # processes in the learner, >= 1; None: from the TPU metadata
    num_processes: int | None = setting(
        None, "processes (hosts) of a multi-host learner", env=ENV_NUM_PROCESSES
    )
    # this process, in [0, num_processes); None: from the TPU metadata
    process_id: int | None = setting(
        None,
        "this process of a multi-host learner, 0 talks to the syncer",
        env=ENV_PROCESS_ID,
    )

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.coordinator, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise DistributedConfigError(
                "--coordinator, --num-processes and --process-id go together (or set "
                f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID})"
            )
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not (port.isdigit() and 1 <= int(port) <= 65535):
                raise DistributedConfigError(
                    f"--coordinator {self.coordinator!r} must be HOST:PORT with a port in 1-65535"
                )
            assert self.num_processes is not None and self.process_id is not None  # all given
            if self.num_processes < 1:
                raise DistributedConfigError(
                    f"--num-processes must be >= 1, got {self.num_processes}"
                )
            if not 0 <= self.process_id < self.num_processes:
                raise DistributedConfigError(
                    f"--process-id must be in [0, {self.num_processes}), got {self.process_id}"
                )


def processes(
    given: DistributedConfig, env: Mapping[str, str] | None = None
) -> DistributedConfig | None:
    """The learner's processes, from what its flags (or ATOLL_* variables) `given` say:
    None for one process; with nothing given, a multi-host TPU slice (`env`'s
    TPU_WORKER_HOSTNAMES, default os.environ) is DistributedConfig(), which jax fills in
    from the TPU metadata, and anything else one process."""
    if given != DistributedConfig():
        return given if (given.num_processes or 0) > 1 else None
    hosts = (os.environ if env is None else env).get(ENV_TPU_HOSTS, "")
    return DistributedConfig() if len([h for h in hosts.split(",") if h.strip()]) > 1 else None


def initialize(cfg: DistributedConfig | None) -> None:
    """Joins this process to its learner's other processes (a no-op for one process).

    Call before anything touches a JAX backend.
    """
    if cfg is None:
        return
    import jax

    # CPU processes reduce over gloo; accelerators use their own interconnect.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    if cfg.coordinator is None:
        jax.distributed.initialize()  # a TPU slice: the metadata says who is who
    else:
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )


def process_index() -> int:
    import jax

    return int(jax.process_index())


def process_count() -> int:
    import jax

    return int(jax.process_count())


def is_leader() -> bool:
    """Whether this process is the one that talks to the syncer (process 0)."""
    return process_index() == 0


def broadcast(tree: Any) -> Any:
    """Process 0's `tree` (numpy or jax leaves) on every process, as numpy arrays.

    Every process passes a tree of the same structure, shapes and dtypes; only process
    0's values count. With one process it is returned as numpy, unchanged.
    """
    import jax

    tree = jax.tree.map(
        np.asarray, tree
    )  # host values: broadcast_one_to_all wants process-local data
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def agree_status(status: int) -> int:
    """Process 0's exit status on every process: a process stopped only because process
    0 was leaves as process 0 does (143 for its SIGTERM), not with an error's 1. With one
    process, `status`."""
    return int(broadcast(np.asarray([status], np.int32))[0])


def broadcast_step(
    updates: dict[int, np.ndarray] | None, flags: Sequence[bool], fragment_sizes: Sequence[int]
) -> tuple[dict[int, np.ndarray], list[bool]]:
    """Process 0's adopted fragments and decisions after a step, on every process.

    Args:
      updates: {fragment: float32 vector} process 0 adopted (ignored elsewhere).
      flags: process 0's decisions, e.g. (stop, evaluate); every process passes as many.
      fragment_sizes: every fragment's length (the plan's), the same on every process.
    Returns:
      (updates, flags) as process 0 had them.
    """
    head = np.zeros(len(flags) + len(fragment_sizes), np.int32)
    if is_leader():
        head[: len(flags)] = [int(bool(f)) for f in flags]
        for p in updates or {}:
            head[len(flags) + p] = 1
    head = broadcast(head)
    decided = [bool(f) for f in head[: len(flags)]]
    adopted = [p for p in range(len(fragment_sizes)) if head[len(flags) + p]]
    if not adopted:
        return {}, decided
    mine = updates or {}
    vectors = [
        np.asarray(mine[p], np.float32) if is_leader() else np.zeros(fragment_sizes[p], np.float32)
        for p in adopted
    ]
    return dict(zip(adopted, broadcast(vectors))), decided
