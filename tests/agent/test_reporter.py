"""The reporter against a real local HTTP server: outages, restarts, refusals, no loss.

The server below stores snapshots keyed like the real ingest, (agent_id, boot_id,
sequence), so a resent snapshot is stored once and reported as a duplicate. Backoff
runs on an injected clock: the tests never sleep to wait for a retry.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter, deque
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.clock import FakeClock

from gpuwatch.agent.reporter import BACKOFF_MAX_SECONDS, Reporter, ReporterStats
from gpuwatch.agent.spool import encode
from gpuwatch.errors import ConfigError
from gpuwatch.settings import AgentSettings, load
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot
from gpuwatch.wire import SNAPSHOTS_PATH, IngestRequest, IngestResponse, ItemResult

TOKEN = "s3cret-token-value"
EPOCH = 1_700_000_000.0
Key = tuple[str, str, int]


class Ingest(ThreadingHTTPServer):
    """A local stand-in for the server's ``POST /api/v1/snapshots``.

    Bound at construction (so the port is ours), listening only after :meth:`up`:
    before that, connections are refused, as from a server that is down.
    """

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self.server_bind()
        self.token = TOKEN
        self.stored: dict[Key, dict[str, object]] = {}
        self.received: Counter[Key] = Counter()
        self.statuses: list[int] = []
        # Scripted answers, used first: (status, headers, store the batch anyway?).
        self.script: deque[tuple[int, dict[str, str], bool]] = deque()
        self.max_body_bytes: int | None = None
        self.poison: set[int] = set()  # sequences answered with 422
        self.dropped_reports: list[int] = []  # each request's "spool_dropped_total"
        self.stored_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def up(self) -> None:
        self.server_activate()
        # A short poll interval: shutdown() waits for it, on every test's teardown.
        self._thread = threading.Thread(target=self.serve_forever, args=(0.01,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
        self.server_close()

    def answer(self, body: bytes, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            status, headers, store = self.script.popleft() if self.script else (200, {}, True)
            self.dropped_reports.append(json.loads(body).get("spool_dropped_total"))
            if status == 200 and authorization != f"Bearer {self.token}":
                status, store = 401, False
            if status == 200 and self.max_body_bytes and len(body) > self.max_body_bytes:
                status, store = 413, False
            if store:
                # The body must be the wire model, as the real server reads it.
                IngestRequest.model_validate_json(body)
            snapshots = json.loads(body)["snapshots"] if store else []
            if status == 200 and any(s["sequence"] in self.poison for s in snapshots):
                status, store, snapshots = 422, False, []
            self.statuses.append(status)
            results: list[ItemResult] = []
            for s in snapshots:
                key = (s["agent_id"], s["boot_id"], s["sequence"])
                self.received[key] += 1
                if key in self.stored:
                    results.append("duplicate")
                else:
                    self.stored[key] = s
                    results.append("accepted")
            if snapshots:
                self.stored_event.set()
            if status != 200:
                return status, headers, b"{}"
            reply = IngestResponse(
                accepted=results.count("accepted"),
                duplicate=results.count("duplicate"),
                results=results,
            )
            return status, headers, reply.model_dump_json().encode()


class _Handler(BaseHTTPRequestHandler):
    server: Ingest

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        headers: dict[str, str] = {}
        if self.path != SNAPSHOTS_PATH:
            status, reply = 404, b"{}"
        else:
            status, headers, reply = self.server.answer(body, self.headers.get("Authorization"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output quiet


@pytest.fixture
def ingest() -> Iterator[Ingest]:
    server = Ingest()
    yield server
    server.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def settings_for(
    ingest: Ingest, spool_dir: Path, *, max_bytes: int = 2**20, interval: float = 15.0
) -> AgentSettings:
    return load(
        AgentSettings,
        server_url=ingest.url,
        token=TOKEN,
        spool_dir=spool_dir,
        spool_max_bytes=max_bytes,
        push_interval_seconds=interval,
    )


def reporter_for(settings: AgentSettings, clock: FakeClock) -> Reporter:
    return Reporter(settings, clock=clock, rand=lambda: 1.0, wall_clock=lambda: EPOCH + clock.now)


def snapshot(sequence: int, *, padding: int = 0) -> HostSnapshot:
    gpus = []
    if padding:
        gpus = [Gpu(index=0, uuid="GPU-0", processes=[GpuProcess(pid=1, command="x" * padding)])]
    return HostSnapshot(
        agent_id="agent-1",
        hostname="h",
        boot_id="boot-1",
        sequence=sequence,
        collected_at=EPOCH + sequence,
        gpus=gpus,
    )


def accounted(stats: ReporterStats) -> int:
    """Snapshots in a final state or still pending: must equal the number offered."""
    return sum(stats.pushed_total.values()) + sum(stats.dropped_total.values()) + stats.pending


def drain_until_empty(reporter: Reporter, clock: FakeClock, *, tries: int = 50) -> None:
    for _ in range(tries):
        result = reporter.drain_once()
        if result.stopped_by is None:
            return
        clock.now += result.retry_in_seconds or 0.0
    raise AssertionError(f"spool not drained: {result}")


# --- the promise -------------------------------------------------------------------------


def test_outage_with_a_tiny_spool_loses_nothing_uncounted(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    # ~4 KiB snapshots in a 64 KiB spool: about 15 fit, 60 are offered while down.
    reporter = reporter_for(settings_for(ingest, tmp_path, max_bytes=2**16), clock)
    offered = 0
    for i in range(60):
        reporter.offer(snapshot(i, padding=4000))
        offered += 1
        result = reporter.drain_once()
        assert result.stopped_by in ("unreachable", "backoff")
        clock.now += 15
    assert reporter.stats().consecutive_failures > 0
    ingest.up()
    for i in range(60, 70):
        reporter.offer(snapshot(i, padding=4000))
        offered += 1
        clock.now += 15
        drain_until_empty(reporter, clock)
    stats = reporter.stats()
    dropped = stats.dropped_total.get("spool_full", 0)
    assert dropped > 0
    assert len(ingest.stored) + dropped == offered
    assert set(ingest.received.values()) == {1}  # nothing was even sent twice
    assert accounted(stats) == offered and stats.pending == 0
    # Oldest first: what survived the outage is the newest.
    assert min(k[2] for k in ingest.stored) == dropped
    assert stats.pushed_total == {"accepted": len(ingest.stored), "duplicate": 0}
    assert stats.consecutive_failures == 0 and not stats.auth_failed
    assert stats.last_success_time == EPOCH + clock.now
    reporter.close()


def test_a_restarted_reporter_sends_what_the_old_one_spooled(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    settings = settings_for(ingest, tmp_path)
    first = reporter_for(settings, clock)
    for i in range(10):
        first.offer(snapshot(i))
    assert first.drain_once().stopped_by == "unreachable"
    first.close()
    second = reporter_for(settings, clock)
    assert second.stats().pending == 10
    for i in range(10, 15):
        second.offer(snapshot(i))
    ingest.up()
    clock.now += BACKOFF_MAX_SECONDS
    drain_until_empty(second, clock)
    assert sorted(k[2] for k in ingest.stored) == list(range(15))
    assert set(ingest.received.values()) == {1}
    second.close()


def test_a_response_lost_after_storing_is_resent_and_stored_once(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    ingest.up()
    ingest.script.append((503, {}, True))  # stores the batch, then fails the response
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    for i in range(5):
        reporter.offer(snapshot(i))
    assert reporter.drain_once().stopped_by == "throttled"
    drain_until_empty(reporter, clock)
    assert len(ingest.stored) == 5
    stats = reporter.stats()
    assert stats.pushed_total == {"accepted": 0, "duplicate": 5}
    assert accounted(stats) == 5
    reporter.close()


def test_every_push_reports_the_snapshots_dropped_so_far(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    # While the server is down a 64 KiB spool evicts ~4 KiB snapshots (spool_full); once
    # it is up, one snapshot is refused (rejected). Each request carries the total so far.
    reporter = reporter_for(settings_for(ingest, tmp_path, max_bytes=2**16), clock)
    for i in range(20):
        reporter.offer(snapshot(i, padding=4000))
    evicted = reporter.stats().dropped_total["spool_full"]
    assert evicted > 0
    ingest.up()
    ingest.poison = {19}
    clock.now += BACKOFF_MAX_SECONDS
    drain_until_empty(reporter, clock)
    reporter.offer(snapshot(20))
    drain_until_empty(reporter, clock)
    assert reporter.stats().dropped_total == {"spool_full": evicted, "rejected": 1}
    # Before the refusal the eviction alone; the request after it, both.
    assert ingest.dropped_reports[0] == evicted
    assert ingest.dropped_reports[-1] == evicted + 1
    assert ingest.dropped_reports == sorted(ingest.dropped_reports)
    reporter.close()


# --- refusals ------------------------------------------------------------------------------


def test_too_large_batches_are_split_until_they_fit(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    ingest.up()
    one = len(encode(snapshot(0, padding=1000)))
    ingest.max_body_bytes = 3 * one + 100
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    for i in range(20):
        reporter.offer(snapshot(i, padding=1000))
    result = reporter.drain_once()
    assert (result.stopped_by, result.delivered, result.dropped) == (None, 20, 0)
    assert sorted(k[2] for k in ingest.stored) == list(range(20))
    assert 413 in ingest.statuses
    # The limit is learnt: more snapshots go out without another 413.
    statuses_before = len(ingest.statuses)
    for i in range(20, 26):
        reporter.offer(snapshot(i, padding=1000))
    reporter.drain_once()
    assert 413 not in ingest.statuses[statuses_before:]
    assert reporter.stats().dropped_total == {}
    reporter.close()


def test_a_snapshot_too_large_on_its_own_is_dropped_and_counted(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    ingest.up()
    ingest.max_body_bytes = 2000
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    reporter.offer(snapshot(0))
    reporter.offer(snapshot(1, padding=3000))
    reporter.offer(snapshot(2))
    result = reporter.drain_once()
    assert (result.delivered, result.dropped, result.pending) == (2, 1, 0)
    assert sorted(k[2] for k in ingest.stored) == [0, 2]
    assert reporter.stats().dropped_total == {"too_large": 1}
    reporter.close()


def test_a_poison_snapshot_is_isolated_dropped_and_counted(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    ingest.up()
    ingest.poison = {3}
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    for i in range(8):
        reporter.offer(snapshot(i))
    result = reporter.drain_once()
    assert (result.stopped_by, result.delivered, result.dropped) == (None, 7, 1)
    assert sorted(k[2] for k in ingest.stored) == [0, 1, 2, 4, 5, 6, 7]
    stats = reporter.stats()
    assert stats.dropped_total == {"rejected": 1}
    assert accounted(stats) == 8
    reporter.close()


def test_a_refused_token_keeps_everything_spooled_and_logs_once(
    ingest: Ingest, tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    ingest.up()
    ingest.token = "another"
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    caplog.set_level(logging.INFO, logger="gpuwatch")
    for i in range(3):
        reporter.offer(snapshot(i))
        result = reporter.drain_once()
        assert result.stopped_by == "auth_failed"
        clock.now += result.retry_in_seconds or 0.0
    stats = reporter.stats()
    assert stats.auth_failed and stats.pending == 3 and stats.dropped_total == {}
    assert stats.batches_total == {"auth_failed": 3}
    refusals = [r for r in caplog.records if "refused the agent token" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR
    ingest.token = TOKEN  # the operator registers the token
    drain_until_empty(reporter, clock)
    assert len(ingest.stored) == 3
    assert not reporter.stats().auth_failed
    assert any("accepts snapshots again" in r.getMessage() for r in caplog.records)
    reporter.close()


# --- retry timing ---------------------------------------------------------------------------


def test_retry_after_seconds_is_honoured(ingest: Ingest, tmp_path: Path, clock: FakeClock) -> None:
    ingest.up()
    ingest.script.append((503, {"Retry-After": "120"}, False))
    # The earliest retry the spread allows: exactly Retry-After.
    reporter = Reporter(settings_for(ingest, tmp_path), clock=clock, rand=lambda: 0.0)
    reporter.offer(snapshot(0))
    result = reporter.drain_once()
    assert (result.stopped_by, result.retry_in_seconds) == ("throttled", 120)
    clock.now += 119
    assert reporter.drain_once().stopped_by == "backoff"
    assert ingest.statuses == [503]  # nothing was sent early
    clock.now += 1
    assert reporter.drain_once().delivered == 1
    reporter.close()


def test_retry_after_as_an_http_date_is_honoured(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    ingest.up()
    when = formatdate(EPOCH + clock.now + 300, usegmt=True)
    ingest.script.append((429, {"Retry-After": when}, False))
    reporter = Reporter(
        settings_for(ingest, tmp_path),
        clock=clock,
        rand=lambda: 0.0,
        wall_clock=lambda: EPOCH + clock.now,
    )
    reporter.offer(snapshot(0))
    assert reporter.drain_once().retry_in_seconds == pytest.approx(300)
    reporter.close()


def test_agents_refused_together_come_back_spread_over_half_the_retry_after(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    """A busy server answers many agents 503 with the same Retry-After at once."""
    ingest.up()
    delays = []
    for n, draw in enumerate((0.0, 0.25, 0.5, 0.999)):
        ingest.script.append((503, {"Retry-After": "5"}, False))
        reporter = Reporter(
            settings_for(ingest, tmp_path / str(n)), clock=clock, rand=lambda d=draw: d
        )
        reporter.offer(snapshot(0))
        delays.append(reporter.drain_once().retry_in_seconds)
        reporter.close()
    assert delays == pytest.approx([5.0, 5.625, 6.25, 7.4975])


def test_backoff_doubles_to_its_ceiling_with_jitter(
    tmp_path: Path, clock: FakeClock, ingest: Ingest
) -> None:
    draws = iter([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    reporter = Reporter(settings_for(ingest, tmp_path), clock=clock, rand=lambda: next(draws))
    reporter.offer(snapshot(0))
    delays = []
    for _ in range(9):
        result = reporter.drain_once()
        assert result.stopped_by == "unreachable"
        delays.append(result.retry_in_seconds)
        clock.now += result.retry_in_seconds or 0.0
    # Equal jitter: between half and all of 1, 2, 4, ... seconds, capped at the ceiling.
    assert delays == [1.0, 1.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 45.0]
    assert reporter.stats().consecutive_failures == 9
    reporter.close()


@pytest.mark.parametrize("status", [500, 502, 404])
def test_other_errors_are_retried_and_drop_nothing(
    status: int, ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    ingest.up()
    ingest.script.append((status, {}, False))
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    reporter.offer(snapshot(0))
    assert reporter.drain_once().stopped_by in ("server_error", "unexpected_status")
    drain_until_empty(reporter, clock)
    assert len(ingest.stored) == 1 and reporter.stats().dropped_total == {}
    reporter.close()


# --- the thread, logs, configuration -------------------------------------------------------------


def test_the_push_thread_delivers_once_the_server_comes_back(
    ingest: Ingest, tmp_path: Path
) -> None:
    # Real clock here: the first retry comes after 0.5 s (rand=0 halves the 1 s base).
    reporter = Reporter(settings_for(ingest, tmp_path, interval=0.05), rand=lambda: 0.0)
    reporter.start()
    try:
        reporter.offer(snapshot(0))
        ingest.up()
        reporter.offer(snapshot(1))
        assert ingest.stored_event.wait(timeout=10)
        for _ in range(100):
            if len(ingest.stored) == 2:
                break
            ingest.stored_event.clear()
            ingest.stored_event.wait(timeout=0.2)
        assert sorted(k[2] for k in ingest.stored) == [0, 1]
    finally:
        reporter.close()
    assert reporter.stats().pending == 0


def test_the_token_is_never_logged(
    ingest: Ingest, tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    reporter.offer(snapshot(0))
    reporter.drain_once()  # unreachable
    ingest.up()
    ingest.token = "other"
    clock.now += BACKOFF_MAX_SECONDS
    reporter.drain_once()  # refused
    ingest.token = TOKEN
    clock.now += BACKOFF_MAX_SECONDS
    reporter.drain_once()  # accepted
    reporter.close()
    assert caplog.records
    assert all(TOKEN not in r.getMessage() for r in caplog.records)
    assert TOKEN not in caplog.text


def test_credentials_in_the_server_url_are_not_logged(
    ingest: Ingest, tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    address = ingest.url.removeprefix("http://")
    settings = load(AgentSettings, server_url=f"http://user:pw@{address}/", spool_dir=tmp_path)
    reporter = reporter_for(settings, clock)
    caplog.set_level(logging.WARNING, logger="gpuwatch")
    reporter.offer(snapshot(0))
    reporter.drain_once()
    reporter.close()
    assert address in caplog.text and "pw" not in caplog.text


def test_a_spool_that_cannot_be_written_counts_the_loss(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    (tmp_path / f"{0:020d}.tmp").mkdir()  # the spool's next temp name is taken
    reporter.offer(snapshot(0))
    reporter.offer(snapshot(1))
    stats = reporter.stats()
    # The first waited in memory and went into the spool ahead of the second (M2).
    assert stats.dropped_total == {} and stats.pending == 2
    assert accounted(stats) == 2
    reporter.close()


def test_push_stats_feed_the_agent_metrics(
    ingest: Ingest, tmp_path: Path, clock: FakeClock
) -> None:
    ingest.up()
    reporter = reporter_for(settings_for(ingest, tmp_path), clock)
    reporter.offer(snapshot(0))
    reporter.drain_once()
    pushed = reporter.push_stats()
    assert pushed.batches == {"success": 1}
    assert (pushed.pending, pushed.last_success_time) == (0, EPOCH + clock.now)
    reporter.close()


@pytest.mark.parametrize("url", [None, "ftp://server", "not a url"])
def test_a_missing_or_bad_server_url_is_a_config_error(url: str | None, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        Reporter(load(AgentSettings, server_url=url, spool_dir=tmp_path))
