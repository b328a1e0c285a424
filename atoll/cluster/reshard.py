"""`atoll reshard`: plans the moves that balance fragments over N shards and carries
them out on live shards, one fragment at a time (docs/resharding.md).

It keeps no state of its own: each move is freeze (source), export + adopt (target),
commit (source), every step durable on its shard and answered the same way when
repeated, and a rerun after any failure finds where each move stands from the shards'
`Describe` answers and finishes it. A shard counts only once its health service says
SERVING (its log replayed, so its map is current): a fragment is frozen only for a
target that serves, and thawed again when its target stops serving before the state
was sent (or refuses it), so a restarting target never leaves a fragment frozen that
it could not hold.

`atoll drain` is the syncer pod's preStop hook in Kubernetes: a pod that a scale-down
takes away (its ordinal at or past the StatefulSet's replicas) hands its fragments to
the shards that stay before it stops; any other stop (a restart, an eviction, a node
drain) keeps them, since the pod comes back on the same volume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.commands import (
    Terminated,
    add_tls_arguments,
    check_tls_pairs,
    non_negative_int,
    positive_int,
    raise_terminated,
    shard_addresses,
    tls_from_args,
)
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient, TlsFiles, described_map
from atoll.wire.plan import FragmentMap

PROBE_SECONDS = 5.0  # a shard past those that must answer that is silent this long is not up
SYNCER_SERVICE = pb.DESCRIPTOR.services_by_name["Syncer"].full_name  # as its health names it
# An Adopt refused with these was checked and refused before the target logged anything
# (docs/resharding.md, "What a shard checks"): its source may take the fragment back.
REFUSED_UNLOGGED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)
DRAIN_POLL_SECONDS = 1.0
# A drain's calls give up after this: the last move started before its --timeout still
# ends inside the pod's grace period
DRAIN_CALL_SECONDS = 15.0
# The most a move can take: MOVE_CALLS calls (Describe of target and source, Freeze,
# Export, Adopt, Commit) and two health checks of its target (`move`)
MOVE_CALLS = 6
MOVE_SECONDS = MOVE_CALLS * DRAIN_CALL_SECONDS + 2 * PROBE_SECONDS


@dataclasses.dataclass(frozen=True)
class Move:
    fragment: int
    source: int
    target: int


def plan_moves(current: FragmentMap, num_shards: int) -> list[Move]:
    """The fewest single-fragment moves that leave every one of `num_shards` shards
    owning ⌊P/N⌋ or ⌈P/N⌉ fragments (shards at or past num_shards own none).

    Moves take fragments from the most loaded shards (the highest-numbered fragment of
    each first) and give them to the least loaded; a fragment already on a shard that
    keeps it never moves, so no bytes move that need not.

    Example:
      >>> [(m.fragment, m.source, m.target) for m in plan_moves(FragmentMap.modulo(6, 2), 3)]
      [(4, 0, 2), (5, 1, 2)]
    """
    if not 1 <= num_shards <= current.num_fragments:
        raise ValueError(
            f"--shards {num_shards}: want 1 to {current.num_fragments} (the fragments there are)"
        )
    owned: dict[int, list[int]] = {s: [] for s in range(max(num_shards, max(current.owners) + 1))}
    for p, s in enumerate(current.owners):
        owned[s].append(p)
    base, extra = divmod(current.num_fragments, num_shards)
    # shards that may keep one more than base: those already holding the most
    ranked = sorted(range(num_shards), key=lambda s: (-len(owned[s]), s))
    quota = {s: base + (1 if i < extra else 0) for i, s in enumerate(ranked)}
    quota.update({s: 0 for s in owned if s >= num_shards})
    spare = [p for s in sorted(owned) for p in sorted(owned[s])[quota[s] :]]
    spare.sort(key=lambda p: (-len(owned[current.owners[p]]), -p))
    moves = []
    for s in sorted(range(num_shards), key=lambda s: (len(owned[s]), s)):
        while len(owned[s]) < quota[s]:
            p = spare.pop(0)
            moves.append(Move(p, current.owners[p], s))
            owned[current.owners[p]].remove(p)
            owned[s].append(p)
    return sorted(moves, key=lambda m: m.fragment)


class NoPlanError(RuntimeError):
    """No shard holds a fragment plan yet: there is nothing to move."""


class NotServing(RuntimeError):
    """A move's target stopped serving before it was sent the fragment: the move waits."""


