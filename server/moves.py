"""What a move call must say before a shard logs it (docs/resharding.md).

The five move calls (Freeze, Export, Adopt, Commit, Unfreeze) come from an operator's
tool, but a shard holds everyone's work: a bug in that tool, a replayed call or a leaked
token must not be able to corrupt it. So each call is checked here, as pure functions of
what the shard knows, before anything is logged:

  1. A map is exactly the next version: one past the newest version that the shard's own
     map or the new map's other fragments name, saying that fragment p moves in it, and
     agreeing with the shard's map about every other fragment it knows (the same owner
     at the same version, or a newer move between other shards); every owner is a valid
     shard index (below config.MAX_SHARDS, as --shard-index is) and every version in
     [0, 2^63 - 1].
  2. An adopted state is exactly what `Fragment.state()` makes for this plan and
     settings: the same keys, every number of its type and range, every array of the
     template's dtype and shape with finite values (params, momentum and the published
     copy within ±MAX_ABS_VALUE, weights within a push's bounds, learner ids as
     server/learner_ids.py says: what a push or Init must meet), the delta ring's versions
     consecutive and ending at the fragment's version. Anything unknown is refused.
  3. An Adopt carries its source's freeze record (`freeze`: the source's shard index and
     the LSN of its FREEZE record), for the same map: the move id both shards log. A
     Commit follows an Export of the frozen fragment by this process (a source cannot
     hand over what it never handed out; after a restart, Export again first).

What a shard cannot know it does not pretend to: a target checks that the freeze record
is there and agrees with the map, not that the source really wrote it (that would take
asking the source); the operator token is what keeps a forger from making one.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Collection
from typing import Any

import numpy as np

from atoll.server import rules
from atoll.server.config import MAX_SHARDS
from atoll.server.fragment import Answer, Fragment
from atoll.server.learner_ids import learner_id_problem
from atoll.server.log_records import LOG_ADOPT, LOG_FREEZE, LOG_MOVED, LOG_UNFREEZE, log_record
from atoll.server.push_header import MAX_TOKENS
from atoll.server.refusal import ShardError, Why
from atoll.server.state import MAX_ABS_VALUE, ShardState, _same_move
from atoll.wire import codec
from atoll.wire.plan import FragmentMap, FragmentPlan

MAX_VERSION = (1 << 63) - 1  # map and fragment versions, LSNs and seqs: an int64's range
# A learner's merge weight: at most tokens²/steps of a push (push_header.py's bounds)
MAX_WEIGHT = float(MAX_TOKENS) ** 2
FLOAT32_MAX = float(np.finfo(np.float32).max)
# arrays that hold weights (params, the published copy, momentum) rather than sums of them
VALUE_ARRAYS = re.compile(r"params|published|opt\.\d+")
STATE_KEYS = frozenset(
    {"version", "initialized", "last_round_size", "ring", "contributors", "answers", "round"}
)
ADOPT_KEYS = frozenset({"fragment", "map", "plan", "state", "freeze"})
FREEZE_KEYS = frozenset({"source", "lsn"})
ROUND_KEYS = frozenset({"total_weight", "count", "full_weight"})
ANSWER_TYPES = {
    "seq": int,
    "accepted": bool,
    "reason": str,
    "detail": str,
    "version": int,
    "staleness": int,
    "weight": float,
    "discount": float,
}


def _malformed(message: str) -> ShardError:
    return ShardError(Why.MALFORMED, message)


def is_int(value: object, low: int = 0, high: int = MAX_VERSION) -> bool:
    """An int (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_map(new: FragmentMap, p: int, num_fragments: int) -> None:
    """The map alone: of the plan's size, owners valid shard indices, versions in range,
    and fragment p moving in it (rule 1, the part that needs no knowledge)."""
    if new.num_fragments != num_fragments:
        raise _malformed(f"a map of {new.num_fragments} fragments for a plan of {num_fragments}")
    if not is_int(new.version, 1):
        raise _malformed(f"map version {new.version}: want 1 to {MAX_VERSION}")
    bad = sorted({o for o in new.owners if not is_int(o, 0, MAX_SHARDS - 1)})
    if bad:
        raise _malformed(f"map owners {bad}: a shard index is below {MAX_SHARDS}")
    if not is_int(p, 0, num_fragments - 1):
        raise _malformed(f"fragment {p} does not exist (the plan has {num_fragments})")
    if new.moved_at[p] != new.version:
        raise _malformed(f"map version {new.version} does not say fragment {p} moves in it")


def check_next_map(
    current: FragmentMap | None, p: int, new: FragmentMap, me: int, held: Collection[int]
) -> None:
    """`new` follows `current` (this shard's map; None: it has none yet) by fragment p's
    move alone (rule 1). `held`: the fragments this shard holds."""
    others = [q for q in range(new.num_fragments) if q != p]
    newest = max([new.moved_at[q] for q in others] + [current.version if current else 0])
    if new.version != newest + 1:
        raise ShardError(
            Why.OUT_OF_STEP,
            f"map version {new.version} is not the next one: this shard and the map's other "
            f"fragments know version {newest}, so a move makes {newest + 1}",
        )
    for q in others:
        if current is not None and q < current.num_fragments:
            held_at, owner = current.moved_at[q], current.owners[q]
            if new.moved_at[q] < held_at or (new.moved_at[q] == held_at and new.owners[q] != owner):
                raise ShardError(
                    Why.OUT_OF_STEP,
                    f"map version {new.version} says fragment {q} is on shard {new.owners[q]} "
                    f"since version {new.moved_at[q]}; this shard knows shard {owner} since "
                    f"version {held_at}",
                )
        if (new.owners[q] == me) != (q in held):
            raise ShardError(
                Why.OUT_OF_STEP,
                f"map version {new.version} disagrees with shard {me} about fragment {q}",
            )


def check_freeze_record(freeze: Any, me: int, new: FragmentMap, p: int) -> int:
    """The source shard an Adopt's freeze record names (rule 3)."""
    if not isinstance(freeze, dict) or set(freeze) != FREEZE_KEYS:
        raise ShardError(
            Why.OUT_OF_STEP,
            "no freeze record of the source: an Adopt takes the state its source's Export "
            "gave, from a frozen fragment",
        )
    source, lsn = freeze["source"], freeze["lsn"]
    if not is_int(source, 0, MAX_SHARDS - 1) or not is_int(lsn, 1):
        raise _malformed(f"freeze record {freeze}: want a shard index and a log position")
    if source in (me, new.owner(p)):
        raise ShardError(
            Why.OUT_OF_STEP, f"freeze record of shard {source}: fragment {p} moves to shard {me}"
        )
    return int(source)


def check_adopt_meta(meta: Any) -> None:
    """An Adopt's metadata has exactly the keys an Export gives."""
    if not isinstance(meta, dict) or not isinstance(meta.get("state"), dict):
        raise _malformed("want an object with fragment, map, plan, state and freeze")
    unknown = set(meta) - ADOPT_KEYS
    if unknown:
        raise _malformed(f"unknown keys {sorted(unknown)}")
    if not is_int(meta.get("fragment"), 0, 1 << 32):
        raise _malformed(f"fragment {meta.get('fragment')!r}: want an index")


def _check_answer(learner: Any, answer: Any, version: int) -> None:
    problem = learner_id_problem(learner)
    if problem is not None:
        raise _malformed(f"answers: {problem}")
    if not isinstance(answer, dict) or set(answer) != set(ANSWER_TYPES):
        raise _malformed(f"answer of {learner}: want the fields {sorted(ANSWER_TYPES)}")
    for key, kind in ANSWER_TYPES.items():
        value = answer[key]
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if kind is float
            else isinstance(value, kind) and (kind is not int or not isinstance(value, bool))
        )
        if not ok:
            raise _malformed(f"answer of {learner}: {key}={value!r} is no {kind.__name__}")
    a = Answer(**answer)
    if not (is_int(a.seq) and is_int(a.version, 0, version) and is_int(a.staleness)):
        raise _malformed(f"answer of {learner}: seq, version or staleness out of range")
    if a.reason not in {str(r) for r in rules.Reason} or len(a.detail) > 1024:
        raise _malformed(f"answer of {learner}: reason {a.reason!r}")
    if not (0 <= a.weight <= MAX_WEIGHT and 0 < a.discount <= 1):
        raise _malformed(f"answer of {learner}: weight {a.weight}, discount {a.discount}")


