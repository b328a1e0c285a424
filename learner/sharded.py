"""A learner whose params are sharded over several JAX processes (FSDP, tensor parallel,
replicated leaves mixed in): every process syncs its own addressable data (issue 40).

Each process runs a `Synchronizer` of its own over its own connections, with a
`PartSync` per fragment whose vectors are the process's local ones (learner/boxes.py:
the boxes it holds). Process 0 alone runs the schedule; after every step the processes
exchange one small row each (`_Row`: which call, which step, stop and failure, and per
fragment whether to adopt and whether to push, with the push's agreed header fields:
seq, steps, tokens, last, step_seconds) and the others do what process 0 did. Every
row reaches every process, so a process that called another method or is at another
step sees it and every process raises, at the same call.

A push goes out as parts, one per process that sends boxes of the fragment, directly to
the shard that owns it; error feedback stays per element, on the process that sends
it. The last of those processes (the fragment's *closer*) sends its part only once
every other part is held, so its answer is the push's: it waits for the round, brings
its copy of the fragment to the version that round published, and posts that outcome
(refused, stalled, or adopt version v) on the JAX coordination service's key-value
store, where the others read it and bring their copies to the same v.

Interim, until the shard serves pulls by boxes: a process pulls the whole published
fragment (the existing pull) and keeps its boxes of it, so during an adoption one
fragment is decoded on each host. Seeding a fragment nobody has seeded gathers it to
process 0 once (`InitFragment` takes whole fragments only).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from atoll.learner import schedule
from atoll.learner.boxes import FragmentBoxes, ProcessBoxes, process_boxes
from atoll.learner.fragment_sync import FragmentSync, Link, Outcome
from atoll.learner.pytree import ParamsError, TreeLayout
from atoll.learner.routing import SyncError
from atoll.learner.stopping import Stopped
from atoll.learner.sync import Synchronizer
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb

log = logging.getLogger("atoll.learner")

JOIN, STEP, FINISH = 1, 2, 3  # the call a row is exchanged at
_CALLS = {JOIN: "join", STEP: "step", FINISH: "finish"}
_HEAD = 4  # call, step, stopped, failed
_PER_FRAGMENT = 8  # adopt, push, seq, steps, tokens (hi, lo), last, step_seconds (bits)
_POLL_MS = 500  # a wait on the key-value store looks at `stopping` this often


class LearnerDisagreement(ParamsError):
    """The processes of one learner disagree (plan, sharding, call order)."""


def allgather(row: np.ndarray) -> np.ndarray:
    """Every process's int32 `row` (all of one length), as an (n, len) array."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row.astype(np.int32)))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def _describe_sharding(leaf: Any) -> str:
    sharding = leaf.sharding
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is not None:
        return f"mesh {dict(mesh.shape)} spec {spec}"
    return f"{type(sharding).__name__} over {len(sharding.device_set)} devices"


def check_agreement(layout: TreeLayout, leaves: Sequence[Any]) -> None:
    """LearnerDisagreement on every process unless every process joined with the same
    plan (names, shapes, P) and the same sharding of every synced leaf."""
    me = _process_index()
    head = allgather(np.asarray([JOIN, len(layout.synced), _digest(layout.plan.fingerprint)]))
    if (head != head[0]).any():
        j = int(np.nonzero((head != head[0]).any(axis=1))[0][0])
        if (head[:, 0] != JOIN).any():
            raise LearnerDisagreement(
                f"process {me}: the processes of this learner are at different calls "
                f"({_calls(head)}): every process calls join, step and finish alike"
            )
        raise LearnerDisagreement(
            f"process {me}: process {j} of this learner joined with another fragment plan "
            f"than process 0 (plan fingerprint here {layout.plan.fingerprint[:12]}): every "
            "process passes the same tree (names, shapes) and the same fragments"
        )
    descriptions = [_describe_sharding(leaves[i]) for i in layout.synced]
    rows = allgather(np.asarray([_digest(d) for d in descriptions]))
    for k, i in enumerate(layout.synced):
        if (rows[:, k] != rows[0, k]).any():
            raise LearnerDisagreement(
                f"process {me}: leaf {layout.names[i]!r} is sharded differently on the "
                f"processes of this learner (here: {descriptions[k]}): place every leaf "
                "with the same sharding on every process"
            )


