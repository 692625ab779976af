"""Load benchmark: many simulated agents pushing to one ``gpuwatch server``, over loopback.

Every simulated agent has its own host, token and 8-GPU x 50-process snapshot (the
``bench.server`` workload, ~33 KB of JSON) and pushes as ``gpuwatch agent``'s reporter
does: one snapshot every push interval, on a new connection each time (uvicorn closes
an idle keep-alive connection after 5 s, and agents push every 15 s), sending whatever
its spool holds (up to the reporter's batch limits) and backing off on 503 with the
reporter's own policy. Phases, each bounded in time:

* sustained: ``FLEET`` agents at the 15 s interval (3,000 hosts: 200 snapshots/s
  offered) against ``gpuwatch server`` on SQLite, on Postgres, and on Postgres with two
  replicas (agents split between their ports, as a sticky load balancer would).
  Reported: accepted snapshots/s, p50/p99 latency, status counts (only 200 and 503
  allowed), and the server's CPU seconds per snapshot (psutil; Postgres's own
  backends reported beside it).
* floor: the same agents and requests against ``bench/http_floor.py`` (the same
  uvicorn, an app that reads the body and answers), in the same run: its CPU per
  request is the denominator of the CPU ratio.
* storm: ``STORM_AGENTS`` agents come back after a 30-minute outage with
  ``STORM_SPOOLED`` snapshots spooled each and drain them (the reporter's batches and
  backoff) while the rest of the fleet keeps pushing: drain time, live p99, statuses.
* agent RSS: a real ``gpuwatch agent`` scraped 10,000 times, RSS sampled.
* profile (``--profile``): the sustained SQLite phase again with the server under
  py-spy, where the server's time goes.

The generator runs in this process (asyncio, a minimal HTTP/1.1 client over
httptools' C parser, bodies rendered from per-host templates) on the same 2 cores as
the server; its own CPU, the machine's and the lateness of scheduled pushes are
reported with every phase, so a result limited by the generator says so.

Run: ``./dev bench load`` or ``.venv/bin/python -m bench load``; ``python -m bench.load
--quick`` is a ~2-minute smoke run (fewer hosts at a shorter interval, the same offered
rate). Results: ``bench/results/load.json`` (``load-quick.json`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import psutil

from bench.common import terminate, write_result
from bench.server import (
    ROOT,
    RawSqlite,
    Target,
    _serving,
    fresh_database,
    host_snapshot,
    make_tokens,
    postgres_unavailable,
    raw_seconds,
    running_floor,
    running_server,
)
from gpuwatch.server.ingest.writer import BATCH_PUSHES
from gpuwatch.server_settings import ServerSettings

MIB = 2**20
INGEST = "/api/v1/snapshots"
TIMEOUT_SECONDS = 10.0  # the reporter's HTTP timeout (gpuwatch/agent/reporter.py)
ALLOWED = {200, 503}  # backpressure is 503; anything else is a failure of the promise


@dataclass(frozen=True)
class Plan:
    """How big and how long each phase is."""

    fleet: int  # hosts pushing in the sustained phases
    interval: float  # their push interval, seconds
    # Seconds before measuring. A phase starts with every host's state out of the new
    # server's cache and its open bucket older than the bucket interval (the wait for a
    # quiet machine and the phase before lie between), so every host's first push reads
    # its state and closes a bucket: a start-up surge, on a server with little headroom,
    # whose backlog outlasted a 15 s ramp. The full plan's ramp lets every host push for one bucket interval and one
    # push interval before measuring, so the measured window is the steady state.
    ramp: float
    measure: float  # measured seconds of a sustained phase
    floor_measure: float
    warm_snapshots: int  # history each host pushes before anything is measured
    warm_span: float  # seconds of agent time that history covers
    storm_agents: int
    storm_spooled: int
    storm_live: int  # hosts that keep pushing during the storm
    storm_cap: float  # seconds the storm may take before it is called unfinished
    scrapes: int


FULL = Plan(
    fleet=3000,
    interval=15.0,
    ramp=75.0,  # was 15 s (one push interval) until the bucket phases: see Plan.ramp
    measure=90.0,
    floor_measure=45.0,
    warm_snapshots=12,
    warm_span=3600.0,
    storm_agents=1000,
    storm_spooled=120,
    storm_live=2000,
    storm_cap=900.0,
    # 10,000 is the target's count, but at ~1,000 scrapes/s the agent has then been up
    # for 10 s. Its RSS grows once, by ~0.4 MiB, at ~35 s of uptime (150,000 scrapes:
    # flat from 60,000 on), so the run lasts long enough to show that it stops.
    scrapes=100_000,
)
QUICK = Plan(
    fleet=300,
    interval=1.5,
    ramp=1.5,
    measure=8.0,
    floor_measure=5.0,
    warm_snapshots=4,
    warm_span=600.0,
    storm_agents=50,
    storm_spooled=120,
    storm_live=200,
    storm_cap=60.0,
    scrapes=1_000,
)
# The servers' state_cache_hosts: the server's default, above the fleet and the storm's
# returning hosts, so every host's state stays cached. Another given with
# --state-cache-hosts is measured beside the default.
STATE_CACHE_HOSTS: int = ServerSettings.model_fields["state_cache_hosts"].default
# The most a sustained phase waits for an earlier phase's backlog to drain (settle).
SETTLE_CAP_SECONDS = 600.0
PHASES = ("sqlite", "storm", "postgres", "rss", "profile")
TARGETS = {
    "sqlite_snapshots_per_second": 200,
    "p99_ms": 250,
    "cpu_ratio_to_floor": 4.0,
    "storm_drain_seconds": 600,
    "agent_rss_bytes": 40 * MIB,
    # "Flat": over the second half of the scrapes, RSS grows by less than this a
    # thousand scrapes (a leak of one 16 KiB buffer per thousand would pass no longer).
    "agent_rss_slope_bytes_per_1000_scrapes": 16 * 1024,
}


# --- bodies -------------------------------------------------------------------------------

_HOST_MARK, _SEQ_MARK, _AT_MARK = "zzhostzz", 987654321987, 1234567890.125
_MARKS = re.compile(rb"zzhostzz|987654321987|1234567890\.125")


class Template:
    """A snapshot's JSON split where the hostname, sequence and collection time go, so
    a body costs a join rather than building and serialising models (6 ms a snapshot,
    which would make the generator the bottleneck). Processes persist from push to
    push with steady memory; the server still updates every lifetime on every push."""

    def __init__(self) -> None:
        snap = host_snapshot(_HOST_MARK, 0, _AT_MARK).model_copy(update={"sequence": _SEQ_MARK})
        raw = snap.model_dump_json().encode()  # start times: from 2009, before any push
        self.parts: list[bytes] = []
        self.slots: list[bytes] = []
        last = 0
        for found in _MARKS.finditer(raw):
            self.parts.append(raw[last : found.start()])
            self.slots.append(found.group())
            last = found.end()
        self.parts.append(raw[last:])
        self._fixed = sum(map(len, self.parts))
        self._hosts = self.slots.count(b"zzhostzz")

    def length(self, host: str, sequence: int, at: float) -> int:
        """``len(self.render(host, sequence, at))``, without rendering."""
        return (
            self._fixed
            + self._hosts * len(host.encode())
            + len(b"%d" % sequence)
            + len(repr(at).encode())
        )

    def render(self, host: str, sequence: int, at: float) -> bytes:
        values = {b"zzhostzz": host.encode(), b"987654321987": b"%d" % sequence}
        values[b"1234567890.125"] = repr(at).encode()
        out = [self.parts[0]]
        for slot, part in zip(self.slots, self.parts[1:], strict=True):
            out.append(values[slot])
            out.append(part)
        return b"".join(out)


_HEAD, _TAIL = b'{"snapshots":[', b'],"spool_dropped_total":0}'


def batch_length(template: Template, host: str, batch: Sequence[tuple[int, float]]) -> int:
    """The bytes of :func:`batch_pieces` joined."""
    body = sum(template.length(host, sequence, at) for sequence, at in batch)
    return len(_HEAD) + body + len(batch) - 1 + len(_TAIL)


def batch_pieces(
    template: Template, host: str, batch: Sequence[tuple[int, float]]
) -> Iterator[bytes]:
    """An IngestRequest of ``batch`` ((sequence, at) pairs), piece by piece: byte for
    byte ``gpuwatch.wire.ingest_request_json`` of the rendered snapshots (checked by
    :func:`check_framing`), rendered only as the connection takes it."""
    yield _HEAD
    for i, (sequence, at) in enumerate(batch):
        if i:
            yield b","
        yield template.render(host, sequence, at)
    yield _TAIL


def check_framing(template: Template) -> None:
    from gpuwatch.wire import IngestRequest, ingest_request_json

    batch = [(7, 1.7e9), (8, 1.7e9 + 15.25)]
    body = b"".join(batch_pieces(template, "check-host", batch))
    expected = ingest_request_json([template.render("check-host", *item) for item in batch], 0)
    if body != expected or len(body) != batch_length(template, "check-host", batch):
        raise RuntimeError("bench.load frames batches unlike gpuwatch.wire")
    IngestRequest.model_validate_json(body)  # and the server's model accepts it


# --- the HTTP client ----------------------------------------------------------------------


class _Response:
    """httptools callbacks: the status and body of one response."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.retry_after: float | None = None
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"retry-after" and value.strip().isdigit():
            self.retry_after = float(value)

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.done = True