def check_state_meta(state: dict[str, Any], delta_ring: int) -> None:
    """An adopted state's metadata, every field of its type and range (rule 2)."""
    if set(state) != STATE_KEYS:
        raise _malformed(f"state keys {sorted(state)}: want {sorted(STATE_KEYS)}")
    version, ring = state["version"], state["ring"]
    if not is_int(version):
        raise _malformed(f"version {version!r}: want 0 to {MAX_VERSION}")
    if state["initialized"] is not True:
        raise _malformed("only a seeded fragment moves")
    if not is_int(state["last_round_size"]):
        raise _malformed(f"last_round_size {state['last_round_size']!r}")
    if not isinstance(ring, list) or len(ring) > min(delta_ring, version):
        raise _malformed(f"delta ring {ring!r}: at most {delta_ring} versions, none past {version}")
    if ring != list(range(version - len(ring) + 1, version + 1)):
        raise _malformed(f"delta ring versions {ring}: want consecutive, ending at {version}")
    contributors, answers, round_ = state["contributors"], state["answers"], state["round"]
    if not isinstance(answers, dict):
        raise _malformed("answers: want an object")
    for learner, answer in answers.items():
        _check_answer(learner, answer, version)
    if (
        not isinstance(contributors, list)
        or len(set(contributors)) != len(contributors)
        or not all(isinstance(c, str) and c in answers for c in contributors)
    ):
        raise _malformed("contributors: want distinct learners, each with an answer")
    if not isinstance(round_, dict) or set(round_) != ROUND_KEYS:
        raise _malformed(f"round: want {sorted(ROUND_KEYS)}")
    total, full = round_["total_weight"], round_["full_weight"]
    if not is_int(round_["count"]) or round_["count"] != len(contributors):
        raise _malformed(f"round count {round_['count']!r}: want {len(contributors)}")
    numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in (total, full))
    if not (numbers and 0 <= total <= full <= FLOAT32_MAX):
        raise _malformed(
            f"open round weights {round_}: want 0 <= total <= full <= {FLOAT32_MAX:g} (float32)"
        )


