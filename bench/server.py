"""Server benchmark: ingest throughput, the fleet summary's latency, storage per host.

Each snapshot is one host of 8 GPUs and 50 processes (the agent benchmark's "big" shape
without its 200 processes per GPU). Hosts are distinct (own agent, boot and token),
sequences rise 15 s apart, and processes persist from snapshot to snapshot, so ingest
updates lifetimes rather than creating them; one process per host is replaced every
``CHURN_EVERY`` snapshots, so some lifetimes end and start too. Before anything is
timed, every host pushes an hour of history (``WARM_HISTORY``, untimed): the steady
state has full one-hour trend windows for the idle and leak detectors to read, which a
fresh host lacks. Request bodies are serialised before any clock starts, and the
server is ``gpuwatch server`` (default settings, scheduler off) in its own process,
spoken to over loopback HTTP with httpx, one request at a time as an agent sends them.
Reported, each next to a baseline measured side by side in the same run:

* ingest: snapshots/s end to end, on SQLite and on Postgres, at 1, 10 and 100 snapshots
  per request, against the limit: the stdlib ``sqlite3`` (or psycopg) ``executemany``
  of one row per process, one per GPU and the snapshot key into the same tables, one
  transaction per batch. Rounds alternate between the two. Also recorded: the rows the
  server itself writes per snapshot, counted from its SQL, single-snapshot ingest
  with ``CONCURRENT_CLIENTS`` agents pushing at once, and on SQLite the share of the
  timed seconds the server's writers held the write lock (from its own
  ``gpuwatch_server_write_turn_held_seconds_total``). Targets: >= 0.3x the limit, and
  >= 300 snapshots/s on SQLite for single-snapshot requests.
* the HTTP floor: the same single-snapshot requests to ``bench/http_floor.py`` (the
  same uvicorn, an app that reads the body and answers), against the same limit: what
  the HTTP stack alone allows before the server does any work.
* fleet: median latency of ``GET /api/v1/fleet`` at 1,000 hosts populated through
  ingest, against ``GET /healthz`` on the same server (the HTTP floor), requests
  alternating. Target: <= 50 ms.
* storage: bytes the database grows per host per day at the default 15 s push
  interval, extrapolated linearly from one measured hour (see :func:`bench_storage`).
* compare (``--compare REF``, optional): ingest at 1 and at 100 snapshots per request
  of the code at git ``REF`` against this checkout, in alternating rounds: a
  before/after figure.

Run: ``./dev bench server`` or ``.venv/bin/python -m bench server``; with a comparison,
``.venv/bin/python -m bench.server --compare HEAD~1``. Postgres parts need the server at
``GPUWATCH_BENCH_POSTGRES`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``)
and are skipped, saying so in the results, when it is unreachable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import terminate, write_result

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_URL = os.environ.get(
    "GPUWATCH_BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
INGEST = "/api/v1/snapshots"

GPUS = 8
PROCS = 50
INTERVAL = 15.0  # the agents' default push interval, seconds
CHURN_EVERY = 20  # snapshots between two process replacements on a host
GIB = 2**30
MIB = 2**20

# Snapshots every host pushes (in batches of 100, untimed) before it is measured: a
# little over the one-hour trend window, max(idle_window, leak_min_duration).
WARM_HISTORY = 250
# Ingest: batch size -> (hosts, requests per host per round). Rounds alternate with
# the limit; each round is 200-300 snapshots, fresh ones (a resend would be a duplicate).
ROUNDS = 4  # even: each side runs first in half of them (in_turn)
INGEST_SHAPES = {1: (5, 40), 10: (5, 4), 100: (2, 1)}
# The single-snapshot shape again with this many agents pushing at once (a thread and a
# connection each, hosts split between them): what one server process sustains, where
# the sequential figure is bounded by one request's latency.
CONCURRENT_CLIENTS = 4
CONCURRENT_SHAPE = (8, 25)
FLEET_HOSTS = 1000
FLEET_SNAPSHOTS = 3  # per host: the fewest 15 s buckets that prove the 30 s idle window below
FLEET_REQUESTS = 60  # of each endpoint, alternating
STORAGE_HOSTS = 8
STORAGE_WARM = 280  # snapshots per host (70 min): recent windows reach their 1 h size
STORAGE_MEASURED = 240  # snapshots per host (the measured hour)
STORAGE_BATCH = 8
COMPARE_ROUNDS = 4  # even, as ROUNDS
# Batch size -> (hosts, requests per host per round): single pushes and a spool drain.
COMPARE_SHAPES = {1: (10, 15), 100: (2, 1)}

_OWNERS: dict[int, Any] = {}
_HOST_NUMBERS: dict[str, int] = {}  # hostname -> a small int, for the baseline's ids


# --- the workload -------------------------------------------------------------------------


def host_snapshot(host: str, sequence: int, at: float) -> Any:
    """Snapshot ``sequence`` of ``host``, collected at ``at``: 8 GPUs, 50 processes.

    Process slot ``s`` runs on GPU ``s % 8``; one slot gets a new process (new pid and
    start time) every ``CHURN_EVERY`` snapshots, staggered, so a process lives
    ``CHURN_EVERY * PROCS`` snapshots (about 4 h). Every fifth process's memory moves
    (a 16 MiB sawtooth over eight minutes, never a leak); the others hold steady, as
    trained models do. Every tenth process computes nothing (an idle holder once the
    window is long enough) and every 25th is orphaned.
    """
    from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

    life = CHURN_EVERY * PROCS
    per_gpu: list[list[GpuProcess]] = [[] for _ in range(GPUS)]
    for slot in range(PROCS):
        generation = (sequence + slot * CHURN_EVERY) // life
        born = generation * life - slot * CHURN_EVERY  # first sequence of this process
        pid = 10_000 + slot + 100 * generation
        owner = _OWNERS.get(slot % 7)
        if owner is None:
            owner = _OWNERS[slot % 7] = ProcessOwner(user=f"user{slot % 7}", uid=1000 + slot % 7)
        per_gpu[slot % GPUS].append(
            GpuProcess(
                pid=pid,
                used_bytes=(1 + slot % 5) * GIB + (slot % 5 == 0) * (sequence // 4 % 8) * 16 * MIB,
                sm_ratio=0.0 if slot % 10 == 0 else 0.25 + (slot % 3) / 4,
                name="python",
                command=f"/opt/conda/bin/python -m torch.distributed.run train.py --run {pid}",
                start_time=max(0.0, at - (sequence - born) * INTERVAL - 3.0),
                ppid=1 if slot % 25 == 0 else 900,
                orphaned=slot % 25 == 0,
                owner=owner,
            )
        )
    gpus = []
    for index, processes in enumerate(per_gpu):
        held = sum(p.used_bytes or 0 for p in processes)
        used = held + 512 * MIB  # below unattributed_min_bytes: no unattributed event
        gpus.append(
            Gpu(
                index=index,
                uuid=f"GPU-{host}-{index:02d}",
                name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"00000000:{index + 0x18:02X}:00.0",
                memory_total_bytes=80 * GIB,
                memory_used_bytes=used,
                memory_free_bytes=80 * GIB - used,
                utilization_ratio=0.5,
                temperature_celsius=55.0,
                power_watts=300.0,
                power_limit_watts=700.0,
                unattributed_bytes=used - held,
                processes=processes,
            )
        )
    return HostSnapshot(
        agent_id=f"agent-{host}",
        hostname=host,
        boot_id=f"boot-{host}",
        sequence=sequence,
        collected_at=at,
        poll_duration_seconds=0.05,
        driver_version="550.54.15",
        nvml_version="12.550.54.15",
        cuda_driver_version="12.4",
        gpus=gpus,
    )


@dataclass(frozen=True)
class Push:
    """One request: a host's consecutive snapshots, serialised."""

    headers: dict[str, str]
    body: bytes
    snapshots: list[Any]  # the HostSnapshot models, for the baseline's rows


