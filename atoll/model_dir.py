"""An exported model's directory: the global parameters as an Orbax checkpoint, beside
the fragment plan and a record of what was read. `atoll export --out DIR` writes one, and
`atoll up` writes its run's final model into `<run dir>/model/`; `atoll sample` reads one,
and so can any JAX program:

    DIR/params/     the parameter pytree, a nested dict of float32 arrays named as the plan
                    names them (the built-in model: embed/tokens, blocks/<i>/attn/wq, ...),
                    an Orbax checkpoint: orbax.checkpoint.StandardCheckpointer().restore(path)
    DIR/plan.json   the fragment plan (`atoll.wire.plan.FragmentPlan.to_json`)
    DIR/export.json FORMAT, the plan's fingerprint, the parameter count, each fragment's
                    version, the shard it came from and whether its round was open; for a
                    built-in preset, its name and model config (both null otherwise)

Guarantees, in the order the code keeps them:
1. Never into a directory that holds anything: the target is new or empty, in a directory
   that exists (`replace=True`, for `atoll up`'s model/ on a resumed run, swaps out a
   previous export, never anything else).
2. Whole or absent: everything goes into a temporary sibling directory, export.json last,
   which is then renamed into place; a failure removes the temporary directory.
3. What loads is what was written: the parameters restore bit for bit and are checked
   against the plan's names and shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import secrets
import shutil
from typing import Any

import numpy as np

from atoll.wire.plan import FragmentPlan, named_leaves

FORMAT = "atoll.export.v1"  # bump when the directory's layout changes
PARAMS, PLAN, RECORD = "params", "plan.json", "export.json"


class ModelDirError(ValueError):
    """A directory that cannot take an export or holds none; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Exported:
    """A loaded export: the parameter pytree, its plan and export.json's record."""

    params: dict[str, Any]  # nested dict of float32 numpy arrays
    plan: FragmentPlan
    record: dict[str, Any]  # export.json

    @property
    def preset(self) -> str | None:
        """The built-in preset the model is, or None (a model of the user's own)."""
        return self.record.get("preset")

    def model_config(self) -> Any:
        """The built-in model's ModelConfig, as recorded; None when it is not a preset."""
        from atoll.learner.trainer.model import ModelConfig

        return ModelConfig(**self.record["model"]) if self.record.get("model") else None


def check_target(out: pathlib.Path) -> None:
    """Refuses (ModelDirError) a target that is a file, a directory with anything in it,
    or in a directory that does not exist."""
    out = pathlib.Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ModelDirError(f"{out} exists and is not a directory")
        if any(out.iterdir()):
            raise ModelDirError(f"{out} exists and is not empty: give a new or empty directory")
    elif not out.parent.is_dir():
        raise ModelDirError(f"no directory {out.parent} to make {out.name} in")


def recognise_preset(plan: FragmentPlan) -> str | None:
    """The built-in preset whose parameters `plan` fragments, by tensor names and shapes
    (None: none does). Only a preset with as many parameters is built to compare."""
    from atoll.learner.trainer.model import PRESETS, init_params

    for name, cfg in PRESETS.items():
        if cfg.num_params != plan.num_params:
            continue
        built = FragmentPlan.build(init_params(cfg, 0), plan.num_fragments)
        if built.fingerprint == plan.fingerprint:
            return name
    return None


def write(
    out: pathlib.Path,
    params: dict[str, Any],
    plan: FragmentPlan,
    read: dict[str, Any],
    preset: str | None = None,
    replace: bool = False,
) -> dict[str, Any]:
    """Writes an export of `params` (the tree `plan` fragments) into `out`, whole or not at all.

    Args:
      out: a new or empty directory in one that exists; with `replace`, a previous
        export there is swapped for this one.
      params: nested dict of float32 arrays (numpy or jax).
      plan: their fragment plan.
      read: what to record of the read (each fragment's version, ...), into export.json.
      preset: the built-in preset the model is (its ModelConfig is recorded), or None.

    Returns:
      export.json's content. ModelDirError for a target it must not write (guarantee 1).

    Example:
      >>> write(pathlib.Path("model"), model.params(), model.plan, {"fragments": []}, "tiny")
      {'format': 'atoll.export.v1', 'plan_fingerprint': '…', 'preset': 'tiny', ...}
    """
    from atoll.learner.trainer.model import preset as preset_config

    out = pathlib.Path(out)
    if not (replace and (out / RECORD).is_file()):
        check_target(out)
    record = {
        "format": FORMAT,
        "plan_fingerprint": plan.fingerprint,
        "num_params": plan.num_params,
        "preset": preset,
        "model": dataclasses.asdict(preset_config(preset)) if preset else None,
        **read,
    }
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _save_params(tmp / PARAMS, params)
        (tmp / PLAN).write_text(plan.to_json())
        _write_synced(tmp / RECORD, json.dumps(record, indent=1) + "\n")  # last: marks it whole
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _save_params(path: pathlib.Path, params: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(path.resolve(), params)
    finally:
        checkpointer.close()  # waits for the background write to finish


def _write_synced(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _move_into_place(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Renames the finished `tmp` to `out` (an empty directory there is replaced; a previous
    export only after the new one is in place), then syncs the parent directory."""
    old = None
    if out.exists() and any(out.iterdir()):  # a previous export (write() checked)
        old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
    os.rename(tmp, out)  # onto an empty directory too; a non-empty one refuses (ENOTEMPTY)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: pathlib.Path) -> Exported:
    """The export in `path`: ModelDirError when it holds none, or one that does not agree
    with its plan.

    Example:
      >>> model = load(pathlib.Path("runs/20261122-043926/model"))
      >>> model.preset, model.params["embed"]["tokens"].shape
      ('small', (256, 192))
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(path)
    if not path.is_dir():
        raise ModelDirError(f"{path}: no such directory")
    if not (path / RECORD).is_file():
        inside = path / "model"  # a run directory given for its model/
        raise ModelDirError(
            f"{path} holds no atoll export (no {RECORD}): "
            + (
                f"the run's model is in {inside}"
                if (inside / RECORD).is_file()
                else "give a directory `atoll export --out` wrote, or a run's model/"
            )
        )
    try:
        record = json.loads((path / RECORD).read_text())
        plan = FragmentPlan.from_json((path / PLAN).read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{path}: unreadable export: {e}") from e
    if record.get("format") != FORMAT or record.get("plan_fingerprint") != plan.fingerprint:
        raise ModelDirError(
            f"{path}: export format {record.get('format')!r} of plan "
            f"{record.get('plan_fingerprint')!r}; this atoll reads {FORMAT!r} with its {PLAN}"
        )
    checkpointer = ocp.StandardCheckpointer()
    try:
        params = checkpointer.restore((path / PARAMS).resolve())
    finally:
        checkpointer.close()
    leaves = named_leaves(params)
    want = {s.name: s.spec.shape for s in plan.slots}
    have = {n: tuple(np.shape(a)) for n, a in leaves.items()}
    if have != want or any(np.asarray(a).dtype != np.float32 for a in leaves.values()):
        raise ModelDirError(f"{path}: {PARAMS}/ does not hold the float32 tensors {PLAN} names")
    return Exported(params, plan, record)