async def post(
    port: int, headers: bytes, length: int, pieces: Iterator[bytes], stage: list[str]
) -> tuple[int, float | None, bytes]:
    """POST ``length`` bytes of ``pieces`` to ``127.0.0.1:port`` on a new connection;
    (status, Retry-After seconds, body). Status 0: the connection failed or was closed
    before a whole response came. ``stage[0]`` says how far it got: ``connecting``,
    ``waiting`` (connected, no response yet), ``reading`` (a response began).

    The body goes out while the response is read, so a 503 answered before the body
    is read arrives at once, and the rest of the body is never rendered: a storm of
    thousands of 4 MiB drains then costs the generator little memory."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0, None, b""
    stage[0] = "waiting"
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % (INGEST.encode(), port))
    writer.write(headers + b"Content-Length: %d\r\n\r\n" % length)
    sending = asyncio.create_task(_send(writer, pieces))
    try:
        response = _Response()
        parser = httptools.HttpResponseParser(response)
        while not response.done:
            data = await reader.read(65536)
            if not data:
                return 0, None, b""
            stage[0] = "reading"
            parser.feed_data(data)
        return parser.get_status_code(), response.retry_after, bytes(response.body)
    except (OSError, httptools.HttpParserError):
        return 0, None, b""
    finally:
        sending.cancel()
        writer.transport.abort()


async def _send(writer: asyncio.StreamWriter, pieces: Iterator[bytes]) -> None:
    with contextlib.suppress(OSError):
        for piece in pieces:
            writer.write(piece)
            if writer.transport.get_write_buffer_size() > 2**18:
                await writer.drain()
        await writer.drain()


# --- agents -------------------------------------------------------------------------------


@dataclass
class Agent:
    """One simulated host's agent: its spool of snapshots not yet acknowledged."""

    host: str
    headers: bytes
    port: int
    sequence: int
    pending: list[tuple[int, float]] = field(default_factory=list)  # (sequence, at)
    # The server's downsampling buckets of this host: their phase (ingest/apply.py
    # bucket_phase) and the bucket of the newest snapshot it stored.
    phase: float = 0.0
    bucket: float = float("-inf")

    def poll(self, at: float) -> None:
        self.pending.append((self.sequence, at))
        self.sequence += 1


@dataclass(slots=True)
class Request:
    started: float  # monotonic
    seconds: float
    status: int
    snapshots: int  # sent; on a 200, stored
    kind: str  # "live" or "storm"
    deferred: int = 0  # on a 200: the snapshots the server deferred (not stored)
    stage: str = "reading"  # how far an unanswered one got (post)
    closing: bool = False  # it carried the first snapshot of a new bucket of its host


@dataclass
class Run:
    """What one phase's agents did, and the generator's own scheduling lateness."""

    template: Template
    requests: list[Request] = field(default_factory=list)
    lateness: list[float] = field(default_factory=list)
    drained_at: dict[str, float] = field(default_factory=dict)  # storm host -> monotonic

    async def push(self, agent: Agent, kind: str) -> tuple[int, float | None, int]:
        """Send the agent's oldest pending snapshots, as many as the reporter's batch
        limits allow, as the reporter does (with its Gpuwatch-Partial header); (status,
        Retry-After seconds, snapshots deferred). Deferred ones stay pending: the
        server defers the tail of an in-order batch (ingest/service.py)."""
        from gpuwatch.agent.reporter import MAX_BATCH_BYTES
        from gpuwatch.wire import MAX_SNAPSHOTS_PER_REQUEST

        batch: list[tuple[int, float]] = []
        size = 0
        for sequence, at in agent.pending[:MAX_SNAPSHOTS_PER_REQUEST]:
            n = self.template.length(agent.host, sequence, at)
            if batch and size + n > MAX_BATCH_BYTES:
                break
            batch.append((sequence, at))
            size += n
        length = batch_length(self.template, agent.host, batch)
        pieces = batch_pieces(self.template, agent.host, batch)
        started, stage = time.monotonic(), ["connecting"]
        try:
            status, retry_after, body = await asyncio.wait_for(
                post(agent.port, agent.headers, length, pieces, stage), TIMEOUT_SECONDS
            )
        except TimeoutError:
            status, retry_after, body = -1, None, b""
        # Only the results list can hold the word: one per deferred snapshot.
        deferred = body.count(b'"deferred"') if status == 200 else 0
        stored = len(batch) - deferred
        seconds = time.monotonic() - started
        # The server closes the host's bucket when a snapshot falls in a later one.
        newest = max(_bucket(agent, at) for _, at in batch)
        closing = newest > agent.bucket
        request = Request(started, seconds, status, stored, kind, deferred, stage[0], closing)
        self.requests.append(request)
        if status == 200:
            if stored:
                agent.bucket = max(agent.bucket, _bucket(agent, batch[stored - 1][1]))
            del agent.pending[:stored]
            return status, None, deferred
        return status, retry_after, 0


