"""A learner whose params are sharded over several JAX processes (FSDP, tensor parallel,
replicated leaves mixed in): every process syncs its own addressable data (issue 40).

Each process runs a `Synchronizer` of its own over its own connections, with a
`PartSync` per fragment whose vectors are the process's local ones (learner/boxes.py:
the boxes it holds). Process 0 alone runs the schedule; after every step the processes
exchange one small row each through the JAX coordination service's key-value store
(learner/island_rows.py: which call, which step, stop and failure, and per fragment
whether to adopt and whether to push, with the push's agreed header fields: seq, steps,
tokens, last, step_seconds) and the others do what process 0 did. Processes that
joined with another plan, sharding or settings, or that call another method or are at
another step, each raise LearnerDisagreement at that call.

A push goes out as parts, one per process that sends boxes of the fragment, directly to
the shard that owns it; error feedback stays per element, on the process that sends
it. The last of those processes (the fragment's *closer*) sends its part only once
every other part is held, so its answer is the push's: it waits for the round, brings
its copy of the fragment to the version that round published, and posts that outcome
(refused, stalled, or adopt version v) on the JAX coordination service's key-value
store, where the others read it and bring their copies to the same v.

Every pull is by boxes (proto `PullRequest.boxes`, wire/parts.py): a process joins,
adopts and resyncs from the published values of the boxes it holds only, which
`apply_boxes` rebuilds bit for bit as a whole pull would (a replicated leaf is pulled by
every process holding it; it is pushed once). No process decodes a whole fragment.

A fragment nobody has seeded yet is seeded by parts too: each process that pushes boxes
of it sends their values (FP32) in an `InitFragment` part (proto `InitHeader.parts`,
`part`, `boxes`, and `run_id`, this learner run's own, so parts of two runs never mix);
the shard holds each part durable and seeds the fragment once the parts cover it
(server/seed_parts.py), with the values a whole seed of the same vector gives. No
process gathers a leaf or a fragment, even once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import grpc
import numpy as np

from atoll.learner import schedule
from atoll.learner.boxes import FragmentBoxes, ProcessBoxes, apply_in_place, process_boxes
from atoll.learner.fragment_sync import FragmentSync, Link, Outcome
from atoll.learner.island_rows import (
    FINISH,
    STEP,
    Board,
    LearnerDisagreement,
    Rows,
    allgather,
    any_pushed,
    check_agreement,
    check_cover,
    check_settings,
    decode_row,
    exchange,
    process_index,
)
from atoll.learner.pytree import TreeLayout
from atoll.learner.routing import SyncError
from atoll.learner.stopping import Stopped
from atoll.learner.sync import Synchronizer
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import IncompletePull, Pulled, apply_boxes
from atoll.wire.parts import BoxLayout

log = logging.getLogger("atoll.learner")

__all__ = ["Island", "LearnerDisagreement", "PartSync"]


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
    vectors, pulled by those boxes; the error feedback covers the boxes it sends."""

    def __init__(self, p: int, frag: FragmentBoxes, link: Link, shared: Shared):
        super().__init__(p, frag.size, link)
        self.frag, self.shared = frag, shared
        self.ef = codec.ErrorFeedback(frag.sent_size, link.cfg.codec)
        self.fields: dict[str, Any] = {}
        self.held = frag.wire_boxes(held=True)  # what this process pulls, local vector order
        shapes = [s.spec.shape for s in link.plan.tensors_of(p)]
        self.layout = BoxLayout.of(shapes, self.held)

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
        """`start` with process 0's fields; `theta` is the task's own (it writes
        Θ_new − θ over it): the callers copy a vector adopted in this call."""
        self.last_sync_step = self.task_step = step
        self.compute = 0.0
        self.task = pool.submit(self.sync_part, theta, fields)

    def adopt(self, step: int, add_theta: Callable[[np.ndarray], None]) -> np.ndarray:
        self.shared.adopted.add(self.p)
        return super().adopt(step, add_theta)

    # --- joining ---

    def join(self) -> tuple[np.ndarray, int]:
        pulled = self.pull(None)
        self._apply(pulled, pulled.version)
        self.due_at = schedule.due_after(self.link.clock(), pulled.next_due_seconds)
        self.link.versions.note(self.p, self.version)
        return self.base.copy(), pulled.last_seq

    def pull_to(self, version: int) -> None:
        """Brings `base` to exactly `version`: the deltas up to it, of this process's
        boxes only."""
        while self.version < version:
            self._apply(self.pull(self.version), version)
            if self.version < version:
                self.link.versions.wait_for(self.p, version)

    def pull(self, have: int | None) -> Pulled:
        """The fragment's newest version from `have` (None: a snapshot), this process's
        boxes of it only."""
        link, p = self.link, self.p
        pulled = link.router.retry(
            lambda: link.router.client_of(p).pull(p, have, self.held),
            f"pull fragment {p}",
            fragment=p,
        )
        link.count("bytes_received", sum(len(f) for _, _, f in pulled.frames))
        return pulled

    def _apply(self, pulled: Pulled, version: int) -> None:
        """Takes `base` along a pull by this process's boxes, up to `version` and no
        further: every process of the learner stops at the version they agreed on."""
        if pulled.snapshot:
            if pulled.version != version:
                raise SyncError(
                    f"fragment {self.p}: the shard has only a snapshot of version "
                    f"{pulled.version}, the processes of this learner agreed on {version}"
                )
            self.base = self._values(pulled, None)
            self.version = version
            return
        frames = [f for f in pulled.frames if f[0] <= version]  # in version order
        if frames:
            self._values(dataclasses.replace(pulled, frames=frames), self.base)
            self.version = frames[-1][0]

    def _values(self, pulled: Pulled, held: np.ndarray | None) -> np.ndarray:
        if not self.held:  # nothing of this fragment here (the pull was whole): no values
            return np.zeros(0, np.float32)
        if held is not None and apply_in_place(pulled, self.layout, held):
            return held
        values = apply_boxes(pulled, self.layout, held)
        return values if values.flags.writeable else values.copy()

    def learn_schedule(self, have: int) -> None:
        """`FragmentSync.learn_schedule` by this process's boxes: a round may have closed
        since `have`, and what it pulls is not adopted."""
        link, p = self.link, self.p
        sent = link.clock()
        try:  # one try: on failure the first push goes on step counts (t_p) instead
            pulled = link.router.call_shard(
                lambda: link.router.client_of(p).pull(p, have, self.held)
            )
        except (grpc.RpcError, IncompletePull, Stopped):
            return
        link.count("bytes_received", sum(len(f) for _, _, f in pulled.frames))
        if pulled.next_due_seconds > 0 and self.due_at is None:
            self.due_at = schedule.due_after(sent, pulled.next_due_seconds)

    # --- the task ---

    def sync_part(self, theta: np.ndarray, fields: dict[str, Any]) -> Outcome:
        """Push this process's part; the closer judges the round; everyone adopts its
        outcome. `theta` is the task's own: an adopted outcome's correction is written
        over it."""
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
        # Θ_new − θ written over θ (this task's own): no third vector of the part
        return Outcome(self.version, np.subtract(self.base, theta, out=theta), due_at=due_at)

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
            pulled = self.pull(self.version)
            self._apply(pulled, pulled.version)  # the others pull to where this one is
            return {**out, "kind": "refused", "version": self.version}
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
        # Δ is written where the residual it leaves goes: no vector of Δ's own
        frame = self.ef.encode_written(lambda out: self.frag.sent_difference(origin, theta, out))
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