def check_state_arrays(
    state: dict[str, Any], arrays: dict[str, np.ndarray], template: Fragment
) -> None:
    """An adopted state's arrays: exactly the template's keys, dtypes and shapes (the
    round accumulator empty exactly when the round is), values finite (rule 2)."""
    _, want = template.state()
    ring = [f"ring.{i}" for i in range(len(state["ring"]))]
    expected = set(want) | set(ring)
    if set(arrays) != expected:
        raise _malformed(f"arrays {sorted(arrays)}: want {sorted(expected)}")
    size = template.size
    for key, array in arrays.items():
        dtype: np.dtype[Any]
        if key in ring:
            dtype, shape = np.dtype(np.uint8), (array.size,)
        elif key == "round.acc":
            dtype, shape = np.dtype(np.float32), ((size,) if state["round"]["count"] else (0,))
        else:
            dtype, shape = want[key].dtype, want[key].shape
        if array.dtype != dtype or array.shape != shape:
            raise _malformed(f"{key}: {array.dtype}{array.shape}, want {dtype}{shape}")
        if array.dtype.kind == "f":
            problem = values_problem(key, array)
            if problem is not None:
                raise _malformed(problem)


def values_problem(key: str, array: np.ndarray) -> str | None:
    """Why an adopted float array could not be merged with as a push's values are (rule
    2), or None: finite, and for the fragment's weights (params, the published copy,
    momentum) within ±MAX_ABS_VALUE, as an Init's values and a push's outer gradients
    must be, so their squares sum in float32 without overflow."""
    if not np.isfinite(array).all():
        return f"{key}: values that are not finite"
    if VALUE_ARRAYS.fullmatch(key) and array.size:
        peak = float(np.abs(array).max())
        if peak > MAX_ABS_VALUE:
            return f"{key}: a value of {peak:g}, beyond ±{MAX_ABS_VALUE:g} (diverged)"
    return None