@contextlib.contextmanager
def generator_gc_paused() -> Iterator[None]:
    """This process's garbage collector off for a phase. The generator keeps hundreds of
    thousands of request records and spooled snapshots; a full collection over them
    can stall its event loop, and that stall would be measured as server latency."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def backoff(failures: int, retry_after: float | None, rng: random.Random) -> float:
    """The reporter's delay before its next try (gpuwatch/agent/reporter.py)."""
    from gpuwatch.agent.reporter import (
        BACKOFF_BASE_SECONDS,
        BACKOFF_MAX_SECONDS,
        RETRY_AFTER_SPREAD,
    )

    ceiling = min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** min(failures - 1, 30))
    delay = ceiling * (0.5 + 0.5 * rng.random())
    if retry_after is None:
        return delay
    return max(delay, retry_after * (1.0 + RETRY_AFTER_SPREAD * rng.random()))


async def run_agent(
    run: Run, agent: Agent, *, interval: float, first: float, stop: float, kind: str,
    rng: random.Random, retry_at: float = 0.0,
) -> None:  # fmt: skip
    """Poll every ``interval`` from ``first`` (monotonic) until ``stop``, and drain the
    spool after each poll as the reporter's push thread does (not before ``retry_at``);
    a storm agent stops once its spool is empty."""
    from gpuwatch.agent.reporter import DEFERRED_PAUSE_SECONDS

    tick, failures = first, 0
    while True:
        now = time.monotonic()
        while tick <= now and tick < stop:  # polls that came due while it was busy
            agent.poll(time.time() - (now - tick))
            tick += interval
        if agent.pending and now >= retry_at:
            status, retry_after, deferred = await run.push(agent, kind)
            if status == 200:
                failures = 0
                if kind == "storm" and not agent.pending:
                    run.drained_at[agent.host] = time.monotonic()
                    return
                if deferred:  # the reporter's pause, not a backoff
                    retry_at = time.monotonic() + DEFERRED_PAUSE_SECONDS * (
                        0.5 + 0.5 * rng.random()
                    )
                continue
            failures += 1
            retry_at = time.monotonic() + backoff(failures, retry_after, rng)
            continue
        if tick >= stop and (kind != "storm" or not agent.pending):
            return
        wake = min(tick, retry_at) if agent.pending else tick
        await asyncio.sleep(max(0.0, wake - time.monotonic()))
        # How late the event loop woke this agent: the generator's own delay.
        run.lateness.append(max(0.0, time.monotonic() - wake))


# --- measuring ---------------------------------------------------------------------------


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def _main_thread_cpu(process: psutil.Process) -> float:
    """CPU seconds of the process's main thread: a server's event loop (uvicorn runs
    it there; the ingest writer and the worker threads are the others)."""
    try:
        threads = process.threads()
    except psutil.Error:
        return 0.0
    return sum(t.user_time + t.system_time for t in threads if t.id == process.pid)


class CpuMeter:
    """CPU seconds of the servers, of Postgres's processes, of this process (the
    generator) and of the whole machine, between :meth:`start` and :meth:`stop`."""

    def __init__(self, servers: Sequence[psutil.Process]) -> None:
        self.servers = list(servers)
        self.me = psutil.Process()

    def _now(self) -> dict[str, float]:
        machine = psutil.cpu_times()
        postgres = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "postgres"]
        return {
            "server": sum(_cpu(p) for p in self.servers),
            "server_event_loop": sum(_main_thread_cpu(p) for p in self.servers),
            "postgres": sum(_cpu(p) for p in postgres),
            "generator": _cpu(self.me),
            "machine_busy": sum(machine) - machine.idle - machine.iowait,
            "wall": time.monotonic(),
        }

    def start(self) -> None:
        self.began = self._now()

    def stop(self) -> dict[str, float]:
        end = self._now()
        return {k: end[k] - self.began[k] for k in end}


def wait_for_quiet(*, most: float = 240.0, below: float = 0.25) -> dict[str, float]:
    """Wait (at most ``most`` seconds) until the machine's CPU use, over 3 s, is under
    ``below`` of its cores: on a machine shared with other work, start a measurement
    when that work pauses rather than in the middle of it. What it found is reported."""
    began = time.monotonic()
    busy = psutil.cpu_percent(interval=3) / 100
    while busy >= below and time.monotonic() - began < most:
        busy = psutil.cpu_percent(interval=3) / 100
    return {"seconds": round(time.monotonic() - began, 1), "busy_share_at_start": busy}


def server_process(port: int) -> psutil.Process:
    """This process's descendant listening on ``port`` (a server started by
    ``bench.server``, perhaps under py-spy)."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(c.laddr.port == port for c in child.net_connections("tcp")):
                return child
    raise RuntimeError(f"no child process listens on port {port}")


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(run: Run, window: tuple[float, float], cpu: dict[str, float]) -> dict[str, Any]:
    """Throughput, latency and statuses of the requests started within ``window``."""
    began, ended = window
    inside = [r for r in run.requests if began <= r.started < ended]
    accepted = sum(r.snapshots for r in inside if r.status == 200)
    statuses = Counter(str(r.status) for r in inside)
    ms = [r.seconds * 1e3 for r in inside]
    seconds = ended - began
    cores = psutil.cpu_count() or 1
    return {
        "seconds": round(seconds, 1),
        "requests": len(inside),
        "accepted_snapshots": accepted,
        "snapshots_per_second": round(accepted / seconds, 1),
        "snapshots_per_request": round(accepted / max(1, statuses.get("200", 0)), 2),
        "p50_ms": _round(percentile(ms, 0.50)),
        "p99_ms": _round(percentile(ms, 0.99)),
        "max_ms": _round(max(ms, default=None)),
        "statuses": dict(sorted(statuses.items())),
        "only_200_and_503": set(statuses) <= {str(s) for s in ALLOWED},
        # Requests with no whole answer within the agent's timeout (-1), by how far
        # they got: still connecting (the server not accepting), waiting or reading.
        "unanswered_by_stage": dict(Counter(r.stage for r in inside if r.status == -1)),
        # 200s that stored part of the batch, the rest deferred by the time budget.
        "partial_requests": sum(1 for r in inside if r.deferred),
        "deferred_snapshots": sum(r.deferred for r in inside),
        "server_cpu_ms_per_snapshot": _round(cpu["server"] / max(1, accepted) * 1e3, 3),
        "postgres_cpu_ms_per_snapshot": _round(cpu["postgres"] / max(1, accepted) * 1e3, 3),
        # Where a server's CPU goes, by thread: the event loop (HTTP, routing, the
        # token check, reading bodies) and the rest (the ingest writer above all).
        "server_event_loop_cpu_ms_per_snapshot": _round(
            cpu["server_event_loop"] / max(1, accepted) * 1e3, 3
        ),
        "cpu_share_of_one_core": {
            k: round(cpu[k] / cpu["wall"], 2) for k in ("server", "postgres", "generator")
        },
        "machine_busy_share": round(cpu["machine_busy"] / (cpu["wall"] * cores), 2),
        # CPU of everything else on the machine (other work sharing the 2 cores).
        # At least 0: the meters are read at slightly different moments.
        "others_share_of_one_core": round(
            max(0.0, cpu["machine_busy"] - cpu["server"] - cpu["postgres"] - cpu["generator"])
            / cpu["wall"],
            2,
        ),
        "generator_lateness_p99_ms": _round(percentile([x * 1e3 for x in run.lateness], 0.99)),
        "by_bucket_closing": _by_bucket_closing(inside),
        "slow_seconds": _slow_seconds(inside, began),
    }


def _slow_seconds(requests: Sequence[Request], began: float) -> list[list[float]]:
    """The seconds of the window (offsets from its start) in which some request took
    longer than the p99 target, with the slowest of them (ms): whether the tail is
    spread out or comes in bursts, and how far apart the bursts are."""
    slowest: dict[int, float] = {}
    for r in requests:
        if r.seconds * 1e3 > TARGETS["p99_ms"]:
            second = int(r.started - began)
            slowest[second] = max(slowest.get(second, 0.0), r.seconds * 1e3)
    return [[second, round(ms)] for second, ms in sorted(slowest.items())]


# The server's default sample_interval_seconds: a host's bucket is this long.
SAMPLE_INTERVAL = 60.0


def _bucket(agent: Agent, at: float) -> float:
    return (at - agent.phase) // SAMPLE_INTERVAL


def set_phases(target: Any, agents: Sequence[Agent]) -> None:
    """Give each agent its host's bucket phase on the server (ingest/apply.py), from the
    id of the host's row."""
    from sqlalchemy import select

    from gpuwatch.server.hosts.models import Host
    from gpuwatch.server.ingest.apply import bucket_phase

    database = target.database()
    try:
        with database.engine.connect() as conn:
            ids = dict(conn.execute(select(Host.hostname, Host.id)).all())
    finally:
        database.dispose()
    for agent in agents:
        agent.phase = bucket_phase(ids[agent.host], SAMPLE_INTERVAL)


