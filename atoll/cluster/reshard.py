"""`atoll reshard`: plans the moves that balance fragments over N shards and carries
them out on live shards, one fragment at a time (docs/resharding.md).

It keeps no state of its own: each move is freeze (source), export + adopt (target),
commit (source), every step durable on its shard and answered the same way when
repeated, and a rerun after any failure finds where each move stands from the shards'
`Describe` answers and finishes it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

import grpc

from atoll.wire.client import ShardClient, described_map
from atoll.wire.plan import FragmentMap


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


def newest_map(clients: Sequence[ShardClient]) -> FragmentMap:
    """The shards' maps merged, fragment by fragment (each knows the moves it took part in)."""
    maps = [m for m in (described_map(c.describe()) for c in clients) if m is not None]
    if not maps:
        raise RuntimeError("no shard has a fragment plan yet: start a learner first")
    return FragmentMap.merge_all(maps)


def move(
    clients: Sequence[ShardClient],
    current: FragmentMap,
    m: Move,
    say: Callable[[str], None] = lambda _: None,
    new: FragmentMap | None = None,
) -> tuple[FragmentMap, dict]:
    """Carries out one move from `current` (to `new`, by default `current` with the
    fragment moved one version on); returns the new map and what it cost.

    Resumes a move a failure left half done: a target that already adopted the fragment
    under the new map only needs the source's commit."""
    new = new or current.moved(m.fragment, m.target)
    source, target = clients[m.source], clients[m.target]
    started = time.monotonic()
    d = target.describe()
    adopted = (
        len(d.owners) > m.fragment
        and d.owners[m.fragment] == m.target
        and d.moved_at[m.fragment] >= new.version
    )
    moved_bytes = 0
    if not adopted:
        source.freeze(m.fragment, new)
        say(f"fragment {m.fragment}: frozen on shard {m.source}")
        meta, payload = source.export(m.fragment)
        moved_bytes = len(payload)
        target.adopt(meta, payload)
        say(f"fragment {m.fragment}: adopted by shard {m.target} ({moved_bytes} bytes)")
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


def interrupted(clients: Sequence[ShardClient]) -> list[tuple[Move, FragmentMap]]:
    """Moves a failure left half done: fragments frozen on their source, with the map
    each was frozen for."""
    found = []
    for i, c in enumerate(clients):
        d = c.describe()
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


def reshard(
    clients: Sequence[ShardClient], num_shards: int, say: Callable[[str], None] = print
) -> dict:
    """Finishes any move a failure interrupted, then plans and carries out the moves
    that balance the fragments over `num_shards`."""
    done = []
    for m, frozen_for in interrupted(clients):
        say(f"fragment {m.fragment}: finishing its move to shard {m.target}")
        _, record = move(clients, frozen_for, m, say, new=frozen_for)
        done.append(record)
    current = newest_map(clients)
    if num_shards > len(clients):
        raise ValueError(f"--to {num_shards} shards, but {len(clients)} addresses were given")
    moves = plan_moves(current, num_shards)
    say(f"map version {current.version}: {len(moves)} moves to balance over {num_shards} shards")
    for m in moves:
        current, record = move(clients, current, m, say)
        done.append(record)
    return {"map_version": current.version, "owners": list(current.owners), "moves": done}


def main(addresses: list[str], num_shards: int, token: str | None) -> int:
    clients = [ShardClient(a, "", token=token, deadline=120.0) for a in addresses]
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
    return 0