def serving(client: ShardClient) -> bool:
    """Whether the shard's health service says SERVING: it has replayed its log (its map
    and fragments are current) and is not stopping. Down or restarting: False."""
    request = health_pb2.HealthCheckRequest(service=SYNCER_SERVICE)
    try:
        answer = health_pb2_grpc.HealthStub(client.channel).Check(request, timeout=PROBE_SECONDS)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return False
        raise
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def describe_all(
    clients: Sequence[ShardClient], ready: Callable[[ShardClient], bool] = serving
) -> dict[int, pb.DescribeResponse]:
    """{shard: its Describe} of the shards that serve (one that is down, or restarting and
    still replaying its log, whose map may be behind, is left out; any other refusal is
    raised)."""
    out = {}
    for i, c in enumerate(clients):
        try:
            if ready(c):
                out[i] = c.describe(timeout=PROBE_SECONDS)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
    return out


def newest_map(described: dict[int, pb.DescribeResponse]) -> FragmentMap:
    """The shards' maps merged, fragment by fragment (each knows the moves it took part in)."""
    maps = [m for m in (described_map(d) for d in described.values()) if m is not None]
    if not maps:
        raise NoPlanError("no shard has a fragment plan yet: start a learner first")
    return FragmentMap.merge_all(maps)


def move(
    clients: Sequence[ShardClient],
    current: FragmentMap,
    m: Move,
    say: Callable[[str], None] = lambda _: None,
    new: FragmentMap | None = None,
    ready: Callable[[ShardClient], bool] = serving,
) -> tuple[FragmentMap, dict]:
    """Carries out one move from `current` (to `new`, by default `current` with the
    fragment moved one version on); returns the new map and what it cost.

    Resumes a move a failure left half done: a target that already adopted the fragment
    under the new map only needs the source's commit.

    A fragment is frozen only while its target serves (`ready`). A move this call froze
    is thawed on its source (Unfreeze) when the target stops serving before the Adopt is
    sent, or refuses it before logging anything: the target cannot hold the fragment, so
    the source takes pushes again and `NotServing` (or the refusal) is raised. An Adopt
    that fails any other way (the target killed mid-call) may have been logged, so the
    fragment stays frozen until the target answers again and the move is finished: only
    one shard may ever take its pushes."""
    new = new or current.moved(m.fragment, m.target)
    source, target = clients[m.source], clients[m.target]
    started = time.monotonic()
    d = target.describe()
    adopted = (
        len(d.owners) > m.fragment
        and d.owners[m.fragment] == m.target
        and d.moved_at[m.fragment] >= new.version
    )
    moving = {f.fragment: f.moving_version for f in source.describe().fragments}
    moved_bytes = 0
    if not adopted:
        if not ready(target):
            raise NotServing(f"shard {m.target} is not serving: fragment {m.fragment} waits")
        mine = moving.get(m.fragment) == 0  # this call freezes it (not resuming a move)
        source.freeze(m.fragment, new)
        say(f"fragment {m.fragment}: frozen on shard {m.source}")
        meta, payload = source.export(m.fragment)
        moved_bytes = len(payload)
        # checked again just before the state is sent: until then the target holds none of
        # it, so thawing is safe; once an Adopt is sent it may be logged whatever we hear
        sent = ready(target)
        try:
            if not sent:
                raise NotServing(f"shard {m.target} stopped serving: fragment {m.fragment} waits")
            target.adopt(meta, payload)
        except (NotServing, grpc.RpcError) as e:
            unlogged = isinstance(e, NotServing) or e.code() in REFUSED_UNLOGGED
            if mine and unlogged:
                source.unfreeze(m.fragment)
                say(f"fragment {m.fragment}: thawed on shard {m.source} ({e})")
            raise
        say(f"fragment {m.fragment}: adopted by shard {m.target} ({moved_bytes} bytes)")
    elif moving.get(m.fragment):
        source.export(m.fragment)  # a source commits only a state it handed out since it froze
    source.commit(m.fragment, new)
    say(f"fragment {m.fragment}: committed, map version {new.version}")
    return new, {
        "fragment": m.fragment,
        "from": m.source,
        "to": m.target,
        "map_version": new.version,
        "bytes": moved_bytes,
        "seconds": round(time.monotonic() - started, 3),
    }