def _by_bucket_closing(requests: Sequence[Request]) -> dict[str, Any]:
    """Latency of the pushes that closed their host's bucket (coarse samples written,
    trend detectors run: the heavy pushes; hosts' phases spread them over the minute)
    and of the others."""
    closing = [r.seconds * 1e3 for r in requests if r.closing]
    steady = [r.seconds * 1e3 for r in requests if not r.closing]
    return {
        name: {"requests": len(ms), "p50_ms": _round(percentile(ms, 0.5)),
               "p99_ms": _round(percentile(ms, 0.99))}
        for name, ms in (("bucket_closing", closing), ("rest", steady))
    }  # fmt: skip


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


# --- phases -------------------------------------------------------------------------------


def make_agents(tokens: dict[str, str], ports: Sequence[int], first_sequence: int) -> list[Agent]:
    """An agent per host, hosts dealt round-robin over ``ports``."""
    from gpuwatch.wire import PARTIAL_DEFERRED, PARTIAL_HEADER

    return [
        Agent(
            host=host,
            headers=(
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                f"{PARTIAL_HEADER}: {PARTIAL_DEFERRED}\r\n"
                "Accept: */*\r\nUser-Agent: gpuwatch-load\r\n"
            ).encode(),
            port=ports[i % len(ports)],
            sequence=first_sequence,
        )
        for i, (host, token) in enumerate(tokens.items())
    ]


async def _warm(run: Run, agents: Sequence[Agent], *, count: int, span: float, end: float) -> None:
    """Each agent pushes ``count`` snapshots spread over ``span`` seconds ending at
    ``end`` (epoch), in one request, eight agents at a time; all must be stored. What
    the server defers (its time budget spent) is sent again at once, as the agent
    would after its short pause, and a 503 after the agent's backoff; anything else
    stops the benchmark."""
    step = span / max(1, count)
    queue = list(agents)
    rng = random.Random(5)

    async def worker() -> None:
        while queue:
            agent = queue.pop()
            for k in range(count):
                agent.poll(end - (count - k) * step)
            failures = 0
            while agent.pending:
                status, retry_after, _ = await run.push(agent, "warm")
                if status == 503:
                    failures += 1
                    await asyncio.sleep(backoff(failures, retry_after, rng))
                elif status != 200:
                    raise RuntimeError(f"warm-up push answered {status}")

    await asyncio.gather(*(worker() for _ in range(8)))


def warm(
    template: Template, agents: Sequence[Agent], plan: Plan, *, end: float
) -> tuple[float, int]:
    """Seconds the warm-up took, and how many of its pushes were answered 503."""
    began = time.monotonic()
    run = Run(template)
    asyncio.run(_warm(run, agents, count=plan.warm_snapshots, span=plan.warm_span, end=end))
    return time.monotonic() - began, sum(1 for r in run.requests if r.status == 503)


def sustained(
    template: Template, agents: Sequence[Agent], servers: Sequence[psutil.Process], plan: Plan,
    *, measure: float,
) -> dict[str, Any]:  # fmt: skip
    """Every agent polls each ``plan.interval`` (first polls spread over one interval)
    for ``plan.ramp + measure`` seconds; the last ``measure`` seconds are reported."""
    run, meter, rng = Run(template), CpuMeter(servers), random.Random(7)
    quiet = wait_for_quiet()

    async def go() -> tuple[float, float, dict[str, float]]:
        start = time.monotonic() + 0.5
        window = (start + plan.ramp, start + plan.ramp + measure)
        tasks = [
            asyncio.create_task(
                run_agent(
                    run,
                    agent,
                    interval=plan.interval,
                    kind="live",
                    rng=rng,
                    first=start + rng.random() * plan.interval,
                    stop=window[1],
                )
            )
            for agent in agents
        ]
        await asyncio.sleep(window[0] - time.monotonic())
        meter.start()
        await asyncio.sleep(window[1] - time.monotonic())
        cpu = meter.stop()
        await asyncio.wait(tasks, timeout=TIMEOUT_SECONDS * 3)
        return (*window, cpu)

    with generator_gc_paused():
        began, ended, cpu = asyncio.run(go())
    result = summarize(run, (began, ended), cpu)
    result["hosts"] = len(agents)
    result["waited_for_quiet"] = quiet
    result["offered_snapshots_per_second"] = round(len(agents) / plan.interval, 1)
    return result