def pushes(
    hosts: dict[str, str], *, first: int, per_host: int, batch: int, base: float
) -> list[Push]:
    """``per_host`` requests of ``batch`` snapshots for each host (``hosts``: name ->
    token), interleaved host by host; sequences from ``first``, sequence ``s``
    collected at ``base + s * INTERVAL``."""
    out = []
    for k in range(per_host):
        for host, token in hosts.items():
            seqs = range(first + k * batch, first + (k + 1) * batch)
            snaps = [host_snapshot(host, s, base + s * INTERVAL) for s in seqs]
            body = b'{"snapshots":[' + b",".join(s.model_dump_json().encode() for s in snaps)
            out.append(
                Push(
                    headers={
                        "Authorization": f"Bearer {token}",
                        "Content-Type": "application/json",
                    },
                    body=body + b"]}",
                    snapshots=snaps,
                )
            )
    return out


def warm_up(client: httpx.Client, hosts: dict[str, str], *, base: float) -> None:
    """Push each host's first ``WARM_HISTORY`` snapshots, untimed, in batches of 100."""
    for first in range(0, WARM_HISTORY, 100):
        batch = min(100, WARM_HISTORY - first)
        send(client, pushes(hosts, first=first, per_host=1, batch=batch, base=base))


def warmed_rounds(
    client: httpx.Client, hosts: dict[str, str], *, batch: int, per_round: int, count: int
) -> list[list[Push]]:
    """Warm the hosts up (:func:`warm_up`), then build ``count`` rounds of ``per_round``
    requests of ``batch`` snapshots per host, continuing each host's history, due now."""
    per_host = per_round * batch
    base = history_base(WARM_HISTORY + count * per_host)
    warm_up(client, hosts, base=base)
    return [
        pushes(hosts, first=WARM_HISTORY + r * per_host, per_host=per_round, batch=batch, base=base)
        for r in range(count)
    ]


