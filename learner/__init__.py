"""The learner: `Learner`, the public API for your own training loop (learner/api.py),
and the library under it (sync, checkpoints, routing); atoll.learner.trainer
(learner/trainer/) is `atoll learner`, the built-in model and data: one user of the library.

Names are imported on first use, so `import atoll` and the command line stay quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atoll.learner.api import Learner, LearnerStateError
    from atoll.learner.checkpoint import CheckpointError
    from atoll.learner.config import Checkpointing, LearnerConfigError
    from atoll.learner.defaults import SyncConfig
    from atoll.learner.pytree import ParamsError
    from atoll.learner.stopping import Stopped
    from atoll.learner.sync import PlanMismatch, SyncError
    from atoll.wire.client import TlsFiles
    from atoll.wire.codec import Codec

# public name -> the module that defines it
_HOMES = {
    "Learner": "atoll.learner.api",
    "LearnerStateError": "atoll.learner.api",
    "SyncConfig": "atoll.learner.defaults",
    "Checkpointing": "atoll.learner.config",
    "CheckpointError": "atoll.learner.checkpoint",
    "LearnerConfigError": "atoll.learner.config",
    "ParamsError": "atoll.learner.pytree",
    "PlanMismatch": "atoll.learner.sync",
    "SyncError": "atoll.learner.sync",
    "Stopped": "atoll.learner.stopping",
    "TlsFiles": "atoll.wire.client",
    "Codec": "atoll.wire.codec",
    "load_export": "atoll.export",  # (not imported above: mypy checks atoll.learner alone)
}
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
assert set(__all__) == set(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