def _calls(rows: np.ndarray) -> str:
    return ", ".join(
        f"process {j}: {_CALLS.get(int(r[0]), '?')} at step {int(r[1])}" for j, r in enumerate(rows)
    )


def _process_index() -> int:
    import jax

    return int(jax.process_index())


class Board:
    """The JAX coordination service's key-value store (a private JAX API, the one
    `jax.distributed` itself uses): one process posts a push's outcome, the others
    read it, from their sync threads, without a collective."""

    def __init__(self, prefix: str):
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise SyncError("a learner sharded over processes needs jax.distributed.initialize")
        self.client, self.prefix = client, prefix

    def post(self, key: str, value: dict[str, Any]) -> None:
        self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value))

    def read(self, key: str, stopping: Any, timeout: float | None = None) -> dict[str, Any]:
        """The value posted at `key`, waiting for it (Stopped when `stopping` is set;
        SyncError past `timeout` seconds)."""
        ends = None if timeout is None else time.monotonic() + timeout
        while True:
            if stopping.is_set():
                raise Stopped(f"stopped while waiting for {key}")
            try:
                value = self.client.blocking_key_value_get(f"{self.prefix}/{key}", _POLL_MS)
                return cast(dict[str, Any], json.loads(value))
            except Exception as e:  # the store's timeout is a generic runtime error
                if "DEADLINE" not in str(e).upper() and "TIMEOUT" not in str(e).upper():
                    raise
            if ends is not None and time.monotonic() > ends:
                raise SyncError(f"no {key} after {timeout:.0f} s: another process stopped")


class Roles:
    """Who sends parts of a fragment: `parts[p]` processes, this one as part `part[p]`
    (None: it sends nothing of p), the last of them (`closer[p]`) last."""

    def __init__(self, sent_sizes: np.ndarray, me: int):
        # sent_sizes: (processes, fragments), every process's sent values per fragment
        self.me = me
        self.senders = [
            [j for j in range(sent_sizes.shape[0]) if sent_sizes[j, p] > 0]
            for p in range(sent_sizes.shape[1])
        ]
        for p, senders in enumerate(self.senders):
            assert senders, f"fragment {p}: no process sends it"

    def part(self, p: int) -> int | None:
        senders = self.senders[p]
        return senders.index(self.me) if self.me in senders else None

    def closer(self, p: int) -> int:
        return self.senders[p][-1]