def history_base(snapshots: int) -> float:
    """The ``base`` that makes a host's snapshot number ``snapshots`` fall due now."""
    return time.time() - snapshots * INTERVAL


def send(client: httpx.Client, requests: Sequence[Push]) -> float:
    """POST each request in turn, as agents do; return the seconds it took. Every
    snapshot must be accepted (a duplicate would mean the workload is wrong)."""
    replies = []
    began = time.perf_counter()
    for push in requests:
        replies.append(client.post(INGEST, content=push.body, headers=push.headers))
    elapsed = time.perf_counter() - began
    for push, reply in zip(requests, replies, strict=True):
        if reply.status_code != 200 or reply.json()["accepted"] != len(push.snapshots):
            raise RuntimeError(f"ingest answered {reply.status_code}: {reply.text[:300]}")
    return elapsed


def send_concurrently(client: httpx.Client, requests: Sequence[Push], clients: int) -> float:
    """:func:`send` from ``clients`` threads at once, each with its own connection and
    its own hosts (so each host's snapshots still arrive in order); the seconds until
    the last is answered."""
    by_thread: list[list[Push]] = [[] for _ in range(clients)]
    owner: dict[str, int] = {}
    for push in requests:
        token = push.headers["Authorization"]
        by_thread[owner.setdefault(token, len(owner) % clients)].append(push)
    connections = [httpx.Client(base_url=client.base_url, timeout=120) for _ in range(clients)]
    errors: list[BaseException] = []

    def run(connection: httpx.Client, part: list[Push]) -> None:
        try:
            send(connection, part)
        except BaseException as err:  # reported below, on the main thread
            errors.append(err)

    threads = [
        threading.Thread(target=run, args=(connection, part))
        for connection, part in zip(connections, by_thread, strict=True)
    ]
    try:
        for connection in connections:
            connection.get("/healthz")  # connect before the clock starts
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - began
    finally:
        for connection in connections:
            connection.close()
    if errors:
        raise errors[0]
    return elapsed


# --- databases and servers -------------------------------------------------------------------


@dataclass
class Target:
    """A fresh, migrated database the server under test uses."""

    kind: str  # "sqlite" or "postgres"
    url: str
    path: Path | None = None  # the SQLite file
    schema: str | None = None  # the Postgres schema

    def database(self) -> Any:
        from gpuwatch.server.database import create_database

        return create_database(self.url)


@contextlib.contextmanager
def fresh_database(kind: str, tmp: Path, name: str, *, migrate: bool = True) -> Iterator[Target]:
    """A migrated SQLite file, or a migrated schema of its own on Postgres (dropped
    afterwards). Unmigrated with ``migrate=False``: the server migrates it on start."""
    from gpuwatch.server.database.migrate import upgrade

    if kind == "sqlite":
        path = tmp / f"{name}.db"
        target = Target(kind, f"sqlite:///{path}", path=path)
        if migrate:
            _migrate(target, upgrade)
        yield target
        return
    from sqlalchemy import create_engine, text

    schema = f"gwbench_{name}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        target = Target(kind, f"{POSTGRES_URL}?options=-csearch_path%3D{schema}", schema=schema)
        if migrate:
            _migrate(target, upgrade)
        yield target
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def _migrate(target: Target, upgrade: Callable[[Any], None]) -> None:
    database = target.database()
    try:
        upgrade(database)
    finally:
        database.dispose()


def postgres_unavailable() -> str | None:
    """Why Postgres cannot be used, or None when it can."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    try:
        engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect():
            pass
        engine.dispose()
    except (OperationalError, ImportError) as err:
        return f"Postgres unreachable at {POSTGRES_URL}: {str(err).splitlines()[0]}"
    return None


def make_tokens_with(code: Path, target: Target, hostnames: Sequence[str]) -> dict[str, str]:
    """A token per host made by ``gpuwatch token create`` of the tree at ``code``, so
    the rows fit that code's schema (one process per host: only for a comparison)."""
    env = {**os.environ, "PYTHONPATH": str(code), "GPUWATCH_CONFIG": "/dev/null"}
    tokens = {}
    for name in hostnames:
        done = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "token", "create", name, "--database-url", target.url],
            cwd=code, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        tokens[name] = done.stdout.strip().splitlines()[-1]
    return tokens


def make_tokens(target: Target, hostnames: Sequence[str]) -> dict[str, str]:
    """A token per host (creating the hosts), in one transaction."""
    from gpuwatch.server.auth import service as auth_service

    database = target.database()
    try:
        with database.writer() as session, session.begin():
            return {
                name: auth_service.create_token(session=session, hostname=name, now=time.time())
                for name in hostnames
            }
    finally:
        database.dispose()