def follow(
    sync: Synchronizer,
    row: np.ndarray,
    step: int,
    view: Any,
    updates: dict[int, np.ndarray],
) -> None:
    """A process other than 0 does what process 0's row says, fragment by fragment in
    its order (adopt, then push); what it adopts goes into `updates` (local vectors).
    `view`: the caller's params, as `sync.read_fragment` and `sync.add_fragment` read them."""
    adopted, pushed = decode_row(row, sync.plan.num_fragments)
    for frag in sync.frags:
        p = frag.p
        if p in adopted:
            if frag.task is None:
                raise SyncError(
                    f"fragment {p}: process 0 adopted a sync this process never started"
                )
            updates[p] = frag.adopt(step, functools.partial(sync.add_theta, view, p, updates))
            sync._count("adopted", 1)
        if p in pushed:
            theta = sync.theta_to_push(view, p, updates)
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
        self.layout, self.me = layout, process_index()
        self.boxes = process_boxes(leaves, layout.slots)
        nonce = int(np.random.default_rng().integers(1, 2**31 - 1))
        sent = allgather(np.asarray([nonce, *(f.sent_size for f in self.boxes.fragments)]))
        check_cover(sent[:, 1:], layout.plan.fragment_sizes)
        self.roles = Roles(sent[:, 1:], self.me)
        # a nonce of process 0's: two learners of one id in one JAX program never share keys
        board = Board(f"atoll/{learner_id}/{int(sent[0, 0])}")
        self.run_id = f"{learner_id}/{int(sent[0, 0]):08x}"  # names this run's seed parts
        self.shared = Shared(self.boxes, self.roles, board, part_wait)
        self.rows = Rows(board, sent.shape[0], self.me)  # every step's rows, all processes'
        self.sync = connect(
            fragment_sync=lambda p, size, link: PartSync(
                p, self.boxes.fragments[p], link, self.shared
            ),
            read_fragment=self._read,
            add_fragment=self._add,
        )
        check_settings(self.sync.cfg, learner_id)
        self.error: BaseException | None = None  # a failure here, told to all at the next row

    @property
    def leader(self) -> bool:
        return self.me == 0

    def _read(self, view: Any, p: int) -> np.ndarray:
        return self.boxes.fragments[p].read(view.leaves())

    def _add(self, view: Any, p: int, out: np.ndarray) -> None:
        self.boxes.fragments[p].add_to(view.leaves(), out)

    def write(self, leaves: Sequence[Any], updates: dict[int, np.ndarray]) -> list[Any]:
        return self.boxes.write(leaves, updates)

    def join(self, view: Any) -> dict[int, np.ndarray]:
        """Seeds what nobody has (each process its own part), joins every fragment on
        every process by its boxes, and brings them all to the same versions; local
        vectors."""
        plan = self.sync.plan
        seeded = self.sync.router.check_shards() if self.leader else set()
        flags = allgather(np.asarray([int(p in seeded) for p in range(plan.num_fragments)]))[0]
        error: BaseException | None = None
        for p in range(plan.num_fragments):
            if not flags[p] and error is None:
                try:
                    self._seed(view, p)
                except (Stopped, SyncError) as e:
                    error = e  # raised on every process, after they all have sent
        # every part is in (or one failed): the fragments are seeded for everyone
        failed = allgather(np.asarray([int(error is not None)]))[:, 0]
        if error is not None:
            raise error
        if failed.any():
            bad = int(np.argmax(failed))
            raise SyncError(f"process {bad} of this learner failed to seed: its log says why")
        vectors = self.sync.join_fragments(view)
        versions = allgather(np.asarray([f.version for f in self.sync.frags]))
        for frag in self.sync.frags:
            target = int(versions[:, frag.p].max())
            if frag.version < target:
                cast(PartSync, frag).pull_to(target)
                vectors[frag.p] = frag.base.copy()
        return dict(enumerate(vectors))

    def _seed(self, view: Any, p: int) -> None:
        """Seeds fragment p with this learner's values by parts: this process sends the
        boxes it pushes (its `Roles` part), read from its own addressable shards, in one
        `InitFragment` part of the run `run_id`; the shard seeds p once every part is in.
        No process gathers a leaf or the fragment."""
        part = self.roles.part(p)
        if part is None:
            return
        frag = self.boxes.fragments[p]
        values = frag.sent(frag.read(view.leaves()))
        frame = codec.encode(values, codec.Codec.FP32)
        header = pb.InitHeader(
            parts=len(self.roles.senders[p]),
            part=part,
            boxes=frag.wire_boxes(),
            run_id=self.run_id,
        )
        del values
        router = self.sync.router
        answer = router.retry(
            lambda: router.client_of(p).init(
                self.layout.plan, p, frame, codec.Codec.FP32, part=header
            ),
            f"init fragment {p} (part {part})",
            fragment=p,
        )
        self.sync._count("bytes_sent", len(frame))
        if answer.created:
            log.info("seeded fragment %d: its last part, %d, is in", p, part)

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
        row, rows = exchange(
            STEP, step, stopped, failed, shared, sync.plan.num_fragments, self.rows
        )
        stopped, failed = bool(rows[:, 2].any()), bool(rows[:, 3].any())
        if not self.leader and not (stopped or failed):
            try:
                follow(sync, row, step, view, updates)
            except (Stopped, SyncError) as e:
                self.error = e  # raised on every process at the next step
        pushed = any_pushed(row)
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
        while True:
            shared.clear()
            pending: list[Any] = []
            if self.leader and not sync.stopping.is_set() and self.error is None:
                try:
                    for frag in sync.frags:
                        if frag.task is not None and frag.task.done():
                            sync._adopt(frag, step, view, updates)
                        if (
                            tokens is not None
                            and frag.task is None
                            and step > (frag.last_sync_step or 0)
                        ):
                            sync._start_push(frag, step, view, updates, tokens, last=True)
                    pending = [f.task for f in sync.frags if f.task is not None]
                except (Stopped, SyncError) as e:
                    log.info("finish stopped before the last pushes were adopted: %s", e)
                    pending = []
            more = bool(pending) and deadline > sync.clock()
            row, _ = exchange(FINISH, step, more, False, shared, sync.plan.num_fragments, self.rows)
            if not self.leader and self.error is None:
                try:
                    follow(sync, row, step, view, updates)
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