def settle(template: Template, agents: Sequence[Agent]) -> dict[str, Any] | None:
    """Drain what the agents still have spooled from an earlier phase, none polling
    meanwhile; what it took, or None when nothing was spooled.

    A sustained phase measures the steady state. An earlier phase that fell behind (one
    Postgres server below the offered rate) leaves every agent a backlog, and each
    would send it at the next phase's first instant: the phase would then measure a
    reconnect storm after an overload, which is the storm phase's question, not its
    own. So the backlog is drained first, on the phase's own servers, and reported."""
    backlog = sum(len(agent.pending) for agent in agents)
    if not backlog:
        return None
    run, rng = Run(template), random.Random(13)

    async def go() -> tuple[float, bool]:
        began = time.monotonic()
        tasks = [
            # stop == first: no polls, only the spool; each returns once it is empty
            asyncio.create_task(
                run_agent(run, agent, interval=1.0, kind="storm", rng=rng, first=began, stop=began)
            )
            for agent in agents
            if agent.pending
        ]
        _, late = await asyncio.wait(tasks, timeout=SETTLE_CAP_SECONDS)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return time.monotonic() - began, not late

    with generator_gc_paused():
        seconds, drained = asyncio.run(go())
    statuses = Counter(str(request.status) for request in run.requests)
    return {
        "spooled_snapshots": backlog,
        "seconds": round(seconds, 1),
        "drained": drained,
        "statuses": dict(sorted(statuses.items())),
    }


def storm(
    template: Template, storm_agents: Sequence[Agent], live_agents: Sequence[Agent],
    server: psutil.Process, plan: Plan,
) -> dict[str, Any]:  # fmt: skip
    """The storm agents reconnect within one second, each with ``plan.storm_spooled``
    snapshots spooled (the last 30 minutes at the push interval), and drain them while
    the live agents keep pushing; measured until the last spool is empty or
    ``plan.storm_cap`` seconds pass."""
    run, meter, rng = Run(template), CpuMeter([server]), random.Random(11)
    quiet = wait_for_quiet()
    now = time.time()
    for agent in storm_agents:
        for k in range(plan.storm_spooled):
            agent.poll(now - (plan.storm_spooled - k) * plan.interval)

    async def go() -> tuple[float, float, dict[str, float], bool]:
        start = time.monotonic() + 0.5
        cap = start + plan.ramp + plan.storm_cap
        live = [
            asyncio.create_task(
                run_agent(
                    run,
                    agent,
                    interval=plan.interval,
                    kind="live",
                    rng=rng,
                    first=start + rng.random() * plan.interval,
                    stop=cap,
                )
            )
            for agent in live_agents
        ]
        await asyncio.sleep(start + plan.ramp - time.monotonic())  # live traffic first
        meter.start()
        began = time.monotonic()
        returning = [
            asyncio.create_task(
                run_agent(
                    run,
                    agent,
                    interval=plan.interval,
                    kind="storm",
                    rng=rng,
                    first=began + plan.interval,
                    stop=cap,
                    retry_at=began + rng.random(),
                )  # back within one second
            )
            for agent in storm_agents
        ]
        done, _ = await asyncio.wait(returning, timeout=cap - time.monotonic())
        ended = time.monotonic()
        cpu = meter.stop()
        for task in live + list(set(returning) - done):
            task.cancel()
        await asyncio.gather(*live, *returning, return_exceptions=True)
        return began, ended, cpu, len(done) == len(returning)

    with generator_gc_paused():
        began, ended, cpu, finished = asyncio.run(go())
    drained = [t - began for t in run.drained_at.values()]
    live_run = Run(template, [r for r in run.requests if r.kind == "live"], run.lateness)
    storm_run = Run(template, [r for r in run.requests if r.kind == "storm"])
    storm_requests = summarize(storm_run, (began, ended), cpu)
    return {
        "agents": len(storm_agents),
        "spooled_per_agent": plan.storm_spooled,
        "live_hosts": len(live_agents),
        "waited_for_quiet": quiet,
        "finished": finished,
        "drained_agents": len(drained),
        "drain_seconds": round(max(drained), 1) if finished else None,
        "drain_seconds_p50_agent": _round(percentile(drained, 0.5)),
        "cap_seconds": plan.storm_cap,
        "storm_requests": {
            k: storm_requests[k]
            for k in (
                "requests",
                "accepted_snapshots",
                "snapshots_per_second",
                "p50_ms",
                "p99_ms",
                "statuses",
                "only_200_and_503",
                "unanswered_by_stage",
                "partial_requests",
                "deferred_snapshots",
            )
        },
        "live": summarize(live_run, (began, ended), cpu),
    }


# --- servers --------------------------------------------------------------------------------


def server_env(plan: Plan, cache_hosts: int | None) -> dict[str, str]:
    """The servers' settings: defaults, but for the push interval the agents use and
    (unless None) ``state_cache_hosts``."""
    env = {"GPUWATCH_SERVER_AGENT_PUSH_INTERVAL_SECONDS": str(plan.interval)}
    if cache_hosts is not None:
        env["GPUWATCH_SERVER_STATE_CACHE_HOSTS"] = str(cache_hosts)
    return env


def port_of(client: Any) -> int:
    return int(client.base_url.port)