@contextlib.contextmanager
def running_server(
    target: Target, logs: Path, *, code: Path = ROOT, env: dict[str, str] | None = None
) -> Iterator[httpx.Client]:
    """``gpuwatch server`` from the tree at ``code`` on ``target``; a client for it.

    The scheduler is off, so no retention or silence job runs during a measurement.
    """
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "GPUWATCH_CONFIG": "/dev/null",
        "GPUWATCH_SERVER_DATABASE_URL": target.url,
        "GPUWATCH_SERVER_DATA_DIR": str(logs),
        "GPUWATCH_SERVER_SCHEDULER": "false",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "gpuwatch", "server", "--listen", "127.0.0.1:0"]
    with _serving(argv, cwd=code, env=env, logs=logs) as client:
        yield client


@contextlib.contextmanager
def running_floor(logs: Path, *, validate: bool = False) -> Iterator[httpx.Client]:
    """``bench/http_floor.py``: the same uvicorn, with an app that does no work (with
    ``validate``, none but validating the body)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "bench.http_floor", *(["--validate"] if validate else [])]
    with _serving(argv, cwd=ROOT, env=env, logs=logs) as client:
        yield client


@contextlib.contextmanager
def _serving(
    argv: list[str], *, cwd: Path, env: dict[str, str], logs: Path
) -> Iterator[httpx.Client]:
    """Start ``argv`` (which logs ``listening on URL`` to stderr); a client once its
    ``/healthz`` answers 200; SIGTERM on the way out."""
    log_path = logs / f"server-{uuid.uuid4().hex[:8]}.log"
    with open(log_path, "w") as log:
        # cwd: ``python -m`` puts the working directory first on sys.path.
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        base = _wait_listening(proc, log_path)
        with httpx.Client(base_url=base, timeout=120) as client:
            deadline = time.monotonic() + 30
            while not _healthy(client):
                if time.monotonic() > deadline:
                    raise RuntimeError("the server's /healthz never answered 200")
                time.sleep(0.1)
            yield client
    finally:
        terminate(proc, grace_seconds=30)


def _healthy(client: httpx.Client) -> bool:
    # The socket is bound before "listening on" is logged, but uvicorn calls listen()
    # only once the app has started: until then a connection is refused.
    try:
        return client.get("/healthz").status_code == 200
    except httpx.ConnectError:
        return False


def _wait_listening(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log_path.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"gpuwatch server exited: {log_path.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError("gpuwatch server did not start")


# --- the limit: the same rows, inserted raw ----------------------------------------------------


def baseline_rows(snapshots: Sequence[Any]) -> tuple[list[tuple[Any, ...]], ...]:
    """The key, one GPU row per GPU and one process row per process of each snapshot,
    in the shapes of ``snapshots_seen``, ``gpu_samples`` and ``process_samples``."""
    seen, gpu_rows, process_rows = [], [], []
    for snap in snapshots:
        host = _HOST_NUMBERS.setdefault(snap.hostname, len(_HOST_NUMBERS))
        seen.append((snap.agent_id, snap.boot_id, snap.sequence, host, snap.collected_at, 0.0))
        for gpu in snap.gpus:
            gpu_rows.append(
                (
                    host * 64 + gpu.index,
                    snap.collected_at,
                    gpu.memory_used_bytes,
                    gpu.memory_total_bytes,
                    gpu.unattributed_bytes,
                )
            )
            for p in gpu.processes:
                process_rows.append(
                    (
                        host * 2**23 + p.pid,
                        snap.collected_at,
                        p.used_bytes,
                        p.used_bytes,
                        p.sm_ratio,
                    )
                )
    return seen, gpu_rows, process_rows


_SEEN_SQL = (
    "INSERT INTO snapshots_seen (agent_id, boot_id, sequence, host_id, collected_at,"
    " received_at) VALUES ({0}, {0}, {0}, {0}, {0}, {0})"
)
_GPU_SQL = (
    "INSERT INTO gpu_samples (gpu_id, t, used_bytes, total_bytes, unattributed_bytes)"
    " VALUES ({0}, {0}, {0}, {0}, {0})"
)
_PROCESS_SQL = (
    "INSERT INTO process_samples (lifetime_id, t, used_bytes, peak_bytes, sm_ratio)"
    " VALUES ({0}, {0}, {0}, {0}, {0})"
)


class RawSqlite:
    """stdlib sqlite3 into a file migrated like the server's, with the server's pragmas
    (WAL, synchronous=NORMAL). Foreign keys are off (sqlite3's default): the rows have
    no parents, and the limit does not check them."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.sql = [s.format("?") for s in (_SEEN_SQL, _GPU_SQL, _PROCESS_SQL)]

    def insert(self, batch: tuple[list[tuple[Any, ...]], ...]) -> None:
        self.conn.execute("BEGIN")
        for sql, rows in zip(self.sql, batch, strict=True):
            self.conn.executemany(sql, rows)
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


class RawPostgres:
    """psycopg into copies of the three tables (``LIKE ... INCLUDING ALL``: same
    columns, keys and indexes, no foreign keys) in a schema of their own."""

    def __init__(self, target: Target) -> None:
        import psycopg

        self.schema = f"{target.schema}_raw"
        dsn = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute(f'CREATE SCHEMA "{self.schema}"')
        for table in ("snapshots_seen", "gpu_samples", "process_samples"):
            self.conn.execute(
                f'CREATE TABLE "{self.schema}".{table}'
                f' (LIKE "{target.schema}".{table} INCLUDING ALL)'
            )
        self.conn.execute(f'SET search_path TO "{self.schema}"')
        self.conn.autocommit = False
        self.sql = [s.format("%s") for s in (_SEEN_SQL, _GPU_SQL, _PROCESS_SQL)]

    def insert(self, batch: tuple[list[tuple[Any, ...]], ...]) -> None:
        with self.conn.cursor() as cursor:
            for sql, rows in zip(self.sql, batch, strict=True):
                cursor.executemany(sql, rows)
        self.conn.commit()

    def close(self) -> None:
        self.conn.autocommit = True
        self.conn.execute(f'DROP SCHEMA "{self.schema}" CASCADE')
        self.conn.close()


def in_turn(round_index: int, sides: tuple[str, str]) -> tuple[str, str]:
    """The order two measurements take in round ``round_index``: swapped every other
    round. On this VM the position in a round moved a comparison by more than any
    change under test (the same two trees read 0.90x in one fixed order and 1.17x in
    the other), so a fixed order biases the ratio."""
    return sides if round_index % 2 == 0 else (sides[1], sides[0])


def raw_seconds(
    raw: RawSqlite | RawPostgres,
    transactions: Sequence[Sequence[Any]],
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds by ``clock`` to write the baseline rows of each list of snapshots in
    ``transactions``, one transaction each (the rows are built off the clock)."""
    batches = [baseline_rows(snapshots) for snapshots in transactions]
    began = clock()
    for batch in batches:
        raw.insert(batch)
    return clock() - began


# --- (a) ingest ---------------------------------------------------------------------------------


def bench_ingest(kind: str, tmp: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        target = stack.enter_context(fresh_database(kind, tmp, "ingest"))
        client = stack.enter_context(running_server(target, tmp))
        raw: RawSqlite | RawPostgres
        if kind == "sqlite":
            raw_target = stack.enter_context(fresh_database(kind, tmp, "raw"))
            assert raw_target.path is not None
            raw = RawSqlite(raw_target.path)
        else:
            raw = RawPostgres(target)
        try:
            for batch, (hosts, per_round) in INGEST_SHAPES.items():
                result[f"batch_{batch}"] = _ingest_one_shape(
                    target, client, raw, batch=batch, hosts=hosts, per_round=per_round
                )
            hosts, per_round = CONCURRENT_SHAPE
            result[f"batch_1_{CONCURRENT_CLIENTS}_clients"] = _ingest_one_shape(
                target,
                client,
                raw,
                batch=1,
                hosts=hosts,
                per_round=per_round,
                clients=CONCURRENT_CLIENTS,
            )
            floor = stack.enter_context(running_floor(tmp))
            hosts, per_round = INGEST_SHAPES[1]
            result["http_floor_batch_1"] = _floor_one_shape(
                floor, raw, hosts=hosts, per_round=per_round
            )
        finally:
            raw.close()
    return result


def _floor_one_shape(
    floor: httpx.Client, raw: RawSqlite | RawPostgres, *, hosts: int, per_round: int
) -> dict[str, Any]:
    """Single-snapshot requests of the ingest workload to the HTTP floor, rounds
    alternating with the raw inserts of the same rows: the most any server on this
    HTTP stack could reach, as a ratio to the same limit."""
    names = {f"floor-{i}": "unused" for i in range(hosts)}
    base = history_base(ROUNDS * per_round)
    rounds = [
        pushes(names, first=r * per_round, per_host=per_round, batch=1, base=base)
        for r in range(ROUNDS)
    ]
    send(floor, rounds[0][:20])  # connect and warm up, untimed
    return _against_limit(rounds, raw, lambda requests: send(floor, requests))


def _against_limit(
    rounds: Sequence[list[Push]],
    raw: RawSqlite | RawPostgres,
    post: Callable[[list[Push]], float],
) -> dict[str, float]:
    """Each round through ``post`` (returning its seconds) and as raw inserts of the
    same rows, the two in turn (:func:`in_turn`); the median rates of both and their
    ratio."""
    rates: dict[str, list[float]] = {"e2e": [], "raw": []}
    measure = {
        "e2e": post,
        "raw": lambda requests: raw_seconds(raw, [push.snapshots for push in requests]),
    }
    for r, requests in enumerate(rounds):
        n = sum(len(p.snapshots) for p in requests)
        for side in in_turn(r, ("e2e", "raw")):
            rates[side].append(n / measure[side](requests))
    rate, raw_rate = statistics.median(rates["e2e"]), statistics.median(rates["raw"])
    return {
        "snapshots_per_second": round(rate, 1),
        "raw_insert_snapshots_per_second": round(raw_rate, 1),
        "ratio_to_raw_insert": round(rate / raw_rate, 3),
    }


def _ingest_one_shape(
    target: Target,
    client: httpx.Client,
    raw: RawSqlite | RawPostgres,
    *,
    batch: int,
    hosts: int,
    per_round: int,
    clients: int = 1,
) -> dict[str, Any]:
    tokens = make_tokens(target, [f"b{batch}x{clients}-{i}" for i in range(hosts)])
    rounds = warmed_rounds(client, tokens, batch=batch, per_round=per_round, count=ROUNDS)

    timed = {"seconds": 0.0, "held": 0.0}
    sqlite = target.kind == "sqlite"  # Postgres writers take no turns, so hold none

    def post(requests: list[Push]) -> float:
        held = writer_held_seconds(client) if sqlite else 0.0
        if clients == 1:
            seconds = send(client, requests)
        else:
            seconds = send_concurrently(client, requests, clients)
        if sqlite:
            timed["held"] += writer_held_seconds(client) - held
        timed["seconds"] += seconds
        return seconds

    result = {
        "clients": clients,
        "hosts": hosts,
        "snapshots": sum(len(p.snapshots) for requests in rounds for p in requests),
        "body_bytes_per_snapshot": round(len(rounds[0][0].body) / batch),
        **_against_limit(rounds, raw, post),
    }
    if sqlite:
        # How much of the time the one SQLite writer was busy: the rest went to HTTP,
        # validation and the reply, outside the write lock.
        result["writer_busy_share"] = round(timed["held"] / timed["seconds"], 2)
    return result


def writer_held_seconds(client: httpx.Client) -> float:
    """An SQLite server's ``gpuwatch_server_write_turn_held_seconds_total``."""
    found = re.search(
        r"^gpuwatch_server_write_turn_held_seconds_total (\S+)$",
        client.get("/metrics").text,
        re.MULTILINE,
    )
    if found is None:
        raise RuntimeError("the server's /metrics has no write_turn_held_seconds_total")
    return float(found.group(1))


def count_server_writes(tmp: Path) -> dict[str, Any]:
    """Rows the server's ingest writes per snapshot in steady state, from its own SQL
    (run in this process on a scratch SQLite file, single-snapshot requests)."""
    from sqlalchemy import event

    from gpuwatch.server.auth import service as auth_service
    from gpuwatch.server.ingest import service
    from gpuwatch.settings import ServerSettings
    from gpuwatch.wire import IngestRequest

    warm, measured = WARM_HISTORY, 80
    with fresh_database("sqlite", tmp, "count") as target:
        settings = ServerSettings.model_validate({"data_dir": tmp, "database_url": target.url})
        token = make_tokens(target, ["count-0"])["count-0"]
        database = target.database()
        with database.reader() as session:
            identity = auth_service.authenticate_agent(session=session, token=token)
        assert identity is not None
        counts: Counter[str] = Counter()
        statement_re = re.compile(r"^\s*(INSERT|UPDATE|DELETE)\s+(?:INTO\s+)?(\w+)", re.I)

        def on_execute(
            _conn: Any, _cursor: Any, statement: str, params: Any, _ctx: Any, many: bool
        ) -> None:
            found = statement_re.match(statement)
            if found:
                verb, table = found.group(1).lower(), found.group(2)
                counts[f"{table} {verb}"] += len(params) if many else 1

        base = history_base(warm + measured)
        try:
            for seq in range(warm + measured):
                if seq == warm:
                    event.listen(database.engine, "before_cursor_execute", on_execute)
                snap = host_snapshot("count-0", seq, base + seq * INTERVAL)
                with database.writer() as session:
                    service.ingest_snapshots(
                        session=session,
                        dialect="sqlite",
                        host_id=identity.host_id,
                        request=IngestRequest.model_validate({"snapshots": [snap]}),
                        settings=settings,
                        now=snap.collected_at,
                    )
                    session.commit()
        finally:
            database.dispose()
    per_snapshot = {k: round(v / measured, 2) for k, v in sorted(counts.items())}
    return {
        "rows_written_per_snapshot": round(sum(counts.values()) / measured, 1),
        "by_table": per_snapshot,
        "baseline_rows_per_snapshot": 1 + GPUS + PROCS,
    }


# --- (b) the fleet summary ------------------------------------------------------------------------


def bench_fleet(kind: str, tmp: Path) -> dict[str, Any]:
    # A short idle window (and buckets to match), so FLEET_SNAPSHOTS per host open idle
    # events through ingest and the summary has top idle holders to rank.
    env = {
        "GPUWATCH_SERVER_IDLE_WINDOW_SECONDS": "30",
        "GPUWATCH_SERVER_SAMPLE_INTERVAL_SECONDS": "15",
    }
    with fresh_database(kind, tmp, "fleet") as target:
        tokens = make_tokens(target, [f"fleet-{i}" for i in range(FLEET_HOSTS)])
        with running_server(target, tmp, env=env) as client:
            began = time.perf_counter()
            requests = pushes(
                tokens,
                first=0,
                per_host=1,
                batch=FLEET_SNAPSHOTS,
                base=history_base(FLEET_SNAPSHOTS),
            )
            send(client, requests)
            populate_seconds = time.perf_counter() - began
            summary = client.get("/api/v1/fleet").json()
            if summary["hosts"] != FLEET_HOSTS or len(summary["top_idle"]) < 10:
                raise RuntimeError(f"the fleet is not what was ingested: {summary}")
            latency: dict[str, list[float]] = {"fleet": [], "healthz": []}
            for _ in range(FLEET_REQUESTS):
                for name, path in (("healthz", "/healthz"), ("fleet", "/api/v1/fleet")):
                    started = time.perf_counter()
                    client.get(path).raise_for_status()
                    latency[name].append(time.perf_counter() - started)
    fleet_ms = statistics.median(latency["fleet"]) * 1e3
    healthz_ms = statistics.median(latency["healthz"]) * 1e3
    return {
        "hosts": summary["hosts"],
        "gpus": summary["gpus"],
        "open_idle_events_in_top": len(summary["top_idle"]),
        "idle_bytes": summary["idle_bytes"],
        "orphaned_bytes": summary["orphaned_bytes"],
        "populate_seconds": round(populate_seconds, 1),
        "median_ms": {"fleet": round(fleet_ms, 2), "healthz": round(healthz_ms, 2)},
        "p90_ms": {
            name: round(statistics.quantiles(values, n=10)[-1] * 1e3, 2)
            for name, values in latency.items()
        },
        "ratio_fleet_to_healthz": round(fleet_ms / healthz_ms, 2),
    }


# --- (c) storage -------------------------------------------------------------------------------------


def bench_storage(kind: str, tmp: Path) -> dict[str, Any]:
    """Bytes per host per day at the default push interval and default settings.

    ``STORAGE_HOSTS`` hosts push ``STORAGE_WARM`` snapshots each (70 min of agent time),
    which takes every lifetime's recent window (the 1 h trend window) to its steady size
    and every table past its first pages; the database is measured; then one more hour
    (``STORAGE_MEASURED`` snapshots each) is pushed and it is measured again. The growth
    of that hour, per host, times 24 is the daily figure: after warm-up what grows is
    append-only (snapshot keys, coarse samples, ended lifetimes, events), linear in
    time until retention (``retention_days``) deletes the oldest, so the steady-state
    database is about ``retention_days`` times the daily figure.

    On Postgres every in-place update leaves a dead row version until vacuum reclaims
    it; autovacuum does so about every minute of real time, but this hour of agent time
    passes in seconds, so the run vacuums the tables after every request round (every
    ``STORAGE_BATCH`` snapshots, two minutes of agent time), as autovacuum would.
    """
    with fresh_database(kind, tmp, "storage") as target:
        hosts = [f"storage-{i}" for i in range(STORAGE_HOSTS)]
        tokens = make_tokens(target, hosts)
        base = history_base(STORAGE_WARM + STORAGE_MEASURED)
        with running_server(target, tmp) as client:
            for first, count in ((0, STORAGE_WARM), (STORAGE_WARM, STORAGE_MEASURED)):
                if first:
                    before = _sizes(target)
                for start in range(first, first + count, STORAGE_BATCH):
                    requests = pushes(
                        tokens,
                        first=start,
                        per_host=1,
                        batch=min(STORAGE_BATCH, first + count - start),
                        base=base,
                    )
                    send(client, requests)
                    _vacuum(target)
            after = _sizes(target)
    growth = {table: after[table] - before.get(table, 0) for table in after}
    hour_bytes = growth.pop("total")
    per_day = hour_bytes / STORAGE_HOSTS * (86_400 / (STORAGE_MEASURED * INTERVAL))
    return {
        "hosts": STORAGE_HOSTS,
        "measured_agent_seconds": STORAGE_MEASURED * INTERVAL,
        "database_bytes_after_warmup": before["total"],
        "bytes_per_host_per_day": round(per_day),
        "mib_per_host_per_day": round(per_day / MIB, 2),
        "growth_bytes_by_table": {k: v for k, v in sorted(growth.items()) if v},
    }


def _vacuum(target: Target) -> None:
    """Plain ``VACUUM`` of the tables ingest updates in place (Postgres only)."""
    if target.kind != "postgres":
        return
    from sqlalchemy import create_engine, text

    engine = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            for table in ("hosts", "gpus", "process_lifetimes", "process_windows", "events"):
                connection.execute(text(f'VACUUM "{target.schema}".{table}'))
    finally:
        engine.dispose()


def _sizes(target: Target) -> dict[str, int]:
    """Bytes of the database, in total and by table (indexes and TOAST included)."""
    if target.kind == "sqlite":
        assert target.path is not None
        conn = sqlite3.connect(target.path, isolation_level=None)
        try:
            # Fold the WAL into the file first, so the file size is the data.
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            wal = target.path.with_name(target.path.name + "-wal")
            sizes = {
                "total": target.path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
            }
            with contextlib.suppress(sqlite3.OperationalError):  # dbstat is optional
                by_index = conn.execute(
                    "SELECT name, tbl_name FROM sqlite_master WHERE type IN ('table', 'index')"
                ).fetchall()
                owner = dict(by_index)
                for name, size in conn.execute(
                    "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"
                ):
                    table = owner.get(name, name)
                    sizes[table] = sizes.get(table, 0) + size
        finally:
            conn.close()
        return sizes
    from sqlalchemy import create_engine, text

    engine = create_engine(POSTGRES_URL)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " WHERE n.nspname = :schema AND c.relkind = 'r'"
                ),
                {"schema": target.schema},
            ).all()
    finally:
        engine.dispose()
    sizes = {name: int(size) for name, size in rows}
    sizes["total"] = sum(sizes.values())
    return sizes


