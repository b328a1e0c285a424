"""A shard's recovery and snapshots: the newest snapshot loaded and the log replayed
after it, through the same `_apply` a live call's record takes; snapshots written by a
thread of their own while pushes go on."""

from __future__ import annotations

import pathlib
import threading
from typing import Any

import numpy as np

from atoll.server import log_damage, parts, storage
from atoll.server.fragment import Answer, Fragment
from atoll.server.log_records import (
    LOG_ADOPT,
    LOG_ASSEMBLED,
    LOG_CLOSE,
    LOG_FREEZE,
    LOG_INIT,
    LOG_INIT_PART,
    LOG_MOVED,
    LOG_PART,
    LOG_PARTS_DROPPED,
    LOG_PLAN,
    LOG_PUSH,
    LOG_UNFREEZE,
    parse_log_record,
)
from atoll.server.refusal import ShardError
from atoll.server.seed_parts import SeedPart
from atoll.server.snapshots import Snapshot
from atoll.server.state import (
    MAX_ABS_VALUE,
    RecoveryError,
    RecoveryStopped,
    ShardState,
    _magnitude_problem,
    log,
)
from atoll.wire import codec
from atoll.wire.plan import FragmentMap, FragmentPlan


class Recovery(ShardState):
    """Recovery and snapshots over the shard's state."""

    def recover(self, stop: threading.Event | None = None) -> int:
        """Loads the newest snapshot and replays the log after it; returns records replayed.

        A replay can take as long as the log is: once `stop` is set (a SIGTERM) it ends
        between two records with RecoveryStopped, the shard as before recovery (not ready,
        so no final snapshot of half a replay) and its files untouched.

        Every record was checked before it was logged, so every record applies. If one
        does not (a log from an older build, a disk error), recovery stops and raises
        RecoveryError naming it, leaving the files untouched; with
        `cfg.quarantine_records` holding its LSN, the record is copied to
        `quarantine/<lsn>.record` in the data directory and replay starts over without
        it: an operator's decision, since that record may be an acknowledged push."""
        with self.lock:
            try:
                replayed = self._replay(set(self.cfg.quarantine_records), stop)
            except RecoveryError as e:
                self._reset()  # half a replay is no state to serve from
                self.recovery_error = str(e)
                raise
            except RecoveryStopped:
                self._reset()
                raise
            now = self.clock()
            for frag in self.fragments.values():
                # round timing is not durable: the open round's clock restarts now
                frag.round_state = frag.restamp(frag.contributors, now)
                # learners known before the restart get a fresh lease, so the first
                # one back does not find itself alone and close a round below quorum
                for learner in frag.answers:
                    self.last_seen[learner] = now
                # held parts wait for the rest of their push from now (not durable either)
                for learner, held in frag.part_sets.items():
                    held.started = now
                    self.last_seen[learner] = now
            # leases were written directly above: what the rounds read of them, derived again
            self.roster.rebuild(now, {p: f.contributors for p, f in self.fragments.items()})
            self.ready = True
            return replayed

    def _replay(self, skip: set[int], stop: threading.Event | None = None) -> int:
        try:
            snap = self.snapshots.latest()
        except storage.SnapshotCorruption as e:
            if self.wal.first_lsn > 1:  # the log no longer reaches back to the start
                raise RecoveryError(
                    f"{e}; the log starts at LSN {self.wal.first_lsn}, so the shard serves "
                    "nothing until a snapshot is restored from a backup or replica"
                ) from e
            log.warning("%s; the log holds every record, so it is replayed from the start", e)
            snap = None
        except storage.StorageError as e:  # a snapshot of another format
            raise RecoveryError(f"{e}; the shard serves nothing until it can load it") from e
        if isinstance(self.wal, log_damage.DamagedLog):
            self._damaged_log(self.wal, snap)
        if snap is not None:
            try:
                self._restore(snap)
            except ValueError as e:  # written under settings this shard does not have
                raise RecoveryError(
                    f"the snapshot in {self.cfg.data_dir} cannot be loaded: {e}"
                ) from e
        try:
            return self._replay_log(skip, stop)
        except storage.StorageError as e:  # records missing, or changed on disk since open
            raise RecoveryError(f"{e}{self._set_aside_snapshots()}") from e

    def _replay_log(self, skip: set[int], stop: threading.Event | None) -> int:
        replayed = 0
        for lsn, record in self.wal.replay(self.last_lsn):
            if stop is not None and stop.is_set():
                raise RecoveryStopped(f"stopped after replaying {replayed} log records")
            if lsn in skip:
                self._quarantine(lsn, record)
            else:
                try:
                    self._apply(record, live=False, lsn=lsn)
                except Exception as e:  # noqa: BLE001 - any failure here must stop and say which record
                    raise RecoveryError(
                        f"log record {lsn} in {self.cfg.data_dir} cannot be applied ({type(e).__name__}: {e}); "
                        f"the shard serves nothing until it can. Keep the data directory as it is, then "
                        f"restart with --quarantine-record {lsn} to set that record aside (copied to "
                        f"quarantine/{lsn}.record; if it was an acknowledged push, that push is lost) "
                        f"and replay the rest"
                    ) from e
            self.last_lsn = lsn
            replayed += 1
        for frag in self.fragments.values():
            self.known.update(frag.answers)
        return replayed

    def _set_aside_snapshots(self) -> str:
        """What a recovery error adds about snapshots found damaged and set aside."""
        folder = pathlib.Path(self.cfg.data_dir) / "snapshots"
        damaged = sorted(p.name for p in folder.glob("*.snap.damaged"))
        if not damaged:
            return ""
        return (
            f"; snapshots set aside as damaged: {', '.join(damaged)} in {folder}: the log no "
            "longer reaches back to an older one; restore them from a backup or replica"
        )

    @staticmethod
    def _holds_through(snap: Snapshot | None) -> int:
        """The LSN through which `snap` holds every record of every fragment: its own, if
        it captured them all at that one LSN (as a clean stop's does), else 0."""
        if snap is None:
            return 0
        lsns = [int(v) for v in snap.meta.get("fragment_lsns", {}).values()]
        return snap.lsn if all(v == snap.lsn for v in lsns) else 0

    def _damaged_log(self, wal: log_damage.DamagedLog, snap: Snapshot | None) -> None:
        """A log damaged at start-up: set aside with --truncate-damaged-log where the
        newest snapshot holds every record of it, else a RecoveryError saying where the
        damage is and what the log alone holds."""
        damage, covered = wal.error, self._holds_through(snap)
        where = f"damaged write-ahead log: {damage.path} at byte {damage.offset}: {damage}"
        if self.cfg.truncate_damaged_log:
            try:
                log_damage.set_aside_damaged(damage, covered)
            except storage.StorageError as e:
                raise RecoveryError(f"{where}; --truncate-damaged-log refused: {e}") from e
            wal.close()
            self.wal = storage.WriteAheadLog(wal.directory)
            return
        if (
            covered
            and not log_damage.records_after(wal.directory, covered)
            and damage.lsn <= covered
        ):
            hint = (
                f"the newest snapshot (LSN {covered}) holds every record of the log: restart "
                "with --truncate-damaged-log to set the log aside and go on from it; nothing "
                "acknowledged is lost"
            )
        else:
            hint = (
                f"records past LSN {covered} are only in the log and any may have been "
                "acknowledged, so --truncate-damaged-log will not drop them: restore the data "
                "directory from a backup or replica"
            )
        raise RecoveryError(f"{where}; the shard serves nothing until it can. {hint}")

    def _quarantine(self, lsn: int, record: bytes) -> None:
        folder = pathlib.Path(self.cfg.data_dir) / "quarantine"
        folder.mkdir(exist_ok=True)
        (folder / f"{lsn}.record").write_bytes(record)
        log.warning(
            "log record %d set aside in %s as --quarantine-record asked; replay goes on without it",
            lsn,
            folder,
        )

    def _apply(self, record: bytes, live: bool, lsn: int = 0) -> None:
        """Applies one log record; the same code runs live and during replay. A record of
        a fragment that the snapshot already holds (its LSN at or before that fragment's
        in the snapshot) is skipped."""
        kind, meta, payload = parse_log_record(record)
        if "fragment" in meta and lsn <= self.snapshot_lsns.get(meta["fragment"], 0):
            return
        if kind == LOG_PLAN:  # with the map of the first Init (older records: p mod S)
            saved = meta.get("map")
            self._adopt_plan(
                FragmentPlan.from_json(meta["plan"]),
                FragmentMap.from_json(saved) if saved is not None else None,
            )
        elif kind == LOG_INIT:
            frag = self.fragments[meta["fragment"]]
            codes = self._checked(codec.read_codes(payload, num_values=frag.size), frag, live)
            values = np.empty(frag.size, np.float32)
            codes.decode_into(values, accumulate=False)
            frag.initialize(values)
            self.seeds.drop(meta["fragment"])
        elif kind == LOG_INIT_PART:  # values as float32, judged before they were logged
            boxes = tuple(parts.Box.from_json(b) for b in meta["boxes"])
            part = SeedPart(
                meta["run"],
                meta["part"],
                meta["parts"],
                boxes,
                np.frombuffer(payload, np.float32).copy(),
            )
            self.seeds.hold(meta["fragment"], part)
        elif kind == LOG_PUSH:
            frag = self.fragments[meta["fragment"]]
            codes = self._checked(codec.read_codes(payload, num_values=frag.size), frag, live)
            frag.contribute(meta["learner"], codes, Answer(**meta["answer"]), self.clock())
        elif kind == LOG_PART:
            frag = self.fragments[meta["fragment"]]
            boxes = tuple(parts.Box.from_json(b) for b in meta["boxes"])
            n = sum(b.size(frag.shapes[b.tensor]) for b in boxes)
            codes = codec.read_codes(payload, num_values=n)  # finite, or CodecError
            if not live and float(codes.range_max_abs([0], [n]).max(initial=0.0)) > MAX_ABS_VALUE:
                raise ValueError(f"a part with values beyond ±{MAX_ABS_VALUE:g}")
            frag.hold_part(
                meta["learner"],
                meta["seq"],
                meta["header"],
                meta["part"],
                boxes,
                bytes(payload),
                self.clock(),
            )
        elif kind == LOG_ASSEMBLED:
            frag = self.fragments[meta["fragment"]]
            frag.contribute_parts(meta["learner"], Answer(**meta["answer"]), self.clock())
        elif kind == LOG_PARTS_DROPPED:
            self.fragments[meta["fragment"]].drop_parts(meta["learner"])
        elif kind == LOG_CLOSE:
            self.fragments[meta["fragment"]].close_round(meta.get("trigger"))
        elif kind == LOG_FREEZE:
            self.frozen[meta["fragment"]] = FragmentMap.from_json(meta["map"])
            self.freeze_lsns[meta["fragment"]] = lsn
        elif kind == LOG_UNFREEZE:
            self.frozen.pop(meta["fragment"], None)
            self.freeze_lsns.pop(meta["fragment"], None)
        elif kind == LOG_ADOPT:
            self._install(meta, payload)
        elif kind == LOG_MOVED:
            self._moved_away(meta["fragment"], FragmentMap.from_json(meta["map"]))
        else:
            raise RuntimeError(f"unknown log record kind {kind}")

    @staticmethod
    def _checked(codes: codec.Codes, frag: Fragment, live: bool) -> codec.Codes:
        """Codes a replayed record carries pass the checks a live call made before logging
        them: a record this build would have refused (from an older build, say) stops
        recovery instead of merging into the parameters."""
        if not live and (problem := _magnitude_problem(codes, frag.segments)):
            raise ValueError(problem)
        return codes

    def _snapshot(self) -> None:
        """Writes a snapshot while pushes go on.

        Each fragment is captured under its own lock alone, at the log's newest LSN at
        that moment (its state then holds exactly its records up to that LSN); only the
        round accumulator is copied: params, opt state and the published copy are lent
        (`Fragment.lend`) until the snapshot is written, so closes meanwhile make fresh
        ones instead of stepping over them, and ring frames are bytes.
        The records captured are made durable before the snapshot names them; the
        snapshot's LSN is the oldest fragment LSN, and replay skips each fragment's
        records up to its own."""
        with self.snapshot_lock:
            meta: dict[str, Any] = {
                "plan": self.plan.to_json() if self.plan else None,
                "fragment_map": self.fragment_map.to_json() if self.fragment_map else None,
                "frozen": {str(p): m.to_json() for p, m in self.frozen.items()},
                "freeze_lsns": {str(p): lsn for p, lsn in self.freeze_lsns.items()},
                "shard_index": self.cfg.shard_index,
                "num_shards": self.cfg.num_shards,
                "fragments": {},
                "fragment_lsns": {},
            }
            arrays: dict[str, np.ndarray] = {}
            lent: list[int] = []  # fragments whose arrays this snapshot reads unlocked
            try:
                for p in sorted(self.fragments):
                    with self.frag_locks[p]:
                        fmeta, farrays = self.fragments[p].state()
                        fmeta["parts"], parts_arrays = self.fragments[p].parts_state()
                        fmeta["seed_parts"], seed_arrays = self.seeds.state(p)
                        farrays = {**farrays, **parts_arrays, **seed_arrays}
                        meta["fragment_lsns"][str(p)] = self.wal.written_lsn
                        self.fragments[p].lend()
                        lent.append(p)
                    meta["fragments"][str(p)] = fmeta
                    arrays.update({f"f{p}.{k}": v for k, v in farrays.items()})
                # fragments that moved away: their records up to now are history, not state
                if self.fragment_map is not None:
                    for p in range(self.fragment_map.num_fragments):
                        if p not in self.fragments:
                            meta["fragment_lsns"][str(p)] = self.wal.written_lsn
                lsns = list(meta["fragment_lsns"].values()) or [self.wal.written_lsn]
                if max(lsns) > 0:
                    self._sync(max(lsns))
                with self.metrics.snapshot_seconds.time():
                    self.snapshots.save(min(lsns), meta, arrays)
            finally:
                del arrays
                for p in lent:
                    with self.frag_locks[p]:
                        self.fragments[p].give_back()
            self.wal.truncate_through(self.snapshots.truncatable_lsn())

    def _snapshot_in_background(self) -> None:
        try:
            self._snapshot()
        except (OSError, storage.StorageError, ShardError) as e:  # a full disk: one line will do
            log.error(
                "background snapshot failed (%s); the log keeps every record until one succeeds",
                e,
            )
        except Exception:  # noqa: BLE001 - the log still holds everything; the next one tries again
            log.exception(
                "background snapshot failed; the log keeps every record until one succeeds"
            )
        finally:
            with self.lock:
                self._snapshotting = False

    def _restore(self, snap: Snapshot) -> None:
        meta = snap.meta
        # with a fragment map in the snapshot, the map says what this shard owns and
        # --num-shards only set the layout a run starts from: it may have grown since
        laid_out = meta.get("fragment_map") is None and meta["num_shards"] != self.cfg.num_shards
        if meta["shard_index"] != self.cfg.shard_index or laid_out:
            raise RuntimeError(
                f"data dir holds shard {meta['shard_index']} of {meta['num_shards']}, but this is "
                f"shard {self.cfg.shard_index} of {self.cfg.num_shards}; point --data-dir elsewhere"
            )
        if meta["plan"] is not None:
            saved_map = meta.get("fragment_map")  # older snapshots: version 0, p mod S
            self._adopt_plan(
                FragmentPlan.from_json(meta["plan"]),
                FragmentMap.from_json(saved_map) if saved_map else None,
            )
        for key, fmeta in meta["fragments"].items():
            prefix = f"f{key}."
            if int(key) not in self.fragments:  # adopted from another shard
                self._add_fragment(int(key))
            farrays = {k[len(prefix) :]: v for k, v in snap.arrays.items() if k.startswith(prefix)}
            self.fragments[int(key)].restore(fmeta, farrays, self.clock())
            # pushes in parts still missing some (older snapshots: none)
            self.fragments[int(key)].restore_parts(fmeta.get("parts", []), farrays, self.clock())
            self.seeds.restore(int(key), fmeta.get("seed_parts", []), farrays)  # seeds in parts
        for p in [p for p in self.fragments if str(p) not in meta["fragments"]]:
            self._drop_fragment(p)  # moved away before the snapshot
        self.frozen = {int(p): FragmentMap.from_json(m) for p, m in meta.get("frozen", {}).items()}
        # older snapshots kept no freeze LSN: the snapshot's own stands in as the move id
        lsns_of = meta.get("freeze_lsns", {})
        self.freeze_lsns = {p: int(lsns_of.get(str(p), max(snap.lsn, 1))) for p in self.frozen}
        # older snapshots were taken at one LSN for every fragment
        lsns = meta.get("fragment_lsns") or {key: snap.lsn for key in meta["fragments"]}
        self.snapshot_lsns = {int(key): int(lsn) for key, lsn in lsns.items()}
        self.last_lsn = snap.lsn
