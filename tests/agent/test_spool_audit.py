"""The spool audit's findings (/tmp/audit/spool): a server whose clock is behind, two
agents on one spool directory, a spool that cannot be written, a disk smaller than the
bound, drop counts across restarts, a 413 limit that grows back.

The reporter talks to a scripted poster (no network), on injected clocks."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from email.message import Message
from email.utils import formatdate
from pathlib import Path

import pytest
from support.clock import FakeClock

from gpuwatch.agent import spool as spool_module
from gpuwatch.agent.exporter import Exporter
from gpuwatch.agent.http_post import Reply
from gpuwatch.agent.reporter import GROW_AFTER_BATCHES, MAX_BATCH_BYTES, Reporter
from gpuwatch.agent.spool import Spool
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.errors import ConfigError
from gpuwatch.settings import AgentSettings, load
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import IngestResponse

EPOCH = 1_700_000_000.0
HOUR = 3600.0


def snapshot(sequence: int, *, at: float | None = None) -> HostSnapshot:
    return HostSnapshot(
        agent_id="agent-1",
        hostname="h",
        boot_id="boot-1",
        sequence=sequence,
        collected_at=EPOCH + sequence if at is None else at,
        gpus=[],
    )


def headers(**fields: str) -> Message:
    message = Message()
    for name, value in fields.items():
        message[name.replace("_", "-")] = value
    return message


def stored(body: bytes) -> Reply:
    n = len(json.loads(body)["snapshots"])
    reply = IngestResponse(accepted=n, duplicate=0, results=["accepted"] * n)
    return Reply(200, headers(), reply.model_dump_json().encode())


def clock_skew(index: int = 0, *, server_now: float | None = None) -> Reply:
    problem = {
        "detail": [
            {
                "type": "clock_skew",
                "loc": ["body", "snapshots", index],
                "msg": "collected 7200 s ahead of the server's clock",
            }
        ]
    }
    extra = {} if server_now is None else {"Date": formatdate(server_now, usegmt=True)}
    return Reply(422, headers(**extra), json.dumps(problem).encode())


class Poster:
    """Answers each POST with ``answer(body)``; keeps what it was sent."""

    def __init__(self, answer: Callable[[bytes], Reply]) -> None:
        self.answer = answer
        self.bodies: list[bytes] = []

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> Reply:
        self.bodies.append(body)
        return self.answer(body)

    def close(self) -> None:
        pass

    def sizes(self) -> list[int]:
        return [len(json.loads(b)["snapshots"]) for b in self.bodies]


def reporter(
    spool_dir: Path, clock: FakeClock, poster: Poster, *, max_bytes: int = 2**20
) -> Reporter:
    settings = load(
        AgentSettings,
        server_url="http://127.0.0.1:9",
        token="t0ken",
        spool_dir=spool_dir,
        spool_max_bytes=max_bytes,
        push_interval_seconds=15.0,
    )
    made = Reporter(settings, clock=clock, rand=lambda: 1.0, wall_clock=lambda: EPOCH + clock.now)
    made._client = poster  # type: ignore[assignment]
    return made


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(0.0)


# --- H1: a server whose clock is behind --------------------------------------------------


def test_a_server_clock_behind_keeps_snapshots_spooled_and_retries(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    behind = True
    poster = Poster(
        lambda body: clock_skew(server_now=EPOCH - 2 * HOUR) if behind else stored(body)
    )
    agent = reporter(tmp_path, clock, poster)
    for sequence in range(5):
        agent.offer(snapshot(sequence))
    with caplog.at_level(logging.ERROR, logger="gpuwatch.agent.reporter"):
        result = agent.drain_once()
    assert result.stopped_by == "clock_skew" and result.retry_in_seconds
    stats = agent.stats()
    assert stats.dropped_total == {} and stats.pending == 5
    assert stats.batches_total == {"clock_skew": 1}
    assert poster.sizes() == [5]  # not split down to single snapshots
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "this host's clock runs ahead or the server's runs behind" in line
    assert "7200 s behind this host's" in line
    # The backoff holds; once the server's clock is right, everything is delivered.
    assert agent.drain_once().stopped_by == "backoff"
    behind = False
    clock.now += result.retry_in_seconds or 0
    assert agent.drain_once().delivered == 5
    assert agent.stats().pending == 0 and agent.stats().dropped_total == {}
    agent.close()


def test_a_snapshot_from_this_agents_own_future_is_still_dropped(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Stamped while this host's clock ran 3 h ahead; the clock is right again now.
    future = EPOCH + 3 * HOUR

    def answer(body: bytes) -> Reply:
        times = [s["collected_at"] for s in json.loads(body)["snapshots"]]
        return clock_skew(times.index(future)) if future in times else stored(body)

    poster = Poster(answer)
    agent = reporter(tmp_path, clock, poster)
    agent.offer(snapshot(0))
    agent.offer(snapshot(1, at=future))
    agent.offer(snapshot(2))
    result = agent.drain_once()
    assert result.stopped_by is None and result.delivered == 2
    assert agent.stats().dropped_total == {"rejected": 1}
    agent.close()


# --- M1: one agent per spool directory ---------------------------------------------------


def test_a_second_agent_on_the_same_spool_directory_is_refused_with_the_first_ones_pid(
    tmp_path: Path,
) -> None:
    held = Spool(tmp_path, max_bytes=2**20)
    code = (
        "import sys; from pathlib import Path\n"
        "from gpuwatch.agent.spool import Spool\n"
        "from gpuwatch.errors import ConfigError\n"
        "try:\n    Spool(Path(sys.argv[1]), max_bytes=1 << 20)\n"
        "except ConfigError as err:\n    print(err); sys.exit(3)\n"
    )
    second = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 3, second.stderr
    assert f"in use by another gpuwatch agent (pid {os.getpid()})" in second.stdout
    held.close()
    # Released: the next agent takes it.
    again = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stdout + again.stderr


# --- M2: a spool that cannot be written -------------------------------------------------


def test_a_removed_spool_directory_is_created_again(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory, max_bytes=2**20)
    spool.append(snapshot(0))
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    spool.append(snapshot(1))
    batch = spool.peek_batch(10, 2**20)
    assert [HostSnapshot.model_validate_json(r.body).sequence for r in batch] == [1]
    assert spool.dropped() == {"corrupt": 1}  # the record removed with the directory
    assert (directory / spool_module.LOCK_NAME).read_text().strip() == str(os.getpid())
    spool.close()


def refuse_writes(monkeypatch: pytest.MonkeyPatch, error: int) -> Callable[[bool], None]:
    """Make the spool's writes fail with ``error`` while switched on."""
    real = Spool._write
    state = {"on": False}

    def write(self: Spool, record_id: int, body: bytes, enqueued_at: float) -> None:
        if state["on"]:
            raise OSError(error, os.strerror(error))
        real(self, record_id, body, enqueued_at)

    monkeypatch.setattr(Spool, "_write", write)
    return lambda on: state.update(on=on)