class PartSync(FragmentSync):
    """Fragment p's sync state over this process's boxes: `base`, θ and Δ are local
    vectors; the error feedback covers the boxes it sends."""

    def __init__(self, p: int, frag: FragmentBoxes, link: Link, shared: Shared):
        super().__init__(p, frag.size, link)
        self.frag, self.shared = frag, shared
        self.ef = codec.ErrorFeedback(frag.sent_size, link.cfg.codec)
        self.fields: dict[str, Any] = {}

    # --- the agreed fields of a push: process 0's, recorded; the others', given ---

    def start(
        self,
        pool: concurrent.futures.Executor,
        theta: np.ndarray,
        step: int,
        seq: int,
        tokens_per_step: int,
        last: bool = False,
    ) -> None:
        steps = step - (self.last_sync_step or 0)
        fields = {
            "seq": seq,
            "steps": max(1, steps),
            "tokens": max(1, steps * tokens_per_step),
            "last": bool(last),
            "step_seconds": float(np.float32(self.link.pace.reported_seconds)),
        }
        self.shared.pushed[self.p] = fields
        self.start_agreed(pool, theta, step, fields)

    def start_agreed(
        self,
        pool: concurrent.futures.Executor,
        theta: np.ndarray,
        step: int,
        fields: dict[str, Any],
    ) -> None:
        self.last_sync_step = self.task_step = step
        self.compute = 0.0
        self.task = pool.submit(self.sync_part, theta.copy(), fields)

    def adopt(self, step: int, theta_now: Callable[[], np.ndarray]) -> np.ndarray:
        self.shared.adopted.add(self.p)
        return super().adopt(step, theta_now)

    # --- joining ---

    def join(self) -> tuple[np.ndarray, int]:
        pulled = self.pull(None)
        full = codec.decode(pulled.frames[0][2], num_values=self.link.plan.fragment_sizes[self.p])
        self.base = self.shared.boxes.take(self.p, full)
        self.version = pulled.version
        self.due_at = schedule.due_after(self.link.clock(), pulled.next_due_seconds)
        self.link.versions.note(self.p, self.version)
        return self.base.copy(), pulled.last_seq

    def pull_to(self, version: int) -> None:
        """Brings `base` to exactly `version`: the deltas up to it (interim: each decoded
        whole, this process's boxes kept)."""
        n = self.link.plan.fragment_sizes[self.p]
        while self.version < version:
            pulled = self.pull(self.version)
            if pulled.snapshot:
                if pulled.version != version:
                    raise SyncError(
                        f"fragment {self.p}: the shard has only a snapshot of version "
                        f"{pulled.version}, the processes of this learner agreed on {version}"
                    )
                full = codec.decode(pulled.frames[0][2], num_values=n)
                self.base = self.shared.boxes.take(self.p, full)
                self.version = version
                return
            for v, frame_codec, frame in pulled.frames:
                if v > version:
                    break
                # the same float32 add as decode_into on the whole vector, element by element
                delta = np.zeros(n, np.float32)
                codec.decode_into(frame, delta, 1.0, codec=frame_codec)
                self.base += self.shared.boxes.take(self.p, delta)
                self.version = v
            if self.version < version:
                self.link.versions.wait_for(self.p, version)

    # --- the task ---

    def sync_part(self, theta: np.ndarray, fields: dict[str, Any]) -> Outcome:
        """Push this process's part; the closer judges the round; everyone adopts its
        outcome."""
        link, shared, p = self.link, self.shared, self.p
        key = f"{p}/{fields['seq']}"
        part = shared.roles.part(p)
        if shared.roles.closer(p) == shared.roles.me:
            outcome = self._close(theta, fields, key)
        else:
            if part is not None:
                try:
                    ack = self._push_part(theta, fields, part)
                except BaseException as e:  # the closer must not wait for this part
                    shared.board.post(f"{key}/part{shared.roles.me}", {"error": repr(e)})
                    raise
                shared.board.post(f"{key}/part{shared.roles.me}", {"reason": ack.reason})
            outcome = shared.board.read(f"{key}/outcome", link.router.stopping)
        if outcome["kind"] == "error":
            raise SyncError(f"fragment {p}: {outcome['detail']}")
        if outcome["cadence_seconds"] > 0:
            link.pace.cadence_seconds = outcome["cadence_seconds"]
        due_at = self._due(schedule.due_after(link.clock(), outcome["next_due_seconds"]))
        if outcome["kind"] == "refused":
            self.ef.reset()
            self.pull_to(outcome["version"])
            self.origin = None
            return Outcome(self.version, None, self.base.copy(), due_at)
        if outcome["kind"] == "stalled":
            self.origin = theta
            return Outcome(self.version, np.zeros_like(theta), due_at=due_at)
        self.pull_to(outcome["version"])
        self.origin = None
        return Outcome(self.version, self.base - theta, due_at=due_at)

    def _close(self, theta: np.ndarray, fields: dict[str, Any], key: str) -> dict[str, Any]:
        """The closer: sends its part once every other part is held, judges the push by
        its answer and posts the outcome every process adopts (an error too: nobody
        waits for an outcome that never comes)."""
        shared, p = self.shared, self.p
        try:
            for j in shared.roles.senders[p][:-1]:
                held = shared.board.read(
                    f"{key}/part{j}", self.link.router.stopping, shared.part_wait
                )
                if "error" in held:
                    raise SyncError(f"process {j} failed to push its part: {held['error']}")
            part = shared.roles.part(p)
            assert part is not None  # the closer is a sender
            outcome = self._judge(self._push_part(theta, fields, part))
        except BaseException as e:
            detail = f"the push of seq {fields['seq']} failed on process {shared.roles.me}: {e!r}"
            shared.board.post(f"{key}/outcome", {"kind": "error", "detail": detail})
            raise
        shared.board.post(f"{key}/outcome", outcome)
        return outcome

    def _judge(self, ack: pb.PushResponse) -> dict[str, Any]:
        """The closer: what the push's answer means for every process."""
        link, p = self.link, self.p
        out = {
            "next_due_seconds": ack.next_due_seconds,
            "cadence_seconds": ack.cadence_seconds,
        }
        if ack.reason == pb.PUSH_REASON_PART_HELD:
            # the closer's part did not complete the push (another part was refused
            # without the push being refused, or a part never came): nothing of it merges
            ack = pb.PushResponse(accepted=False, reason=ack.reason, detail="push incomplete")
        if not ack.accepted:
            link.count("refused", 1)
            link.count("resyncs", 1)
            log.info(
                "fragment %d: push refused (%s: %s); resyncing",
                p,
                pb.PushReason.Name(ack.reason),
                ack.detail,
            )
            newest = self.pull(self.version).version
            return {**out, "kind": "refused", "version": newest}
        merged_in = self.version + ack.staleness + 1
        patience = schedule.round_patience(
            link.cfg.patience, link.cfg.period, link.pace.step_seconds
        )
        if not link.versions.wait_for(p, merged_in, patience):
            link.count("stalled", 1)
            log.warning(
                "fragment %d: no version %d after %.0f s; going on without it",
                p,
                merged_in,
                patience,
            )
            return {**out, "kind": "stalled", "version": self.version}
        return {**out, "kind": "adopt", "version": merged_in}

    def _push_part(self, theta: np.ndarray, fields: dict[str, Any], part: int) -> pb.PushResponse:
        link, p = self.link, self.p
        origin = self.base if self.origin is None else self.origin
        frame = self.ef.encode(self.frag.sent(origin) - self.frag.sent(theta))
        header = pb.PushHeader(
            fragment=p,
            base_version=self.version,
            seq=fields["seq"],
            inner_steps=fields["steps"],
            tokens=fields["tokens"],
            codec=cast(pb.Codec, int(link.cfg.codec)),
            num_params=link.plan.fragment_sizes[p],
            plan_fingerprint=link.plan.fingerprint,
            step_seconds=fields["step_seconds"],
            overlap_steps=link.cfg.overlap,
            period_steps=link.cfg.period,
            last=fields["last"],
            parts=len(self.shared.roles.senders[p]),
            part=part,
            boxes=self.frag.wire_boxes(),
        )
        ack = link.router.retry(
            lambda: link.router.client_of(p).push(header, frame), f"push fragment {p}", fragment=p
        )
        link.count("bytes_sent", len(frame))
        link.count("pushes", 1)
        if link.on_push is not None and ack.reason != pb.PUSH_REASON_PART_HELD:
            link.on_push(
                {
                    "fragment": p,
                    "seq": fields["seq"],
                    "shard": link.router.shard_of(p),
                    "accepted": ack.accepted,
                    "reason": pb.PushReason.Name(ack.reason),
                    "base_version": self.version,
                    "merged_in": self.version + ack.staleness + 1 if ack.accepted else None,
                    "steps": fields["steps"],
                    "compute_seconds": 0.0,
                }
            )
        return ack


