"""`atoll export`: one consistent version of the global model, read from the shards and
written as an Orbax checkpoint (docs/design.md §4, "The model comes out").

The shards hold the global parameters as P fragments, each at its own version. A read
finds each fragment's owner through the shards' fragment map, may wait a while for
rounds still open to close, then pulls every fragment once, as one FP32 snapshot: the
bits the shard publishes at the version it names. `atoll up` reads its final model the
same way. The directory it writes is described in `atoll.model_dir`.

    atoll export --shards 127.0.0.1:7070,127.0.0.1:7071 --out model/
    atoll export --shards 'atoll-syncer-{i}.atoll-syncer:7070' --out model/ --wait 30

Exit status: 0 written; 1 a shard did not answer (rerun when it is up); 2 an error in
what was asked (the flags, an --out that is taken, a fragment no given shard owns).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from atoll.commands import add_tls_arguments, address_list, tls_from_args
from atoll.wire.client import ShardClient, described_map
from atoll.wire.plan import FragmentMap, FragmentPlan, Slot, TensorSpec

DEADLINE_SECONDS = 30.0  # default deadline of each Describe and Pull (a busy shard answers)
POLL_SECONDS = 0.2  # between two Describes of the shards while rounds are open


class UnansweredError(ConnectionError):
    """A shard did not answer a Describe or Pull (down, unreachable, or past the deadline)."""


@dataclasses.dataclass(frozen=True)
class GlobalModel:
    """The global parameters as read: one FP32 vector per fragment, at `versions`."""

    plan: FragmentPlan
    vectors: list[np.ndarray]  # vectors[p]: fragment p, float32, plan.fragment_sizes[p] values
    versions: dict[int, int]  # {fragment: the published version its vector is}
    open_rounds: dict[int, int]  # {fragment: pushes in its open round, not in the vector}
    fragment_map: FragmentMap  # where each fragment was read
    waited_seconds: float  # how long the read waited for open rounds

    def params(self) -> dict[str, Any]:
        """The parameter pytree: a nested dict of float32 arrays, named as the plan names them."""
        return self.plan.unflatten(self.vectors)

    def fragments(self) -> list[dict[str, Any]]:
        """One record per fragment: its version, the shard it came from, whether its round
        was open (and how many pushes wait in it)."""
        return [
            {
                "fragment": p,
                "version": self.versions[p],
                "shard": self.fragment_map.owner(p),
                "round_open": p in self.open_rounds,
                "pushes_not_in_model": self.open_rounds.get(p, 0),
            }
            for p in range(self.plan.num_fragments)
        ]

    def record(self) -> dict[str, Any]:
        """What an export records of the read: the map's version, the wait, the fragments."""
        return {
            "map_version": self.fragment_map.version,
            "waited_seconds": self.waited_seconds,
            "fragments": self.fragments(),
        }


def global_map(describes: list[Any], num_fragments: int) -> FragmentMap:
    """Which shard holds each fragment: the shards' maps merged (the newest statement about
    each fragment wins), or p mod S while no shard has one. `describes`: each shard's
    DescribeResponse, in index order.

    Raises RuntimeError when the map names a shard that is not among them."""
    maps = [m for m in map(described_map, describes) if m and m.num_fragments == num_fragments]
    fmap = (
        FragmentMap.merge_all(maps) if maps else FragmentMap.modulo(num_fragments, len(describes))
    )
    away = {p: o for p, o in enumerate(fmap.owners) if o >= len(describes)}
    if away:
        raise RuntimeError(
            f"the fragment map (version {fmap.version}) puts fragments on shards beyond the "
            f"{len(describes)} given: "
            + ", ".join(f"{p} on shard {o}" for p, o in sorted(away.items()))
            + " (give every shard's address, in index order)"
        )
    return fmap


def open_rounds(describes: list[Any], fmap: FragmentMap) -> dict[int, int]:
    """{fragment: pushes in its open round} for the rounds open on each fragment's owner."""
    out = {}
    for p, owner in enumerate(fmap.owners):
        for info in describes[owner].fragments:
            if info.fragment == p and info.round_size:
                out[p] = info.round_size
    return out


def _num_fragments(describes: list[Any]) -> int:
    """P, from the shards that hold a plan; RuntimeError when none does or they disagree."""
    plans = {(d.plan_fingerprint, d.num_fragments) for d in describes if d.plan_fingerprint}
    if not plans:
        raise RuntimeError(
            "no shard holds a fragment plan yet: no learner has joined, so there is no model"
        )
    if len(plans) > 1:
        raise RuntimeError(
            "the shards serve different fragment plans ("
            + ", ".join(sorted(f for f, _ in plans))
            + "): are they shards of one run?"
        )
    num_fragments: int = next(iter(plans))[1]
    return num_fragments


