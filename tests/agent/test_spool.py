"""The spool on real files: FIFO, durable across restarts, bounded, and honest about loss."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from support.clock import FakeClock

from gpuwatch.agent.spool import Spool, encode
from gpuwatch.errors import ConfigError
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

EPOCH = 1_700_000_000.0


def snapshot(sequence: int, *, padding: int = 0) -> HostSnapshot:
    """A small snapshot; ``padding`` characters of command line make it bigger."""
    gpus = []
    if padding:
        process = GpuProcess(pid=1, command="x" * padding)
        gpus = [Gpu(index=0, uuid="GPU-0", processes=[process])]
    return HostSnapshot(
        agent_id="a", hostname="h", boot_id="b", sequence=sequence, collected_at=EPOCH, gpus=gpus
    )


def sequences(spool: Spool) -> list[int]:
    """The pending sequence numbers, oldest first (peeked and released again)."""
    batch = spool.peek_batch(10_000, 2**30)
    spool.release(batch)
    return [json.loads(r.body)["sequence"] for r in batch]


def size_of(s: HostSnapshot) -> int:
    return len(encode(s))


def test_records_come_back_oldest_first_and_ack_deletes_them(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2**20)
    for i in range(5):
        spool.append(snapshot(i))
    batch = spool.peek_batch(3, 2**20)
    assert [json.loads(r.body)["sequence"] for r in batch] == [0, 1, 2]
    spool.ack(batch)
    assert spool.pending_count() == 2
    assert sequences(spool) == [3, 4]
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert spool.dropped() == {}


def test_body_is_the_snapshot_json(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2**20)
    spool.append(snapshot(7))
    (record,) = spool.peek_batch(1, 2**20)
    assert HostSnapshot.model_validate_json(record.body) == snapshot(7)


def test_a_new_spool_on_the_same_directory_sees_what_was_pending(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=2**20)
    for i in range(4):
        first.append(snapshot(i))
    first.ack(first.peek_batch(1, 2**20))
    second = Spool(tmp_path, max_bytes=2**20)
    assert sequences(second) == [1, 2, 3]
    second.append(snapshot(4))  # numbering continues after the records it found
    assert sequences(second) == [1, 2, 3, 4]


def test_batches_respect_item_and_byte_limits_but_never_come_back_empty(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2**20)
    for i in range(4):
        spool.append(snapshot(i))
    one = size_of(snapshot(0))
    assert len(spool.peek_batch(2, 2**20)) == 2
    assert len(spool.peek_batch(10, 3 * one)) == 3
    assert len(spool.peek_batch(10, 1)) == 1  # an oversized record still goes out alone


def test_past_the_bound_the_oldest_are_dropped_and_counted(tmp_path: Path) -> None:
    one = size_of(snapshot(0, padding=1000))
    spool = Spool(tmp_path, max_bytes=3 * one)
    for i in range(5):
        spool.append(snapshot(i, padding=1000))
    assert sequences(spool) == [2, 3, 4]
    assert spool.dropped() == {"spool_full": 2}
    assert spool.pending_bytes() <= 3 * one
    assert sum(p.stat().st_size for p in tmp_path.glob("*.json")) <= 3 * one


def test_records_in_flight_are_not_evicted_until_released(tmp_path: Path) -> None:
    one = size_of(snapshot(0, padding=1000))
    spool = Spool(tmp_path, max_bytes=2 * one)
    spool.append(snapshot(0, padding=1000))
    spool.append(snapshot(1, padding=1000))
    in_flight = spool.peek_batch(1, 2**20)  # record 0 is being sent
    spool.append(snapshot(2, padding=1000))
    # Evicting 0 now would count as lost a record the server may be storing.
    assert spool.dropped() == {"spool_full": 1}
    assert sequences(spool) == [0, 2]
    spool.release(in_flight)
    spool.append(snapshot(3, padding=1000))
    assert sequences(spool) == [2, 3]
    assert spool.dropped() == {"spool_full": 2}


def test_a_record_larger_than_the_whole_bound_is_dropped_without_evicting_others(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path, max_bytes=size_of(snapshot(0, padding=100)) * 2)
    spool.append(snapshot(0, padding=100))
    spool.append(snapshot(1, padding=4000))
    assert sequences(spool) == [0]
    assert spool.dropped() == {"spool_full": 1}


def test_drop_counts_under_the_given_reason(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2**20)
    spool.append(snapshot(0))
    spool.drop(spool.peek_batch(1, 2**20), "rejected")
    assert spool.pending_count() == 0
    assert spool.dropped() == {"rejected": 1}


def test_a_shrunk_bound_is_enforced_at_start(tmp_path: Path) -> None:
    big = Spool(tmp_path, max_bytes=2**20)
    for i in range(4):
        big.append(snapshot(i, padding=1000))
    small = Spool(tmp_path, max_bytes=size_of(snapshot(0, padding=1000)))
    assert sequences(small) == [3]
    assert small.dropped() == {"spool_full": 3}


def test_a_damaged_record_is_skipped_and_counted_as_corrupt(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2**20)
    for i in range(3):
        spool.append(snapshot(i))
    middle = sorted(tmp_path.glob("*.json"))[1]
    middle.write_bytes(middle.read_bytes()[:20])  # truncated by a failing disk
    assert sequences(Spool(tmp_path, max_bytes=2**20)) == [0, 2]
    reopened = Spool(tmp_path, max_bytes=2**20)
    assert reopened.pending_count() == 2


def test_a_write_cut_short_by_a_crash_is_never_read_and_is_counted(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2**20)
    spool.append(snapshot(0))
    (tmp_path / f"{1:020d}.tmp").write_bytes(b'{"agent_id": "a", "seq')
    reopened = Spool(tmp_path, max_bytes=2**20)
    assert sequences(reopened) == [0]
    assert reopened.dropped() == {"corrupt": 1}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_valid_json_value_that_is_not_an_object_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / f"{0:020d}.json").write_bytes(b"[1, 2]")
    spool = Spool(tmp_path, max_bytes=2**20)
    assert spool.peek_batch(10, 2**20) == []
    assert spool.dropped() == {"corrupt": 1}


def test_foreign_files_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("not a record")
    spool = Spool(tmp_path, max_bytes=2**20)
    assert spool.pending_count() == 0
    assert (tmp_path / "README").exists()


def test_oldest_age_comes_from_the_injected_clock_and_survives_restart(tmp_path: Path) -> None:
    clock = FakeClock(EPOCH)
    spool = Spool(tmp_path, max_bytes=2**20, clock=clock)
    assert spool.oldest_age_seconds() is None
    spool.append(snapshot(0))
    clock.now += 90
    spool.append(snapshot(1))
    clock.now += 30
    assert spool.oldest_age_seconds() == pytest.approx(120)
    assert Spool(tmp_path, max_bytes=2**20, clock=clock).oldest_age_seconds() == pytest.approx(120)


def test_spool_files_are_private(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    Spool(directory, max_bytes=2**20).append(snapshot(0))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (record,) = directory.glob("*.json")
    assert stat.S_IMODE(record.stat().st_mode) == 0o600


def test_an_unusable_directory_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="spool directory"):
        Spool(blocker / "spool", max_bytes=2**20)


def test_a_failed_write_raises_and_leaves_nothing_pending(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=2**20)
    (tmp_path / f"{0:020d}.tmp").mkdir()  # the temp name is taken: open() fails
    with pytest.raises(OSError):
        spool.append(snapshot(0))
    assert spool.pending_count() == 0
    assert not list(tmp_path.glob("*.json"))