def interrupted(described: dict[int, pb.DescribeResponse]) -> list[tuple[Move, FragmentMap]]:
    """Moves a failure left half done: fragments frozen on their source, with the map
    each was frozen for."""
    found = []
    for i, d in sorted(described.items()):
        mine = described_map(d)
        for f in d.fragments:
            if f.moving_version and mine is not None:
                found.append(
                    (
                        Move(f.fragment, i, f.moving_to),
                        mine.stating(f.fragment, f.moving_to, f.moving_version),
                    )
                )
    return found


def shard_clients(
    spec: str, at_least: int, connect: Callable[[str], ShardClient]
) -> list[ShardClient]:
    """Every shard's client, in index order: the addresses of 'HOST:PORT,HOST:PORT', or a
    pattern with {i} for shards 0 to at_least - 1 and past them for as long as a shard
    answers (a scale-down's leaving shards, a scale-up's new ones)."""
    if "{i}" not in spec:
        return [connect(a.strip()) for a in spec.split(",") if a.strip()]
    clients = [connect(spec.replace("{i}", str(i))) for i in range(at_least)]
    while True:
        c = connect(spec.replace("{i}", str(len(clients))))
        try:
            c.describe(timeout=PROBE_SECONDS)
        except grpc.RpcError:
            c.close()
            return clients
        clients.append(c)


