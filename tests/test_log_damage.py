"""server/log_damage.py: a damaged log opens as a DamagedLog that says where, and is set
aside only where a snapshot holds every record of it."""

from __future__ import annotations

import pytest

from atoll.server import log_damage, storage
from atoll.server.storage import WALCorruption, WriteAheadLog


def _log_of(directory, n: int, size: int = 100) -> list[int]:
    """Writes records 1..n; returns each one's frame offset."""
    offsets = []
    with WriteAheadLog(directory) as wal:
        for i in range(1, n + 1):
            offsets.append(wal.directory.joinpath(f"{1:020d}.wal").stat().st_size)
            wal.append(bytes([i]) * size)
    return offsets


def _flip(directory, offset: int) -> None:
    path = directory / f"{1:020d}.wal"
    raw = bytearray(path.read_bytes())
    raw[offset + storage._FRAME.size + 10] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_damaged_log_opens_as_a_damaged_log_naming_file_offset_and_lsn(tmp_path):
    wal_dir = tmp_path / "wal"
    offsets = _log_of(wal_dir, 5)
    _flip(wal_dir, offsets[2])
    damaged = log_damage.open_log(wal_dir)
    assert isinstance(damaged, log_damage.DamagedLog)
    error = damaged.error
    assert (error.path.name, error.offset, error.lsn) == (f"{1:020d}.wal", offsets[2], 3)
    for call in (lambda: damaged.replay(0), lambda: damaged.append(b"x"), lambda: damaged.sync(1)):
        with pytest.raises(WALCorruption, match="at byte"):
            call()
    with pytest.raises(storage.StorageError, match="already open"):  # it holds the lock
        WriteAheadLog(wal_dir)
    damaged.close()
    with pytest.raises(WALCorruption):  # and changed nothing
        WriteAheadLog(wal_dir)


@pytest.mark.parametrize("covered", [0, 2, 4])
def test_a_damaged_log_with_records_past_the_snapshot_is_never_set_aside(tmp_path, covered):
    wal_dir = tmp_path / "wal"
    offsets = _log_of(wal_dir, 5)
    _flip(wal_dir, offsets[2])
    damaged = log_damage.open_log(wal_dir)
    assert isinstance(damaged, log_damage.DamagedLog)
    before = sorted(p.name for p in wal_dir.iterdir())
    with pytest.raises(storage.StorageError, match="any may have been acknowledged"):
        log_damage.set_aside_damaged(damaged.error, covered)
    assert sorted(p.name for p in wal_dir.iterdir()) == before


def test_a_damaged_log_a_snapshot_holds_is_set_aside_and_goes_on_after_it(tmp_path):
    wal_dir = tmp_path / "wal"
    offsets = _log_of(wal_dir, 5)
    _flip(wal_dir, offsets[1])
    damaged = log_damage.open_log(wal_dir)
    assert isinstance(damaged, log_damage.DamagedLog)
    damaged.close()
    moved = log_damage.set_aside_damaged(damaged.error, 5)
    assert [p.name for p in moved] == [f"{1:020d}.wal"]
    assert (wal_dir / f"{1:020d}.wal.damaged").exists()
    with WriteAheadLog(wal_dir) as wal:
        assert (wal.first_lsn, wal.last_lsn) == (6, 5)
        assert list(wal.replay(5)) == []
        assert wal.append(b"next") == 6
    with WriteAheadLog(wal_dir) as wal:
        assert list(wal.replay(5)) == [(6, b"next")]


def test_the_flag_round_trips_through_the_config(tmp_path):
    import argparse
    import dataclasses

    from atoll.server import main as syncer_main
    from atoll.server.config import ShardConfig

    cfg = ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path, truncate_damaged_log=True)
    assert "--truncate-damaged-log" in cfg.to_args()
    parser = argparse.ArgumentParser()
    syncer_main.add_arguments(parser)
    back = syncer_main.config_from_args(parser.parse_args(cfg.to_args()))
    assert dataclasses.asdict(back) == dataclasses.asdict(cfg)
    assert (
        "--truncate-damaged-log"
        not in dataclasses.replace(cfg, truncate_damaged_log=False).to_args()
    )