# --- compare: before/after ------------------------------------------------------------------------


def export_tree(ref: str, into: Path) -> Path:
    """The ``gpuwatch`` package as committed at ``ref``, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "gpuwatch"], capture_output=True, check=True
    ).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def bench_compare(kind: str, tmp: Path, ref: str) -> dict[str, Any]:
    """Ingest at each of :data:`COMPARE_SHAPES`: the code at ``ref`` and this checkout,
    each its own server and database, in alternating rounds. Each side's tokens are
    made by its own code's ``gpuwatch token create``, so the schemas may differ."""
    old_code = export_tree(ref, tmp / "before")
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True
    ).stdout.strip()
    result: dict[str, Any] = {"ref": ref, "commit": commit}
    with contextlib.ExitStack() as stack:
        clients = {}
        for name, code in (("before", old_code), ("after", ROOT)):
            # Migrated by its own server: the schema may differ between the two.
            target = stack.enter_context(fresh_database(kind, tmp, f"cmp{name}", migrate=False))
            clients[name] = (
                stack.enter_context(running_server(target, tmp, code=code)),
                code,
                target,
            )
        for batch, (hosts, per_round) in COMPARE_SHAPES.items():
            rates: dict[str, list[float]] = {"before": [], "after": []}
            rounds = {}
            for name, (client, code, target) in clients.items():
                tokens = make_tokens_with(code, target, [f"cmp{batch}-{i}" for i in range(hosts)])
                rounds[name] = warmed_rounds(
                    client, tokens, batch=batch, per_round=per_round, count=COMPARE_ROUNDS
                )
            for r in range(COMPARE_ROUNDS):
                for name in in_turn(r, ("before", "after")):
                    client = clients[name][0]
                    requests = rounds[name][r]
                    rates[name].append(len(requests) * batch / send(client, requests))
            before, after = statistics.median(rates["before"]), statistics.median(rates["after"])
            result[f"batch_{batch}"] = {
                "snapshots_per_second": {"before": round(before, 1), "after": round(after, 1)},
                "ratio_after_to_before": round(after / before, 2),
            }
    return result


