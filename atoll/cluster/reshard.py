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

`atoll drain`, the scale-down path in Kubernetes that calls `reshard`, is
atoll/cluster/drain.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.commands import (
    add_tls_arguments,
    address_list,
    positive_int,
    tls_from_args,
)
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import SYNCER_SERVICE, ShardClient, TlsFiles, described_map
from atoll.wire.plan import FragmentMap

# a shard past those that must answer that is silent this long is not up (one where
# nothing listens is known at once: `answers`)
PROBE_SECONDS = 5.0
# An Adopt refused with these was checked and refused before the target logged anything
# (docs/resharding.md, "What a shard checks"): its source may take the fragment back.
REFUSED_UNLOGGED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)


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


def answers(client: ShardClient, timeout: float = PROBE_SECONDS) -> bool:
    """Whether a shard is up at `client`'s address: it answers a Describe within `timeout`
    s. An address where nothing listens (no shard there, or one not started yet) is known
    at once (`ShardClient.listening`), so probing past the last shard costs no timeout."""
    if not client.listening(timeout):
        return False
    try:
        client.describe(timeout=timeout)
    except grpc.RpcError:
        return False
    return True


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
) -> tuple[FragmentMap, dict[str, Any]]:
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
        if not answers(c):
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
) -> dict[str, Any]:
    """Finishes any move a failure interrupted, then plans and carries out the moves
    that balance the fragments over `num_shards`. A move from or to a shard that does not
    serve (down, or restarting: `ready`) is left for a rerun (`skipped`), its fragment
    serving where it was; none starts once `clock()` passes `until`."""
    done: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
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
        addresses = address_list(args.shards.replace("{i}", "0"))
    except argparse.ArgumentTypeError as e:
        parser.error(f"{e} (or a pattern such as 'HOST-{{i}}:PORT')")
    if "{i}" in args.shards and len(addresses) != 1:
        parser.error(f"--shards: a pattern is one address with {{i}}, got {args.shards!r}")
    tls = tls_from_args(args, parser)
    try:
        token = operator_token(args.token_file) if args.token_file else None
    except (OSError, ConfigError) as e:
        parser.error(f"--token-file: {e}")
    return run(args.shards, args.to, token, tls)


def operator_token(path: pathlib.Path) -> str:
    """The first token in a shard's token file that is bound to no learner (operator calls
    take no other)."""
    from atoll.server.config import ConfigError, load_tokens

    for token, learner in load_tokens(path).items():
        if learner is None:
            return token
    raise ConfigError(
        f"{path}: every token is bound to a learner; moving fragments needs one bound to "
        "none (a line holding only the token)"
    )


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
