"""atoll: Decoupled DiLoCo across islands of accelerators.

Use it from your own JAX training loop with `atoll.Learner` (see its docstring and the
README's "Use atoll in your own training loop"); run shards with `atoll syncer`.
Names are imported on first use, so the command line stays quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atoll.export import load_export
    from atoll.learner import (
        CheckpointError,
        Checkpointing,
        Codec,
        Learner,
        LearnerConfigError,
        LearnerStateError,
        ParamsError,
        PlanMismatch,
        Stopped,
        SyncConfig,
        SyncError,
        TlsFiles,
    )

__all__ = [
    "Learner",
    "LearnerStateError",
    "SyncConfig",
    "Checkpointing",
    "CheckpointError",
    "LearnerConfigError",
    "ParamsError",
    "PlanMismatch",
    "SyncError",
    "Stopped",
    "TlsFiles",
    "Codec",
    "load_export",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import atoll.learner

    return getattr(atoll.learner, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