class Shared:
    """What the PartSyncs of one process share: its boxes, the roles, the board, and
    what process 0's schedule did in the current call (read into the row)."""

    def __init__(self, boxes: ProcessBoxes, roles: Roles, board: Board, part_wait: float):
        self.boxes, self.roles, self.board, self.part_wait = boxes, roles, board, part_wait
        self.pushed: dict[int, dict[str, Any]] = {}
        self.adopted: set[int] = set()

    def clear(self) -> None:
        self.pushed, self.adopted = {}, set()


def encode_row(
    call: int, step: int, stopped: bool, failed: bool, shared: Shared, num_fragments: int
) -> np.ndarray:
    row = np.zeros(_HEAD + _PER_FRAGMENT * num_fragments, np.int32)
    row[:_HEAD] = [call, step, int(stopped), int(failed)]
    for p in range(num_fragments):
        at = _HEAD + _PER_FRAGMENT * p
        row[at] = int(p in shared.adopted)
        fields = shared.pushed.get(p)
        if fields is not None:
            tokens = int(fields["tokens"])
            seconds = np.asarray([fields["step_seconds"]], np.float32).view(np.int32)[0]
            row[at + 1 : at + _PER_FRAGMENT] = [
                1,
                fields["seq"],
                fields["steps"],
                tokens >> 31,
                tokens & 0x7FFFFFFF,
                int(fields["last"]),
                seconds,
            ]
    return row