def test_an_unwritable_spool_sends_from_memory_while_the_server_is_up(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = refuse_writes(monkeypatch, errno.EROFS)
    poster = Poster(stored)
    agent = reporter(tmp_path, clock, poster)
    agent.offer(snapshot(0))  # spooled
    switch(True)
    agent.offer(snapshot(1))
    agent.offer(snapshot(2))
    assert agent.spool_problem() is not None and "Read-only" in (agent.spool_problem() or "")
    assert agent.drain_once().delivered == 3
    stats = agent.stats()
    assert stats.dropped_total == {} and stats.pending == 0
    assert stats.pushed_total == {"accepted": 3, "duplicate": 0}
    sent = [s["sequence"] for b in poster.bodies for s in json.loads(b)["snapshots"]]
    assert sent == [0, 1, 2]  # the spool first, then memory: in order
    switch(False)
    agent.offer(snapshot(3))
    assert agent.spool_problem() is None
    agent.close()


def test_memory_is_bounded_and_its_overflow_counted(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = refuse_writes(monkeypatch, errno.EROFS)
    monkeypatch.setattr("gpuwatch.agent.reporter.MEMORY_QUEUE_SNAPSHOTS", 4)
    agent = reporter(tmp_path, clock, Poster(stored))
    switch(True)
    for sequence in range(10):
        agent.offer(snapshot(sequence))
    stats = agent.stats()
    assert stats.dropped_total == {"write_failed": 6} and stats.pending == 4
    # Once the spool writes again, what waited in memory goes into it first, in order.
    switch(False)
    agent.offer(snapshot(10))
    batch = Spool(tmp_path, max_bytes=2**20).peek_batch(100, 2**20)
    assert [HostSnapshot.model_validate_json(r.body).sequence for r in batch] == [6, 7, 8, 9, 10]
    agent.close()


def test_healthz_says_degraded_while_the_spool_fails() -> None:
    state = AgentState()
    state.record_poll(snapshot(0, at=EPOCH))
    problem: list[str | None] = ["the spool cannot be written (read-only)"]
    exporter = Exporter(
        ("127.0.0.1", 0),
        render_metrics=lambda accept: (b"", "text/plain"),
        state=state,
        torch_reports=TorchReports(),
        poll_interval_seconds=5.0,
        clock=lambda: EPOCH,
        spool_problem=lambda: problem[0],
    )
    exporter.start()
    try:
        with urllib.request.urlopen(f"{exporter.url}/healthz", timeout=10) as response:
            assert response.status == 200
            assert response.read().startswith(b"degraded: the spool cannot be written")
        problem[0] = None
        with urllib.request.urlopen(f"{exporter.url}/healthz", timeout=10) as response:
            assert response.read() == b"ok\n"
    finally:
        exporter.stop()


# --- M3: a disk smaller than the bound ----------------------------------------------------


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_evicts_the_oldest_and_keeps_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    real = Spool._write
    room = 3  # records the "disk" holds, far below max_bytes

    def write(self: Spool, record_id: int, body: bytes, enqueued_at: float) -> None:
        if len(list(tmp_path.glob("*.json"))) >= room:
            raise OSError(error, os.strerror(error))
        real(self, record_id, body, enqueued_at)

    monkeypatch.setattr(Spool, "_write", write)
    spool = Spool(tmp_path, max_bytes=2**30)
    for sequence in range(8):
        spool.append(snapshot(sequence))
    batch = spool.peek_batch(100, 2**30)
    assert [HostSnapshot.model_validate_json(r.body).sequence for r in batch] == [5, 6, 7]
    assert spool.dropped() == {"spool_full": 5}
    spool.close()


def test_a_full_disk_never_evicts_records_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse = refuse_writes(monkeypatch, errno.ENOSPC)
    spool = Spool(tmp_path, max_bytes=2**30)
    spool.append(snapshot(0))
    in_flight = spool.peek_batch(1, 2**30)
    refuse(True)
    with pytest.raises(OSError):
        spool.append(snapshot(1))
    assert spool.dropped() == {} and spool.pending_count() == 1
    spool.ack(in_flight)
    spool.close()


# --- M4: drop counts across restarts ----------------------------------------------------


def test_drops_of_an_earlier_run_reach_the_server(tmp_path: Path, clock: FakeClock) -> None:
    poster = Poster(stored)
    # The first run, while the server is away: 4 evicted as spool_full.
    first = Spool(tmp_path, max_bytes=len(spool_module.encode(snapshot(0))) * 2)
    for sequence in range(6):
        first.append(snapshot(sequence))
    assert first.dropped() == {"spool_full": 4}
    first.close()  # restarted before the server came back

    second = reporter(tmp_path, clock, poster)
    second.offer(snapshot(6))
    assert second.drain_once().delivered == 3
    # This run's counters start at 0, as Prometheus counters do; the server hears 4.
    assert second.stats().dropped_total == {}
    assert {json.loads(b)["spool_dropped_total"] for b in poster.bodies} == {4}
    second.close()
    assert Spool(tmp_path, max_bytes=2**20).dropped_ever() == 4


# --- L1: a 413 limit grows back -----------------------------------------------------------


def test_a_batch_limit_learnt_from_a_413_grows_back(tmp_path: Path, clock: FakeClock) -> None:
    limit = [1500]

    def answer(body: bytes) -> Reply:
        return Reply(413, headers(), b"{}") if len(body) > limit[0] else stored(body)

    poster = Poster(answer)
    agent = reporter(tmp_path, clock, poster)
    for sequence in range(8):
        agent.offer(snapshot(sequence))
    agent.drain_once()
    shrunk = agent._max_batch_bytes
    assert shrunk < MAX_BATCH_BYTES
    limit[0] = 10**9  # the proxy is fixed
    for sequence in range(8, 8 + GROW_AFTER_BATCHES * 2):
        agent.offer(snapshot(sequence))
        agent.drain_once()
    assert agent._max_batch_bytes >= shrunk * 4
    agent.close()


def test_spool_refuses_a_file_in_place_of_the_lock(tmp_path: Path) -> None:
    (tmp_path / spool_module.LOCK_NAME).mkdir()
    with pytest.raises(ConfigError, match="spool directory"):
        Spool(tmp_path, max_bytes=2**20)