def reshard(
    clients: Sequence[ShardClient],
    num_shards: int,
    say: Callable[[str], None] = print,
    until: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    ready: Callable[[ShardClient], bool] = serving,
) -> dict:
    """Finishes any move a failure interrupted, then plans and carries out the moves
    that balance the fragments over `num_shards`. A move from or to a shard that does not
    serve (down, or restarting: `ready`) is left for a rerun (`skipped`), its fragment
    serving where it was; none starts once `clock()` passes `until`."""
    done: list[dict] = []
    skipped: list[dict] = []
    described = describe_all(clients, ready)

    def carry_out(current: FragmentMap, m: Move, new: FragmentMap | None = None) -> FragmentMap:
        if m.source not in described or m.target not in described:
            skipped.append(dataclasses.asdict(m))
            say(f"fragment {m.fragment}: shard {m.source} or {m.target} is not serving")
            return current
        if until is not None and clock() >= until:
            raise TimeoutError(f"out of time before moving fragment {m.fragment}")
        try:
            current, record = move(clients, current, m, say, new=new, ready=ready)
        except NotServing as e:
            skipped.append(dataclasses.asdict(m))
            say(str(e))
            return current
        done.append(record)
        return current

    current = newest_map(described)
    for m, frozen_for in interrupted(described):
        say(f"fragment {m.fragment}: finishing its move to shard {m.target}")
        current = current.merged(carry_out(current, m, new=frozen_for))
    if skipped:  # a move begun holds the next map version: no other starts before it ends
        say("a move begun waits for its shard: no other move starts before it ends")
        return {
            "map_version": current.version,
            "owners": list(current.owners),
            "moves": done,
            "skipped": skipped,
        }
    if num_shards > len(clients):
        raise ValueError(f"--to {num_shards} shards, but {len(clients)} addresses were given")
    unreached = sorted({s for s in current.owners if s >= len(clients)})
    if unreached:
        raise ValueError(
            f"shards {unreached} own fragments but are not among the {len(clients)} "
            "shards reached: start them (or give their addresses) and rerun"
        )
    moves = plan_moves(current, num_shards)
    say(f"map version {current.version}: {len(moves)} moves to balance over {num_shards} shards")
    for m in moves:
        current = carry_out(current, m)
    return {
        "map_version": current.version,
        "owners": list(current.owners),
        "moves": done,
        "skipped": skipped,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll reshard`."""
    p.add_argument(
        "--shards",
        required=True,
        help="every shard's HOST:PORT, in index order (those it moves fragments to included), "
        "or a pattern such as 'atoll-syncer-{i}.atoll-syncer:50051': shards 0 to N-1, and "
        "past them those that answer",
    )
    p.add_argument(
        "--to", type=positive_int, required=True, help="N: the shards that own fragments after"
    )
    p.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="a bearer token bound to no learner (with the shards' --token-file on)",
    )
    add_tls_arguments(p)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll reshard`: 0 when every move is made, 1 when a shard did not answer (rerun), 2 on a
    user error."""
    from atoll.server.config import ConfigError

    try:
        addresses = shard_addresses(args.shards.replace("{i}", "0"))
    except argparse.ArgumentTypeError as e:
        parser.error(f"{e} (or a pattern such as 'HOST-{{i}}:PORT')")
    if "{i}" in args.shards and len(addresses) != 1:
        parser.error(f"--shards: a pattern is one address with {{i}}, got {args.shards!r}")
    tls = tls_from_args(args, parser)
    try:
        token = operator_token(args.token_file) if args.token_file else None
    except (OSError, ConfigError, DrainError) as e:
        parser.error(f"--token-file: {e}")
    return run(args.shards, args.to, token, tls)


def run(spec: str, num_shards: int, token: str | None, tls: TlsFiles | None = None) -> int:
    """Reshards the shards `spec` names to `num_shards`, printing each step and the result."""
    clients = shard_clients(
        spec, num_shards, lambda a: ShardClient(a, "", token=token, tls=tls, deadline=120.0)
    )
    try:
        result = reshard(clients, num_shards, say=lambda line: print(line, flush=True))
    except (ValueError, RuntimeError) as e:
        print(f"atoll reshard: {e}", flush=True)
        return 2
    except grpc.RpcError as e:
        print(f"atoll reshard: {e.code().name}: {e.details()} (rerun to finish)", flush=True)
        return 1
    finally:
        for c in clients:
            c.close()
    print(json.dumps(result, indent=2))
    if result["skipped"]:
        print("atoll reshard: some shards did not answer: rerun when they are up", flush=True)
        return 1
    return 0


# --- atoll drain: the scale-down path in Kubernetes ---


class DrainError(RuntimeError):
    """The drain could not finish; the message says what is left and how to finish it."""


TRANSIENT = (  # what a drain waits out: shards restarting, moves another planner began
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


class _Dialled:
    """Shard clients made on first use, by index; `answers(i)`: whether shard i is up."""

    def __init__(self, connect: Callable[[int], ShardClient]):
        self.connect = connect
        self.made: dict[int, ShardClient] = {}

    def client(self, i: int) -> ShardClient:
        if i not in self.made:
            self.made[i] = self.connect(i)
        return self.made[i]

    def answers(self, i: int) -> bool:
        try:
            self.client(i).describe(timeout=PROBE_SECONDS)
            return True
        except grpc.RpcError:
            return False

    def forget(self, i: int) -> None:
        """Closes shard i's client: the next use dials afresh (a channel that failed while
        its shard restarted may wait out a long reconnect backoff before trying again)."""
        if i in self.made:
            self.made.pop(i).close()

    def close(self) -> None:
        for c in self.made.values():
            c.close()


def _plan_drain(
    index: int,
    kept: int,
    client: Callable[[int], ShardClient],
    answers: Callable[[int], bool],
    say: Callable[[str], None],
    deadline: float,
    clock: Callable[[], float],
) -> dict | None:
    """The planner's part of a drain: every move off shards `kept` and past, made by
    `reshard` over every shard up to the last that answers; None if no shard has a plan."""
    known = index + 1
    while answers(known):
        known += 1
    say(f"shard {index} plans the moves off shards {kept} to {known - 1}")
    shards = [client(i) for i in range(known)]
    try:
        return reshard(shards, kept, say, until=deadline, clock=clock)
    except NoPlanError:
        return None  # no fragment anywhere yet


def _frozen(d: pb.DescribeResponse) -> str:
    """The fragments a shard's Describe shows frozen mid-move, for a drain that stops
    ("" if none: every fragment it holds takes pushes)."""
    return "".join(
        f"; fragment {f.fragment} is frozen mid-move to shard {f.moving_to}, which may hold "
        "it already: it takes no pushes until that shard answers and the move ends"
        for f in d.fragments
        if f.moving_version
    )


def drain(
    index: int,
    replicas: Callable[[], int],
    connect: Callable[[int], ShardClient],
    timeout: float,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    ordered: bool = False,
    shards: str = "HOST-{i}:PORT",
) -> dict:
    """Shard `index` is stopping; `replicas()` says how many pods its StatefulSet keeps
    (asked again each round: a second scale-down may come), `connect(i)` makes shard i's
    client.

    A shard that stays (index < replicas) keeps its fragments: it restarts on its volume.
    Of the shards a scale-down takes away, one plans and makes every move (`reshard` to
    the replicas, balanced) so that no two planners race for a map version: with
    podManagementPolicy Parallel every leaving pod stops at once and the lowest leaving
    shard that answers plans; with OrderedReady (`ordered`) they stop one at a time,
    highest first, while the rest still run, so each plans in its turn. Every leaving
    shard, the planner too, returns only once it owns no fragment and moves none; until
    `timeout` it asks again after anything transient (a shard restarting, a move another
    planner began: the rerun finishes it).

    A shard that stays but restarts meanwhile (a rolling update) is waited for: no
    fragment is frozen for it until it answers SERVING (`reshard`), and one whose target
    stopped serving before it was sent the state is thawed, so a drain that runs out of
    time leaves each fragment serving where it was. The DrainError then says what this
    shard still holds, which shards did not serve, and the `atoll reshard` (over the
    `shards` pattern) that finishes."""
    deadline = clock() + timeout
    dialled = _Dialled(connect)
    client, answers = dialled.client, dialled.answers
    moves: list[dict] = []
    planned: dict = {}  # the map the last plan left: map_version, owners
    left = "its fragments"  # what the last round found on this shard
    frozen = ""  # which of them are frozen mid-move
    waiting: set[int] = set()  # shards the last plan's moves waited for
    try:
        while True:
            kept = replicas()
            if index < kept:
                say(f"shard {index} stays ({kept} replicas): it keeps its fragments")
                return {"shard": index, "replicas": kept, "drained": False, "moves": moves}
            if kept < 1:
                raise DrainError(
                    "the StatefulSet scales to 0: no shard is left to take the fragments, "
                    "which stay on the shards' volumes (scale up again to serve them)"
                )
            try:
                if ordered or not any(answers(i) for i in range(kept, index)):
                    result = _plan_drain(index, kept, client, answers, say, deadline, clock)
                    if result is not None:
                        moves += result["moves"]
                        planned = {k: result[k] for k in ("map_version", "owners")}
                        skipped = result.get("skipped", [])
                        waiting = {s for m in skipped for s in (m["source"], m["target"])}
                        for s in waiting - {index}:
                            dialled.forget(s)
                own = client(index).describe(timeout=PROBE_SECONDS)
                held = sorted(f.fragment for f in own.fragments)
                if not held:
                    say(f"shard {index} owns no fragment any more")
                    return {
                        "shard": index,
                        "replicas": kept,
                        "drained": True,
                        "moves": moves,
                        **planned,
                    }
                left, frozen = f"fragments {held}", _frozen(own)
                say(f"shard {index} still holds {left}{frozen}")
            except grpc.RpcError as e:
                if e.code() not in TRANSIENT:
                    raise
                say(f"{e.code().name}: {e.details()}; asking again")
                left = f"its fragments ({e.code().name})"
            except (ValueError, RuntimeError) as e:  # a shard owning fragments is not up
                say(f"{e}; asking again")
            if clock() >= deadline:
                others = sorted(waiting - {index})
                why = f" (shards {others} did not serve)" if others else ""
                raise DrainError(
                    f"shard {index} still holds {left} after {timeout:g} s{why}"
                    f"{frozen or ', none frozen'}; they stay on its volume, served by no "
                    f"shard once its pod stops. To finish: scale the StatefulSet back up to "
                    f"{index + 1} or more (the pod returns with them), run atoll reshard --shards "
                    f"'{shards}' --to {kept} (with the operator token) once shards 0 to "
                    f"{kept - 1} answer, then scale down again"
                )
            time.sleep(DRAIN_POLL_SECONDS)
    finally:
        dialled.close()


def operator_token(path: pathlib.Path) -> str:
    """The first token in a shard's token file that is bound to no learner (operator calls
    take no other)."""
    from atoll.server.config import load_tokens

    for token, learner in load_tokens(path).items():
        if learner is None:
            return token
    raise DrainError(
        f"{path}: every token is bound to a learner; moving fragments needs one bound to "
        "none (a line holding only the token)"
    )


def statefulset_scale(namespace: str, name: str) -> tuple[int, bool] | None:
    """(spec.replicas, whether its pods stop one at a time) of StatefulSet `name` (None:
    it is gone, as when a run is deleted)."""
    from kubernetes import client
    from urllib3.exceptions import HTTPError

    from atoll.cluster.kube import KubeError, connect

    api = client.AppsV1Api(connect().api_client)
    try:
        answer = api.read_namespaced_stateful_set(
            name, namespace, _request_timeout=(5.0, 15.0), _preload_content=False
        )
        sts = json.loads(answer.data)  # only spec.replicas is read: no model to validate
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return None
        hint = " (the syncer's Role must allow get on statefulsets)" if e.status == 403 else ""
        raise KubeError(
            f"reading StatefulSet {namespace}/{name}: {e.status} {e.reason}{hint}"
        ) from None
    except (OSError, HTTPError) as e:
        raise KubeError(
            f"reading StatefulSet {namespace}/{name}: cannot reach the Kubernetes API "
            f"({type(e).__name__})"
        ) from None
    except ValueError as e:
        raise KubeError(f"reading StatefulSet {namespace}/{name}: not JSON ({e})") from None
    spec = sts.get("spec") or {}
    replicas = spec.get("replicas")  # the API server always fills it in (default 1)
    if not isinstance(replicas, int) or replicas < 0:
        raise KubeError(f"StatefulSet {namespace}/{name} has spec.replicas {replicas!r}")
    return replicas, spec.get("podManagementPolicy", "OrderedReady") != "Parallel"


SERVICE_ACCOUNT_NAMESPACE = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def add_drain_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll drain`."""
    p.add_argument(
        "--shards",
        default=None,
        help="the shards' address pattern, 'HOST-{i}:PORT' "
        "(env ATOLL_DRAIN_SHARDS; default atoll-syncer-{i}.atoll-syncer:50051)",
    )
    p.add_argument(
        "--shard-index",
        type=non_negative_int,
        default=None,
        help="this shard (default: ATOLL_SHARD_INDEX, or the ordinal ending ATOLL_POD_NAME)",
    )
    p.add_argument(
        "--replicas",
        type=non_negative_int,
        default=None,
        help="the shards that stay (default: the StatefulSet's spec.replicas, read from the "
        "Kubernetes API)",
    )
    p.add_argument("--statefulset", default="atoll-syncer", help="the shards' StatefulSet")
    p.add_argument(
        "--namespace",
        default=None,
        help="its namespace (env ATOLL_NAMESPACE; default: the pod's own)",
    )
    p.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="the shards' token file; its first token bound to no learner is used "
        "(env ATOLL_TOKEN_FILE)",
    )
    add_tls_arguments(p)
    for action in p._actions:  # the preStop hook gives no flags: each has its env default
        if action.dest in ENV_DRAIN_TLS:
            action.help = f"{action.help} (env {ENV_DRAIN_TLS[action.dest]})"
    p.add_argument(
        "--timeout",
        type=float,
        default=480.0,
        help="seconds a leaving shard waits for its fragments to move (keep under the pod's "
        "terminationGracePeriodSeconds)",
    )