@contextlib.contextmanager
def profiled_server(target: Target, logs: Path, env: dict[str, str], out: Path) -> Iterator[Any]:
    """``gpuwatch server`` started by py-spy (sampling it from its start: attaching to
    a running process is refused on this machine), raw stacks written to ``out``."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    full_env = {
        **os.environ, "PYTHONPATH": str(ROOT), "GPUWATCH_CONFIG": "/dev/null",
        "GPUWATCH_SERVER_DATABASE_URL": target.url, "GPUWATCH_SERVER_DATA_DIR": str(logs),
        "GPUWATCH_SERVER_SCHEDULER": "false", **env,
    }  # fmt: skip
    argv = [pyspy, "record", "--nonblocking", "-r", "97", "-f", "raw", "-o", str(out), "--",
            sys.executable, "-m", "gpuwatch", "server", "--listen", "127.0.0.1:0"]  # fmt: skip
    with _serving(argv, cwd=ROOT, env=full_env, logs=logs) as client:
        spy = server_process(port_of(client)).parent()
        yield client
        # py-spy writes its profile on SIGINT (on SIGTERM it writes nothing).
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            with contextlib.suppress(psutil.TimeoutExpired):
                spy.wait(timeout=60)


def pyspy_available() -> str | None:
    found = shutil.which("py-spy") or Path(sys.executable).parent / "py-spy"
    return str(found) if Path(found).exists() else None


# The layers of a profile, by a sample's innermost frame (its own time): the first
# pattern that matches wins (py-spy names files relative to their sys.path entry). Time in a C call (SQLite's, psycopg's) is charged to the
# Python frame that made it, so the DB-API calls of SQLAlchemy's dialect are the
# database's own time.
PROFILE_LAYERS = (
    ("start-up (imports)", r"importlib\._bootstrap"),
    # A thread blocked in one of these is waiting, not working: left out.
    ("waiting", r"\b(select|wait|get|_worker) \((selectors|threading|queue|concurrent/\S+)\.py"
     r"|\bturn \(gpuwatch/server/database/core\.py:\d+\)"),
    ("database: SQL execution and commit (C calls)",
     r"\b(do_execute|do_executemany|do_commit|do_rollback) \(|psycopg/"),
    ("waking the event loop from worker threads", r"\b_(write_to|read_from)_self \("),
    ("SQLAlchemy (Python)", r"sqlalchemy/"),
    ("request validation (pydantic)", r"pydantic|model_validate"),
    ("detectors", r"gpuwatch/detectors/"),
    ("ingest logic (gpuwatch/server/ingest)", r"gpuwatch/server/ingest/"),
    ("write turns (SQLite writer lock)", r"gpuwatch/server/database/core\.py"),
    ("other gpuwatch code", r"gpuwatch/"),
    ("HTTP: uvicorn, httptools, starlette, fastapi, anyio",
     r"uvicorn/|starlette/|fastapi/|anyio/|httptools/"),
    ("asyncio event loop", r"asyncio/"),
)  # fmt: skip


def summarize_profile(path: Path) -> dict[str, Any]:
    """Shares of py-spy's samples (raw, collapsed stacks) by :data:`PROFILE_LAYERS`,
    start-up and waiting threads left out, and the 15 heaviest frames by own time.

    Sampled without pausing the server, so a thread waiting to take the GIL back is
    sampled where it waits (often right after a system call): shares are of samples,
    not of CPU seconds, which psutil measures."""
    layers: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        name = next(
            (name for name, pattern in PROFILE_LAYERS if re.search(pattern, leaf)),
            "other (interpreter, stdlib)",
        )
        layers[name] += int(count)
        if name not in ("start-up (imports)", "waiting"):
            own[re.sub(r" \(.*/", " (", leaf)] += int(count)
    left_out = {name: layers.pop(name, 0) for name in ("start-up (imports)", "waiting")}
    total = sum(layers.values()) or 1
    return {
        "samples": total,
        "samples_left_out": left_out,
        "share_by_layer": {k: round(v / total, 3) for k, v in layers.most_common()},
        "top_own_time": {k: round(v / total, 3) for k, v in own.most_common(15)},
    }


# --- whole benchmarks ---------------------------------------------------------------------------


def bench_database(
    kind: str, tmp: Path, template: Template, plan: Plan, floor: dict[str, Any] | None,
    *, cache_hosts: int, default_cache_too: bool, with_storm: bool, replicas: bool,
) -> dict[str, Any]:  # fmt: skip
    """Sustained on one server (first, with ``default_cache_too``, one at the server's
    default ``state_cache_hosts``); then (``with_storm``) the storm on that server, its
    returning hosts warmed to 30 minutes before it (silent since: the outage) and the
    first ``plan.storm_live`` of the fleet live; then (``replicas``) sustained on two."""
    out: dict[str, Any] = {}
    fleet = [f"{kind}-{i}" for i in range(plan.fleet)]
    back = [f"back-{i}" for i in range(plan.storm_agents if with_storm else 0)]
    with (
        kept_going(out, kind),
        fresh_database(kind, tmp, "load") as target,
        contextlib.ExitStack() as stack,
    ):
        tokens = make_tokens(target, fleet + back)
        agents = make_agents({h: tokens[h] for h in fleet}, [0], 0)
        returning = make_agents({h: tokens[h] for h in back}, [0], 0)
        set_phases(target, agents + returning)
        if default_cache_too:
            with running_server(target, tmp, env=server_env(plan, None)) as client:
                out.update(_warm_fleet(template, agents, returning, plan, client))
                out["one_server_default_cache"] = _sustained_on([client], template, agents, plan)
                _ratio(out["one_server_default_cache"], floor)
                print(f"   default cache: {_line(out['one_server_default_cache'])}", flush=True)
        env = server_env(plan, cache_hosts)
        clients = [stack.enter_context(running_server(target, tmp, env=env))]
        if "warm_seconds" not in out:
            out.update(_warm_fleet(template, agents, returning, plan, clients[0]))
        out["one_server"] = _sustained_on(clients, template, agents, plan)
        _ratio(out["one_server"], floor)
        print(f"   one server: {_line(out['one_server'])}", flush=True)
        if with_storm:
            live = agents[: plan.storm_live]
            _point(returning, clients)
            out["storm"] = storm(
                template, returning, live, server_process(port_of(clients[0])), plan
            )
            _print_storm(out["storm"])
        if replicas:
            clients.append(stack.enter_context(running_server(target, tmp, env=env)))
            out["two_replicas"] = _sustained_on(clients, template, agents, plan)
            _ratio(out["two_replicas"], floor)
            print(f"   two replicas: {_line(out['two_replicas'])}", flush=True)
    return out


@contextlib.contextmanager
def kept_going(out: dict[str, Any], phase: str) -> Iterator[None]:
    """Record a phase's failure in its result (``error``) and go on: a run of most of
    an hour must not lose what its other phases measured to one phase's error."""
    try:
        yield
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
        print(f"   {phase} stopped: {out['error']}", flush=True)


def _point(agents: Sequence[Agent], clients: Sequence[Any]) -> list[int]:
    """Deal ``agents`` round-robin over the servers of ``clients``; their ports."""
    ports = [port_of(client) for client in clients]
    for i, agent in enumerate(agents):
        agent.port = ports[i % len(ports)]
    return ports


def _warm_fleet(
    template: Template, agents: Sequence[Agent], returning: Sequence[Agent], plan: Plan,
    client: Any,
) -> dict[str, Any]:  # fmt: skip
    """Warm the fleet up to now and the returning hosts up to the outage's start."""
    _point([*agents, *returning], [client])
    seconds, refused = warm(template, agents, plan, end=time.time() - plan.interval)
    outage = plan.storm_spooled * plan.interval
    more, more_refused = warm(template, returning, plan, end=time.time() - outage - plan.interval)
    seconds, refused = seconds + more, refused + more_refused
    print(
        f"   warmed {len(agents) + len(returning)} hosts in {seconds:.0f} s ({refused} x 503)",
        flush=True,
    )
    return {"warm_seconds": round(seconds, 1), "warm_503": refused}


def _sustained_on(
    clients: Sequence[Any], template: Template, agents: Sequence[Agent], plan: Plan
) -> dict[str, Any]:
    ports = _point(agents, clients)
    servers = [server_process(port) for port in ports]
    settled = settle(template, agents)
    result = sustained(template, agents, servers, plan, measure=plan.measure)
    result["servers"] = len(servers)
    if settled is not None:
        result["settled_first"] = settled
    return result


def _print_storm(result: dict[str, Any]) -> None:
    print(
        f"   storm: drained {result['drained_agents']}/{result['agents']} agents in "
        f"{result['drain_seconds']} s; live p99 {result['live']['p99_ms']} ms, "
        f"statuses {result['storm_requests']['statuses']} / {result['live']['statuses']}",
        flush=True,
    )