def _checked_plan(
    plan: FragmentPlan | None, describes: list[Any], infos: dict[int, Any]
) -> FragmentPlan:
    """The plan the shards serve (built from the owners' tensor lists when `plan` is None),
    checked against every shard's fingerprint."""
    if plan is None:
        slots = []
        for p, info in sorted(infos.items()):
            offset = 0
            for t in info.tensors:  # layout order: the shard lists them as the plan lays them
                spec = TensorSpec(t.name, tuple(t.shape), t.embedding)
                slots.append(Slot(spec, p, offset))
                offset += spec.size
        plan = FragmentPlan(len(infos), tuple(slots))
    for i, d in enumerate(describes):
        if d.plan_fingerprint and d.plan_fingerprint != plan.fingerprint:
            raise RuntimeError(
                f"shard {i} serves fragment plan {d.plan_fingerprint}, not {plan.fingerprint}"
            )
    return plan


def read_global(
    clients: Sequence[ShardClient],
    wait_seconds: float = 0.0,
    stop: threading.Event | None = None,
    plan: FragmentPlan | None = None,
) -> GlobalModel:
    """Reads every fragment of the global model once, from the shard the map names.

    Args:
      clients: one per shard, in shard index order (anonymous readers: learner id "").
      wait_seconds: how long to wait for rounds still open to close before reading them
        as they are (their pushes then are not in the model, and the result says so).
      stop: ends the wait at once when set (a Ctrl-C).
      plan: the plan the caller expects (checked against the shards'); None: the plan the
        shards describe.

    Returns:
      The GlobalModel: each fragment's FP32 snapshot at the version the shard published.
      RuntimeError when the shards hold no model, disagree on the plan, or a fragment's
      owner is not among `clients`; UnansweredError when a shard does not answer.

    Example:
      >>> model = read_global([ShardClient("127.0.0.1:7070", "")])
      >>> model.versions, model.open_rounds
      ({0: 12, 1: 12, 2: 11, 3: 12}, {2: 1})
    """
    from atoll.wire import codec

    stop = stop or threading.Event()
    started = time.monotonic()
    while True:
        describes = [_asked(c, c.describe) for c in clients]
        num_fragments = plan.num_fragments if plan else _num_fragments(describes)
        fmap = global_map(describes, num_fragments)
        still_open = open_rounds(describes, fmap)
        left = wait_seconds - (time.monotonic() - started)
        if not still_open or left <= 0 or stop.is_set():
            break
        stop.wait(min(POLL_SECONDS, left))
    waited = time.monotonic() - started
    infos = {}
    for p, owner in enumerate(fmap.owners):
        info = next((f for f in describes[owner].fragments if f.fragment == p), None)
        if info is None or not info.initialized:
            raise RuntimeError(
                f"fragment {p}: its owner, shard {owner} ({clients[owner].address}), "
                "holds no value for it yet"
            )
        infos[p] = info
    plan = _checked_plan(plan, describes, infos)
    vectors, versions = [], {}
    for p in range(num_fragments):
        client = clients[fmap.owner(p)]
        pulled = _asked(client, lambda: client.pull(p))
        if not pulled.snapshot or len(pulled.frames) != 1:
            raise RuntimeError(f"fragment {p}: expected one snapshot frame")
        vectors.append(codec.decode(pulled.frames[0][2], num_values=plan.fragment_sizes[p]))
        versions[p] = pulled.version
        if pulled.version > infos[p].version:
            still_open.pop(p, None)  # its round closed since the Describe
    return GlobalModel(plan, vectors, versions, still_open, fmap, round(waited, 2))


def _asked(client: ShardClient, call: Any) -> Any:
    """`call()`'s answer; UnansweredError naming the shard when the call fails."""
    try:
        return call()
    except grpc.RpcError as e:
        raise UnansweredError(
            f"shard {client.address} did not answer: {e.code().name}: {e.details()}"
        ) from e


# -- the command --------------------------------------------------------------------------