def drain_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll drain`: 0 when this shard stays or handed its fragments over, 1 when a shard
    refused, 2 when the drain could not finish or a flag is wrong."""
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
    for flag in ("tls_ca", "tls_cert", "tls_key"):  # the preStop hook gives no flags
        if getattr(args, flag) is None and env[flag]:
            setattr(args, flag, pathlib.Path(env[flag]))
    check_tls_pairs(args, parser)  # the files are read only if this shard leaves
    token_file = args.token_file or (pathlib.Path(env["token_file"]) if env["token_file"] else None)
    if not args.timeout > 0:
        parser.error("--timeout must be above 0")
    tls = (args.tls_ca, args.tls_cert, args.tls_key)
    return drain_main(
        spec,
        index,
        args.replicas,
        args.statefulset,
        args.namespace or env["namespace"],
        token_file,
        tls,
        args.timeout,
    )


def drain_main(
    spec: str,
    index: int,
    replicas: int | None,
    statefulset: str,
    namespace: str | None,
    token_file: pathlib.Path | None,
    tls_files: tuple[pathlib.Path | None, pathlib.Path | None, pathlib.Path | None],
    timeout: float,
) -> int:
    """Drains shard `index` if a scale-down takes it away. `tls_files` is (CA, client
    certificate, key), each None or a path: read only once the shard is known to leave, so a
    restart never fails on a file it does not need."""
    from atoll.cluster.kube import KubeError
    from atoll.server.config import ConfigError

    say = lambda line: print(f"atoll drain: {line}", flush=True)  # noqa: E731
    stay = "N"  # the shards that stay, once known (for the way out of a stopped drain)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        ordered = False  # --replicas given: as shipped, Parallel
        if replicas is None:
            where = namespace or (
                SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
                if SERVICE_ACCOUNT_NAMESPACE.exists()
                else "atoll"
            )
            scale = statefulset_scale(where, statefulset)
            if scale is None:
                say(f"StatefulSet {where}/{statefulset} is gone: the run is being deleted")
                return 0
            first, ordered = scale

            def kept() -> int:
                now = statefulset_scale(where, statefulset)
                return first if now is None else now[0]

        else:
            first = replicas

            def kept() -> int:
                return first

        stay = str(first)
        if index < first:  # a restart, an eviction: nothing to hand over, no token needed
            say(f"shard {index} stays ({first} replicas): it keeps its fragments")
            return 0
        token = operator_token(token_file) if token_file else None
        for flag, path in zip(("--tls-ca", "--tls-cert", "--tls-key"), tls_files):
            if path is not None and not path.is_file():
                raise DrainError(f"{flag} {path}: no such file (in the Secret's mount)")
        tls_ca, tls_cert, tls_key = tls_files
        tls = TlsFiles(tls_ca, tls_cert, tls_key) if tls_ca else None

        def connect(i: int) -> ShardClient:
            address = spec.replace("{i}", str(i))
            return ShardClient(address, "", token=token, tls=tls, deadline=DRAIN_CALL_SECONDS)

        result = drain(index, kept, connect, timeout, say, ordered=ordered, shards=spec)
    except (DrainError, KubeError, ConfigError, OSError) as e:
        say(str(e))
        return 2
    except grpc.RpcError as e:
        say(f"{e.code().name}: {e.details()}")
        return 1
    except (Terminated, KeyboardInterrupt) as e:
        # a move cut short is finished by the next reshard (every step is durable)
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        say(
            f"stopped by {signal.Signals(signum).name}: what shard {index} still owns stays on "
            f"its volume; run atoll reshard --to {stay} while it is up"
        )
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result), flush=True)
    return 0


ENV_DRAIN_SHARDS = "ATOLL_DRAIN_SHARDS"
ENV_NAMESPACE = "ATOLL_NAMESPACE"
# the drain's TLS files (--tls-ca, --tls-cert, --tls-key) when the hook gives no flags:
# the CA of the shards' certificates, and a client certificate and key for shards that
# require mutual TLS (--tls-client-ca)
ENV_DRAIN_TLS = {
    "tls_ca": "ATOLL_DRAIN_TLS_CA",
    "tls_cert": "ATOLL_DRAIN_TLS_CERT",
    "tls_key": "ATOLL_DRAIN_TLS_KEY",
}
DEFAULT_DRAIN_SHARDS = "atoll-syncer-{i}.atoll-syncer:50051"


def drain_defaults() -> dict:
    """The drain's settings from the syncer pod's environment."""
    return {
        "shards": os.environ.get(ENV_DRAIN_SHARDS, DEFAULT_DRAIN_SHARDS),
        "namespace": os.environ.get(ENV_NAMESPACE),
        "token_file": os.environ.get("ATOLL_TOKEN_FILE"),
        **{key: os.environ.get(name) or None for key, name in ENV_DRAIN_TLS.items()},
    }