def decode_row(row: np.ndarray, num_fragments: int) -> tuple[set[int], dict[int, dict[str, Any]]]:
    adopted, pushed = set(), {}
    for p in range(num_fragments):
        at = _HEAD + _PER_FRAGMENT * p
        if row[at]:
            adopted.add(p)
        if row[at + 1]:
            seq, steps, hi, lo, last, seconds = (int(x) for x in row[at + 2 : at + _PER_FRAGMENT])
            pushed[p] = {
                "seq": seq,
                "steps": steps,
                "tokens": (hi << 31) | lo,
                "last": bool(last),
                "step_seconds": float(np.asarray([seconds], np.int32).view(np.float32)[0]),
            }
    return adopted, pushed


def exchange(
    call: int, step: int, stopped: bool, failed: bool, shared: Shared, num_fragments: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every process's row of this call; LearnerDisagreement on every process where they
    are not at the same call and step. Returns (process 0's row, all rows)."""
    rows = allgather(encode_row(call, step, stopped, failed, shared, num_fragments))
    if (rows[:, :2] != rows[0, :2]).any():
        raise LearnerDisagreement(
            f"process {shared.roles.me}: the processes of this learner called it out of "
            f"order ({_calls(rows)}): every process calls join, step and finish alike, "
            "once per inner step"
        )
    return rows[0], rows


def follow(
    sync: Synchronizer,
    row: np.ndarray,
    step: int,
    read: Callable[[int], np.ndarray],
    updates: dict[int, np.ndarray],
) -> None:
    """A process other than 0 does what process 0's row says, fragment by fragment in
    its order (adopt, then push); what it adopts goes into `updates` (local vectors)."""
    adopted, pushed = decode_row(row, sync.plan.num_fragments)
    for frag in sync.frags:
        p = frag.p
        if p in adopted:
            if frag.task is None:
                raise SyncError(
                    f"fragment {p}: process 0 adopted a sync this process never started"
                )
            updates[p] = frag.adopt(step, lambda: updates[p] if p in updates else read(p))
            sync._count("adopted", 1)
        if p in pushed:
            theta = updates[p] if p in updates else read(p)
            sync.seq = max(sync.seq, pushed[p]["seq"])
            sync.pushes_started += 1
            cast(PartSync, frag).start_agreed(sync.pool, theta, step, pushed[p])


class Island:
    """join / step / finish of a learner sharded over several processes, on every one
    of them (learner/api.py calls it where today's path broadcasts from process 0)."""

    def __init__(
        self,
        layout: TreeLayout,
        leaves: Sequence[Any],
        learner_id: str,
        connect: Callable[..., Synchronizer],
        part_wait: float,
    ):
        check_agreement(layout, leaves)
        self.layout, self.me = layout, _process_index()
        self.boxes = process_boxes(leaves, layout.slots)
        nonce = int(np.random.default_rng().integers(1, 2**31 - 1))
        sent = allgather(np.asarray([nonce, *(f.sent_size for f in self.boxes.fragments)]))
        self.roles = Roles(sent[:, 1:], self.me)
        # a nonce of process 0's: two learners of one id in one JAX program never share keys
        board = Board(f"atoll/{learner_id}/{int(sent[0, 0])}")
        self.shared = Shared(self.boxes, self.roles, board, part_wait)
        self.sync = connect(
            fragment_sync=lambda p, size, link: PartSync(
                p, self.boxes.fragments[p], link, self.shared
            ),
            read_fragment=self._read,
        )
        self.error: BaseException | None = None  # a failure here, told to all at the next row

    @property
    def leader(self) -> bool:
        return self.me == 0

    def _read(self, view: Any, p: int) -> np.ndarray:
        return self.boxes.fragments[p].read(view.leaves())

    def write(self, leaves: Sequence[Any], updates: dict[int, np.ndarray]) -> list[Any]:
        return self.boxes.write(leaves, updates)

    def join(self, view: Any) -> dict[int, np.ndarray]:
        """Seeds what nobody has (gathered to process 0, once), joins every fragment on
        every process, and brings them all to the same versions; local vectors."""
        plan = self.sync.plan
        seeded = self.sync.router.check_shards() if self.leader else set()
        flags = allgather(np.asarray([int(p in seeded) for p in range(plan.num_fragments)]))[0]
        for p in range(plan.num_fragments):
            if not flags[p]:
                self._seed(view, p)
        allgather(np.zeros(1))  # process 0 has seeded: nobody else finds a fragment to seed
        vectors = self.sync.join_fragments(view)
        versions = allgather(np.asarray([f.version for f in self.sync.frags]))
        for frag in self.sync.frags:
            target = int(versions[:, frag.p].max())
            if frag.version < target:
                cast(PartSync, frag).pull_to(target)
                vectors[frag.p] = frag.base.copy()
        return dict(enumerate(vectors))

    def _seed(self, view: Any, p: int) -> None:
        from jax.experimental import multihost_utils

        leaves = view.leaves()
        full = np.empty(self.layout.plan.fragment_sizes[p], np.float32)
        for i, start, end in self.layout.slots[p]:
            value = multihost_utils.process_allgather(leaves[i], tiled=True)
            full[start:end] = np.asarray(value, np.float32).reshape(-1)
        if self.leader:
            frame = codec.encode(full, codec.Codec.FP32)
            router = self.sync.router
            router.retry(
                lambda: router.client_of(p).init(self.layout.plan, p, frame, codec.Codec.FP32),
                f"init fragment {p}",
                fragment=p,
            )

    def step(
        self, step: int, view: Any, seconds: float, tokens: int, last: bool, stopped: bool
    ) -> tuple[dict[int, np.ndarray], bool, bool, BaseException | None]:
        """One step's sync on every process: (updates, stopped, pushed, error to raise)."""
        sync, shared = self.sync, self.shared
        shared.clear()
        updates: dict[int, np.ndarray] = {}
        if self.leader and not stopped and self.error is None:
            try:
                updates = sync.after_step(step, view, seconds, tokens, final=last)
            except (Stopped, SyncError) as e:
                self.error = e
                stopped = isinstance(e, Stopped)
        failed = self.error is not None and not isinstance(self.error, Stopped)
        row, rows = exchange(STEP, step, stopped, failed, shared, sync.plan.num_fragments)
        stopped, failed = bool(rows[:, 2].any()), bool(rows[:, 3].any())
        if not self.leader and not (stopped or failed):
            try:
                follow(sync, row, step, lambda p: self._read(view, p), updates)
            except (Stopped, SyncError) as e:
                self.error = e  # raised on every process at the next step
        pushed = bool(row[_HEAD + 1 :: _PER_FRAGMENT].any())
        error = self.error
        if failed and error is None:
            bad = [j for j in range(rows.shape[0]) if rows[j, 3]]
            error = SyncError(f"process {bad[0]} of this learner failed to sync: its log says why")
        return updates, stopped, pushed, error

    def finish(
        self, step: int, view: Any, timeout: float, tokens: int | None
    ) -> dict[int, np.ndarray]:
        """`Synchronizer.finish` in step on every process: process 0 adopts what is done
        and starts the tails, the others follow, until nothing is pending."""
        sync, shared = self.sync, self.shared
        deadline = sync.clock() + timeout
        updates: dict[int, np.ndarray] = {}
        flat_now: dict[int, np.ndarray] = {}
        while True:
            shared.clear()
            pending: list[Any] = []
            if self.leader and not sync.stopping.is_set() and self.error is None:
                try:
                    for frag in sync.frags:
                        if frag.task is not None and frag.task.done():
                            sync._adopt(frag, step, view, flat_now, updates)
                        if (
                            tokens is not None
                            and frag.task is None
                            and step > (frag.last_sync_step or 0)
                        ):
                            sync._start_push(frag, step, view, updates, flat_now, tokens, last=True)
                    pending = [f.task for f in sync.frags if f.task is not None]
                except (Stopped, SyncError) as e:
                    log.info("finish stopped before the last pushes were adopted: %s", e)
                    pending = []
            more = bool(pending) and deadline > sync.clock()
            row, _ = exchange(FINISH, step, more, False, shared, sync.plan.num_fragments)
            if not self.leader and self.error is None:
                try:
                    follow(sync, row, step, lambda p: self._read(view, p), updates)
                except (Stopped, SyncError) as e:
                    log.info("finish stopped before the last pushes were adopted: %s", e)
                    self.error = e
            if not row[2]:
                return updates
            if self.leader:
                concurrent.futures.wait(
                    pending,
                    timeout=max(0.0, deadline - sync.clock()),
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