def load_export(path: str | os.PathLike[str], like: Any) -> Any:
    """An export read back into your own pytree: `like` with every synced leaf replaced by
    the exported tensor of the same name, in that leaf's dtype and sharding.

    The export holds the tensors atoll syncs, named by their paths in the tree a learner
    joined with (`layer0/w`, `blocks/0/attn/wq`): give `like` a tree of the same model (a
    fresh init, or the tree your loop ends with) and names, structure, dtypes (float32
    on the wire, cast to bfloat16 where the template has it) and shardings are kept.
    Leaves the learner did not sync (an int step counter, an RNG key) come back as
    `like` has them.

    Args:
      path: a directory `atoll export --out` wrote, or a run's model/ (`atoll up`).
      like: the template: any pytree a Learner can join with (nested dicts, a Flax NNX
        `State`, an Equinox module).

    Returns:
      A new tree of `like`'s structure.

    Raises:
      ModelDirError: `path` holds no export.
      ParamsError: the export is of another model: a synced leaf of `like` that it does
        not hold, or holds with another shape, or a tensor of it that `like` lacks
        (naming the first).

    Example:
      >>> import jax, atoll
      >>> model = MyModel(jax.random.key(0))                 # your own model, as trained
      >>> model = atoll.load_export("runs/X/model", like=model)
    """
    import jax

    from atoll.learner.pytree import ParamsError, _synced, as_like, leaf_name
    from atoll.model_dir import load
    from atoll.wire.plan import named_leaves

    exported = load(pathlib.Path(path))
    tensors = named_leaves(exported.params)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    synced = {s.name for s in exported.plan.slots}
    leaves, used = [], set()
    for key_path, leaf in with_paths:
        name = leaf_name(key_path)
        value = tensors.get(name)
        if value is None:
            if _synced(name, leaf):  # a leaf a learner syncs: the export must hold it
                raise ParamsError(f"{path} holds no tensor {name!r}: an export of another model")
            leaves.append(leaf)  # not synced: as the template has it
            continue
        if tuple(np.shape(value)) != tuple(np.shape(leaf)):
            raise ParamsError(
                f"tensor {name!r} is {tuple(np.shape(value))} in {path}, "
                f"{tuple(np.shape(leaf))} in the template: an export of another model"
            )
        leaves.append(as_like(np.asarray(value), leaf))
        used.add(name)
    extra = sorted(synced - used)
    if extra:
        raise ParamsError(
            f"{path} holds tensor {extra[0]!r} that the template lacks"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            + ": an export of another model"
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll export`."""
    p.add_argument(
        "--shards",
        required=True,
        help="every shard's HOST:PORT, in index order, or a pattern such as "
        "'atoll-syncer-{i}.atoll-syncer:7070': shards 0, 1, ... for as long as one answers",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        required=True,
        metavar="DIR",
        help="where to write the model: a new or empty directory, in one that exists",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for rounds still open to close (default 0: read the "
        "fragments as they are; the output names those read open)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=DEADLINE_SECONDS,
        metavar="SECONDS",
        help="seconds to wait for each shard's answer (default %(default)g)",
    )
    p.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="file holding a bearer token, when the shards require one",
    )
    add_tls_arguments(p)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll export`: prints the export's record as JSON; exit 0, 1 (a shard did not
    answer) or 2 (what was asked cannot be done)."""
    from atoll import model_dir
    from atoll.cluster.reshard import shard_clients

    try:
        addresses = address_list(args.shards.replace("{i}", "0"))
    except argparse.ArgumentTypeError as e:
        parser.error(f"{e} (or a pattern such as 'HOST-{{i}}:PORT')")
    if "{i}" in args.shards and len(addresses) != 1:
        parser.error(f"--shards: a pattern is one address with {{i}}, got {args.shards!r}")
    if not args.wait >= 0:
        parser.error(f"--wait must be >= 0, got {args.wait}")
    if not args.deadline > 0:
        parser.error(f"--deadline must be > 0, got {args.deadline}")
    try:
        model_dir.check_target(args.out)
    except model_dir.ModelDirError as e:
        parser.error(f"--out: {e}")
    tls = tls_from_args(args, parser)
    try:
        token = args.token_file.read_text().strip() if args.token_file else None
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"--token-file: {e}")

    def connect(address: str) -> ShardClient:
        return ShardClient(address, "", token=token, tls=tls, deadline=args.deadline)

    clients: list[ShardClient] = []
    try:
        clients = shard_clients(args.shards, 1, connect)
        model = read_global(clients, args.wait)
        preset = model_dir.recognise_preset(model.plan)
        record = model_dir.write(args.out, model.params(), model.plan, model.record(), preset)
    except UnansweredError as e:
        return _fail(f"{e} (is it up? rerun when it is)", 1)
    except (RuntimeError, ValueError) as e:  # no model, plans that disagree, a taken --out
        return _fail(str(e), 2)
    except OSError as e:
        return _fail(f"could not write {args.out}: {e}", 2)
    finally:
        for c in clients:
            c.close()
    print(json.dumps({"out": str(args.out), **record}, indent=2))
    opened = [str(f["fragment"]) for f in record["fragments"] if f["round_open"]]
    if opened:
        several = len(opened) > 1
        print(
            f"atoll export: fragment{'s' if several else ''} {', '.join(opened)} "
            f"{'were' if several else 'was'} read with {'their rounds' if several else 'its round'} "
            "open (those pushes are not in the model); --wait SECONDS waits for rounds to close",
            file=sys.stderr,
        )
    return 0


def _fail(message: str, code: int) -> int:
    print(f"atoll export: {message}", file=sys.stderr, flush=True)
    return code