def bench_floor(tmp: Path, template: Template, plan: Plan) -> dict[str, Any]:
    """The sustained workload against the HTTP floor: CPU per request, the denominator.

    Beside it, two parts of a snapshot's cost that no server storing it the way
    gpuwatch does can avoid, so what the CPU target leaves for the rest is known: the
    same workload against the floor that also validates every body with the published
    model (``bench/http_floor.py --validate``), and the raw writes of each snapshot's
    rows (``bench.server``'s limit: stdlib sqlite3 ``executemany`` of its key, GPU and
    process rows, :data:`BATCH_PUSHES` snapshots to a transaction, as the ingest writer
    stores them at most), in this process."""
    result = _floor_phase(tmp, template, plan, validate=False)
    print(f"   floor: {result['server_cpu_ms_per_request']} ms CPU a request", flush=True)
    validation = _floor_phase(tmp, template, plan, validate=True)
    result["validation"] = {
        key: validation[key]
        for key in ("server_cpu_ms_per_request", "snapshots_per_second", "p50_ms", "p99_ms",
                    "statuses")
    }  # fmt: skip
    result["raw_write_cpu_ms_per_snapshot"] = raw_write_ms(tmp, plan.fleet)
    result["raw_write_snapshots_per_transaction"] = BATCH_PUSHES
    floor = result["server_cpu_ms_per_request"]
    unavoidable = validation["server_cpu_ms_per_request"] + result["raw_write_cpu_ms_per_snapshot"]
    result["unavoidable_ratio_to_floor"] = round(unavoidable / floor, 2)
    print(
        f"   floor with validation: {validation['server_cpu_ms_per_request']} ms; raw writes "
        f"{result['raw_write_cpu_ms_per_snapshot']} ms a snapshot; together "
        f"x{result['unavoidable_ratio_to_floor']} the floor",
        flush=True,
    )
    return result


def _floor_phase(tmp: Path, template: Template, plan: Plan, *, validate: bool) -> dict[str, Any]:
    hosts = {f"floor-{i}": "unused" for i in range(plan.fleet)}
    with running_floor(tmp, validate=validate) as client:
        port = port_of(client)
        agents = make_agents(hosts, [port], 0)
        result = sustained(
            template, agents, [server_process(port)], plan, measure=plan.floor_measure
        )
    result["server_cpu_ms_per_request"] = result.pop("server_cpu_ms_per_snapshot")
    return result


def raw_write_ms(tmp: Path, hosts: int) -> float:
    """CPU ms per snapshot of writing the rows of ``hosts`` hosts' snapshots, each
    host's several times over, with nothing else (see :func:`bench_floor`)."""
    snapshots = [
        host_snapshot(f"raw-{host}", sequence, 1_700_000_000.0 + 15.0 * sequence)
        for sequence in range(3)
        for host in range(hosts)
    ]  # built off the clock
    with fresh_database("sqlite", tmp, "raw-writes") as target:
        assert target.path is not None
        raw = RawSqlite(target.path)
        transactions = [
            snapshots[i : i + BATCH_PUSHES] for i in range(0, len(snapshots), BATCH_PUSHES)
        ]
        spent = raw_seconds(raw, transactions, clock=time.process_time)
        raw.close()
    return round(1000 * spent / len(snapshots), 3)


def _ratio(result: dict[str, Any], floor: dict[str, Any] | None) -> None:
    if floor:
        per_request = floor["server_cpu_ms_per_request"]
        result["cpu_ratio_to_floor"] = round(result["server_cpu_ms_per_snapshot"] / per_request, 2)


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['snapshots_per_second']}/s of {r['offered_snapshots_per_second']} offered, "
        f"p50 {r['p50_ms']} p99 {r['p99_ms']} ms, {r['statuses']}, "
        f"{r['server_cpu_ms_per_snapshot']} ms CPU/snapshot (x{r.get('cpu_ratio_to_floor')}), "
        f"generator {r['cpu_share_of_one_core']['generator']} core, "
        f"machine {r['machine_busy_share']}, lateness p99 {r['generator_lateness_p99_ms']} ms"
    )


def bench_profile(tmp: Path, template: Template, plan: Plan, cache_hosts: int) -> dict[str, Any]:
    """The SQLite sustained phase with the server under py-spy. The hosts are warmed
    through a server of their own first, so the profile holds the server's start-up
    (left out), the ramp and the measured window, not the warm-up."""
    if not pyspy_available():
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    raw = tmp / "profile.txt"
    env = server_env(plan, cache_hosts)
    with fresh_database("sqlite", tmp, "profile") as target:
        tokens = make_tokens(target, [f"prof-{i}" for i in range(plan.fleet)])
        agents = make_agents(tokens, [0], 0)
        set_phases(target, agents)
        with running_server(target, tmp, env=env) as client:
            _warm_fleet(template, agents, [], plan, client)
        with profiled_server(target, tmp, env, raw) as client:
            result = _sustained_on([client], template, agents, plan)
    result["profile"] = summarize_profile(raw) if raw.exists() else "py-spy wrote no profile"
    return result


# --- agent RSS -----------------------------------------------------------------------------------


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


# What the agent process imports, in steps, each measured in one fresh Python: where
# its RSS goes. The last step is the fake NVML library, absent on a GPU host.
IMPORT_STEPS = (
    ("python", ()),
    ("pydantic", ("pydantic",)),
    ("prometheus_client", ("prometheus_client",)),
    ("typer", ("typer",)),
    ("gpuwatch CLI, the agent command registered", ("gpuwatch.cli",)),
    ("agent modules", ("gpuwatch.agent.assemble", "gpuwatch.agent.reporter",
                       "gpuwatch.agent.exporter")),
    ("fake NVML library", ("gpuwatch.nvml.fake", "gpuwatch.nvml.fake.library")),
)  # fmt: skip