class MoveCalls(ShardState):
    """The five move calls over the shard's state (docs/resharding.md): Freeze, Unfreeze,
    Export and Commit on the source, Adopt on the target; each checked by the rules above
    before anything is logged, and answered the same way when repeated."""

    def _check_move(self, p: int, new: FragmentMap, *, next_map: bool = True) -> None:
        """`new` is a valid map moving p (and, with `next_map`, the next version after
        this shard's): the rules above (1), before anything is logged."""
        if self.plan is None:
            raise ShardError(Why.OUT_OF_STEP, "this shard has no plan yet")
        check_map(new, p, self.plan.num_fragments)
        if next_map:
            check_next_map(self.fragment_map, p, new, self.cfg.shard_index, self.fragments)

    def freeze(self, p: int, new: FragmentMap) -> None:
        """Step 1 of moving fragment p away: from the durable FREEZE on, its pushes wait and
        its rounds stay as they are. Again with the same map: nothing more."""
        self._require_ready()
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            if _same_move(self.frozen.get(p), p, new):
                return
            if p in self.frozen:
                raise ShardError(
                    Why.OUT_OF_STEP,
                    f"fragment {p} is already moving under map version {self.frozen[p].version}",
                )
            self._check_move(p, new)
            if new.owner(p) == self.cfg.shard_index:
                raise ShardError(Why.MALFORMED, f"map version {new.version} keeps {p} here")
            record = log_record(LOG_FREEZE, {"fragment": p, "map": new.to_json()})
            lsn = self._write([record])
            self._sync(lsn)
            self.frozen[p] = new
            self.freeze_lsns[p] = lsn
            self.frozen_since[p] = self.clock()

    def unfreeze(self, p: int) -> None:
        """Aborts a move that never reached its target: p takes pushes again."""
        self._require_ready()
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            if p not in self.frozen:
                return
            self._sync(self._write([log_record(LOG_UNFREEZE, {"fragment": p})]))
            del self.frozen[p]
            self.freeze_lsns.pop(p, None)
            self.exported.discard(p)
            self._thawed(p)

    def export(self, p: int) -> tuple[dict[str, Any], bytes]:
        """Step 2's source half: frozen fragment p's whole state, as an ADOPT payload,
        with this shard's freeze record (the move id its target logs too)."""
        self._require_ready()
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            moving = self.frozen.get(p)
            if moving is None:
                raise ShardError(Why.OUT_OF_STEP, f"fragment {p} is not frozen for a move")
            fmeta, arrays = frag.state()
            freeze = {"source": self.cfg.shard_index, "lsn": self.freeze_lsns[p]}
            self.exported.add(p)
            buf = io.BytesIO()
            # read under the lock: a frozen fragment does not change (numpy types **arrays as
            # if a key could be its allow_pickle flag)
            np.savez(buf, **arrays)  # type: ignore[arg-type]
        assert self.plan is not None
        meta = {
            "fragment": p,
            "map": moving.to_json(),
            "plan": self.plan.to_json(),
            "state": fmeta,
            "freeze": freeze,
        }
        payload = buf.getvalue()
        self.metrics.moved_bytes.labels("out").inc(len(payload))
        return meta, payload

    def adopt(self, meta: dict[str, Any], payload: bytes) -> None:
        """Step 2's target half: fragment p's state from its old owner, durable before p
        is served here. Again once adopted: nothing more."""
        self._require_ready()
        p, new, checked = self._checked_state(meta, payload)
        with self.init_lock:
            if self.fragment_map is not None and p in self.fragments:
                if _same_move(self.fragment_map, p, new):
                    return  # adopted already (a retried step 2)
            if new.owner(p) != self.cfg.shard_index:
                raise ShardError(
                    Why.MALFORMED,
                    f"map version {new.version} gives fragment {p} to shard {new.owner(p)}",
                )
            if self.plan is not None and self.plan.to_json() != meta["plan"]:
                raise ShardError(Why.OUT_OF_STEP, "the fragment comes with another plan")
            check_next_map(self.fragment_map, p, new, self.cfg.shard_index, self.fragments)
            self._sync(self._write([log_record(LOG_ADOPT, meta, payload)]))
            self._install(meta, payload, checked)
            self.metrics.moves.labels("in").inc()
            self.metrics.moved_bytes.labels("in").inc(len(payload))
            with self.lock:
                self._version_changed()

    def _checked_state(self, meta: Any, payload: bytes) -> tuple[int, FragmentMap, Fragment]:
        """(fragment, map, the fragment restored) of an Adopt, once it passes every check
        of the rules above and its whole state restores into a fragment with valid delta
        frames: a record logged must be one replay can apply. Anything else is refused
        (MALFORMED, or OUT_OF_STEP for a call out of step) and changes nothing."""
        try:
            check_adopt_meta(meta)
            p, new = int(meta["fragment"]), FragmentMap.from_json(meta["map"])
            plan = FragmentPlan.from_json(str(meta["plan"]))
            if self.plan is not None and plan.fingerprint != self.plan.fingerprint:
                raise ValueError("the fragment comes with another plan than this shard's")
            check_map(new, p, plan.num_fragments)
            check_freeze_record(meta.get("freeze"), self.cfg.shard_index, new, p)
            check_state_meta(meta["state"], self.cfg.delta_ring)
            template = self._new_fragment(plan, p)
            template.initialize(np.zeros(template.size, np.float32))
            with np.load(io.BytesIO(payload), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            check_state_arrays(meta["state"], arrays, template)
            trial = self._new_fragment(plan, p)
            trial.restore(meta["state"], arrays, self.clock())
            for _, frame in trial.ring:
                codec.read_codes(frame, codec=trial.publish_codec, num_values=trial.size)
        except ShardError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is refused
            raise ShardError(Why.MALFORMED, f"fragment state: {type(e).__name__}: {e}") from None
        return p, new, trial

    def commit_move(self, p: int, new: FragmentMap) -> None:
        """Step 3: fragment p's target holds it; this shard forgets it and names the owner."""
        self._require_ready()
        self._check_move(p, new, next_map=False)
        held = self.fragment_map
        if held is not None and p not in self.fragments and _same_move(held, p, new):
            return  # committed already
        frag = self._fragment(p)
        with self._lock_of(p, frag):
            frozen = self.frozen.get(p)
            if frozen is None or not _same_move(frozen, p, new):
                raise ShardError(
                    Why.OUT_OF_STEP,
                    f"fragment {p} is not frozen for map version {new.version}",
                )
            if p not in self.exported:  # its target cannot hold a state never handed out
                raise ShardError(
                    Why.OUT_OF_STEP,
                    f"fragment {p} was not exported since it froze (or since this shard "
                    f"restarted): export it and adopt it on shard {frozen.owner(p)} first",
                )
            record = log_record(LOG_MOVED, {"fragment": p, "map": frozen.to_json()})
            self._sync(self._write([record]))
            self._moved_away(p, frozen)
            self._thawed(p)
            self.metrics.moves.labels("out").inc()
        with self.lock:
            self._version_changed()