# --- main ----------------------------------------------------------------------------------------------


def main(compare: str | None = None) -> dict[str, Any]:
    kinds = ["sqlite"]
    skipped = postgres_unavailable()
    if skipped is None:
        kinds.append("postgres")
    else:
        print(f"skipping Postgres: {skipped}", flush=True)
    result: dict[str, Any] = {"shape": {"gpus": GPUS, "processes": PROCS}}
    if skipped:
        result["postgres_skipped"] = skipped
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-server-") as tmp_dir:
        tmp = Path(tmp_dir)
        steps: list[tuple[str, Callable[[str, Path], dict[str, Any]]]] = [
            ("ingest", bench_ingest),
            ("fleet", bench_fleet),
            ("storage", bench_storage),
        ]
        if compare:
            steps.append(("compare", lambda kind, path: bench_compare(kind, path, compare)))
        for name, step in steps:
            for kind in kinds:
                started = time.monotonic()
                print(f"-- {name} on {kind}", flush=True)
                result.setdefault(name, {})[kind] = step(kind, tmp)
                print(f"   {time.monotonic() - started:.0f} s", flush=True)
        result["ingest"]["server_writes"] = count_server_writes(tmp)
    result["targets"] = {
        "ratio_to_raw_insert": 0.3,
        "sqlite_batch_1_snapshots_per_second": 300,
        "fleet_median_ms": 50,
    }
    path = write_result("server", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compare", metavar="REF", help="also run single-snapshot ingest of git REF (before)"
    )
    main(compare=parser.parse_args().compare)