def import_steps() -> dict[str, int]:
    """RSS after each of :data:`IMPORT_STEPS`, cumulative, in one fresh Python."""
    probe = (
        "import importlib, json, re, sys\n"
        "def rss(): return int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status')"
        ".read()).group(1)) * 1024\n"
        "out = {}\n"
        "for name, modules in json.loads(sys.argv[1]):\n"
        "    for m in modules: importlib.import_module(m)\n"
        "    if 'gpuwatch.cli' in modules: importlib.import_module('gpuwatch.cli')._register_for(['agent'])\n"
        "    out[name] = rss()\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(IMPORT_STEPS)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def bench_agent_rss(tmp: Path, plan: Plan, scenario: str = "h100x8") -> dict[str, Any]:
    """A real ``gpuwatch agent`` (which needs NVML: on a machine without it, the fake
    GPUs) scraped ``plan.scrapes`` times, its RSS sampled every 100 scrapes; and the
    fake library's share of it, from the import floors with and without it."""
    import httpx

    from bench.agent import _free_port, _wait_http

    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp), "GPUWATCH_CONFIG": "/dev/null"}
    port = _free_port()
    no_nvml = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "agent", "--listen", f"127.0.0.1:{_free_port()}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatch",
            "agent",
            "--fake-gpus",
            scenario,
            "--listen",
            f"127.0.0.1:{port}",
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    samples: list[tuple[int, int]] = []
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        _wait_http(f"http://127.0.0.1:{port}/healthz")
        with httpx.Client() as client:
            client.get(url)
            samples.append((0, _rss(agent.pid)))
            for n in range(1, plan.scrapes + 1):
                client.get(url).raise_for_status()
                if n % 100 == 0:
                    samples.append((n, _rss(agent.pid)))
    finally:
        terminate(agent, grace_seconds=20)
        subprocess.run(
            [sys.executable, "-m", "gpuwatch", "fake-nvml", "stop", "--all"],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
    steps = import_steps()
    without_fake, with_fake = steps["agent modules"], steps["fake NVML library"]
    rss = [r for _, r in samples]
    half = samples[len(samples) // 2 :]
    return {
        "scenario": scenario,
        "without_nvml": {
            "exit_code": no_nvml.returncode,
            "message": no_nvml.stderr.strip().splitlines()[-1] if no_nvml.stderr else "",
        },
        "scrapes": plan.scrapes,
        "rss_start_bytes": rss[0],
        "rss_peak_bytes": max(rss),
        "rss_end_bytes": rss[-1],
        "slope_bytes_per_1000_scrapes_second_half": round(_slope(half) * 1000),
        "slope_bytes_per_1000_scrapes_all": round(_slope(samples) * 1000),
        "import_floor_bytes": {"without_fake": without_fake, "with_fake": with_fake},
        "import_steps_bytes": steps,
        "fake_library_bytes": with_fake - without_fake,
        "rss_end_without_fake_estimate_bytes": rss[-1] - (with_fake - without_fake),
        "samples": samples[:: max(1, len(samples) // 20)],
    }


def _slope(points: Sequence[tuple[int, int]]) -> float:
    """Least-squares bytes per scrape."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


# --- main -------------------------------------------------------------------------------------------


def _holds(phase: dict[str, Any]) -> bool:
    """Accepted what was offered (2% slack: pushes in flight at the window's edges), at
    p99 under the target, answering only 200 and 503."""
    return (
        phase["snapshots_per_second"] >= 0.98 * phase["offered_snapshots_per_second"]
        and phase["snapshots_per_second"] >= 0.98 * TARGETS["sqlite_snapshots_per_second"]
        and (phase["p99_ms"] or 1e9) < TARGETS["p99_ms"]
        and phase["only_200_and_503"]
    )


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    """Each target, its figure and whether it was met."""
    out: dict[str, Any] = {}
    for phase in ("sqlite", "postgres"):
        if "error" in result.get(phase, {}):
            out[f"{phase}_completed"] = {"error": result[phase]["error"], "met": False}
    sqlite = result.get("sqlite", {}).get("one_server")
    if sqlite:
        out["sqlite_3000_hosts"] = {
            "snapshots_per_second": sqlite["snapshots_per_second"],
            "p99_ms": sqlite["p99_ms"],
            "met": _holds(sqlite),
        }
    default = result.get("sqlite", {}).get("one_server_default_cache")
    if default:
        out["sqlite_3000_hosts_default_cache"] = {
            "snapshots_per_second": default["snapshots_per_second"],
            "p99_ms": default["p99_ms"],
            "met": _holds(default),
        }
    for kind in ("sqlite", "postgres"):
        one = result.get(kind, {}).get("one_server", {})
        if "cpu_ratio_to_floor" in one:
            out[f"{kind}_cpu_ratio"] = {
                "ratio": one["cpu_ratio_to_floor"],
                "met": one["cpu_ratio_to_floor"] <= TARGETS["cpu_ratio_to_floor"],
            }
    two = result.get("postgres", {}).get("two_replicas")
    if two and sqlite:
        out["postgres_two_replicas_at_least_sqlite"] = {
            "snapshots_per_second": two["snapshots_per_second"],
            "p99_ms": two["p99_ms"],
            # The SQLite target, and no slower than the one SQLite server.
            "met": _holds(two)
            and two["snapshots_per_second"] >= 0.98 * sqlite["snapshots_per_second"],
        }
    storm_result = result.get("sqlite", {}).get("storm")
    if storm_result:
        seconds = storm_result["drain_seconds"]
        out["storm_drain"] = {
            "seconds": seconds,
            "met": seconds is not None and seconds <= TARGETS["storm_drain_seconds"]
            and storm_result["storm_requests"]["only_200_and_503"]
            and storm_result["live"]["only_200_and_503"],
        }  # fmt: skip
    rss = result.get("agent_rss")
    if rss:
        estimate = rss["rss_end_without_fake_estimate_bytes"]
        out["agent_rss"] = {
            "bytes_without_fake": estimate,
            "slope_bytes_per_1000_scrapes": rss["slope_bytes_per_1000_scrapes_second_half"],
            "met": estimate <= TARGETS["agent_rss_bytes"]
            and rss["slope_bytes_per_1000_scrapes_second_half"]
            <= TARGETS["agent_rss_slope_bytes_per_1000_scrapes"],
        }
    return out


def main(argv: Sequence[str] = ()) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a ~2 minute smoke run")
    parser.add_argument("--only", nargs="*", choices=PHASES, default=None,
                        help="phases to run (default: all but profile)")  # fmt: skip
    parser.add_argument("--state-cache-hosts", type=int, default=STATE_CACHE_HOSTS,
                        help="the servers' state_cache_hosts (default %(default)s: the fleet"
                        " and the returning hosts fit)")  # fmt: skip
    args = parser.parse_args(list(argv))
    plan = QUICK if args.quick else FULL
    phases = set(args.only or PHASES[:-1])
    result: dict[str, Any] = {"plan": plan.__dict__, "targets": TARGETS}
    result["state_cache_hosts"] = args.state_cache_hosts
    template = Template()
    check_framing(template)
    result["body_bytes_per_snapshot"] = len(template.render("sqlite-0", 1, time.time()))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-load-") as tmp_dir:
        tmp = Path(tmp_dir)
        floor = None
        if phases & {"sqlite", "postgres", "storm"}:
            print("-- floor", flush=True)
            floor = result["floor"] = bench_floor(tmp, template, plan)
        if phases & {"sqlite", "storm"}:
            print("-- sqlite", flush=True)
            result["sqlite"] = bench_database(
                "sqlite", tmp, template, plan, floor, cache_hosts=args.state_cache_hosts,
                default_cache_too="sqlite" in phases and args.state_cache_hosts != STATE_CACHE_HOSTS,
                with_storm="storm" in phases,
                replicas=False,
            )  # fmt: skip
        skipped = postgres_unavailable()
        if "postgres" in phases and skipped is None:
            print("-- postgres", flush=True)
            result["postgres"] = bench_database(
                "postgres", tmp, template, plan, floor, cache_hosts=args.state_cache_hosts,
                default_cache_too=False, with_storm=False, replicas=True,
            )  # fmt: skip
        elif skipped:
            result["postgres_skipped"] = skipped
        if "profile" in phases:
            print("-- profile (sqlite, under py-spy)", flush=True)
            result["profile_sqlite"] = bench_profile(tmp, template, plan, args.state_cache_hosts)
        if "rss" in phases:
            print("-- agent rss", flush=True)
            result["agent_rss"] = bench_agent_rss(tmp / "agent", plan)
    result["verdicts"] = verdicts(result)
    result["total_seconds"] = round(time.monotonic() - started)
    path = write_result("load-quick" if args.quick else "load", result)
    print(json.dumps(result["verdicts"], indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
