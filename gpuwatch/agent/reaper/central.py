"""The central server's history, for the part of a window the local agent did not see.

The agent's history is in memory. The central server keeps every process's
coarse samples (``GET /api/v1/processes/{id}/samples``: one bucket per
``sample_interval_seconds`` with the floor of the memory held and the busiest SM
activity of the polls pushed in it). When the agent's history of a process begins
inside the window, the planner (:func:`gpuwatch.agent.reaper.plan.make_plan`) asks
:class:`ServerHistory` for the time before it, and the shared idle rule judges the
two together (docs/reaper.md, "Idle, from observed history").

What is trusted, and how:

* **Only the same process.** A server lifetime is used only if it has the same
  hostname, GPU UUID and index, PID and start time (to the clock tick): a reused PID
  never inherits history. A process without a start time matches nothing.
* **Only before the agent's own history**: where both have samples, the agent's
  (every poll, and the host CPU signal) wins; a server bucket is cut where the
  agent's first run begins.
* **Gaps are unknown, never idle.** A bucket is idle only when every poll pushed in
  it saw SM at 0, active above 0, unknown when a poll could not tell; a missing bucket
  (agent down, pushes failing, the process not listed) is a gap, exactly as in the
  agent's history: the idle clock restarts after it, whatever its length. The
  junction with the agent's history (the restart) is a gap too (:func:`combine`), so
  the server's samples cannot make a process idle across an agent restart; they
  decide a window that reaches back past the agent's own ``history``.
* **Never instead of the agent's verdict.** The server is asked only when the agent's
  history does not already say "not idle" (activity, unknown activity or host CPU use
  anywhere in it), and only when the agent's history starts inside the window.
* **Unreachable is not idle.** Any failure (unreachable, refused token, an answer
  that is not a history) turns the server off for the rest of the run, with a note;
  the agent's history alone then decides, so a short one means *not idle*.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gpuwatch.agent.reaper.history import Activity, Run
from gpuwatch.agent.reaper.procfs import same_start
from gpuwatch.errors import GpuwatchError, NotFound

log = logging.getLogger(__name__)

# The agent-only verdicts that more history from before could change.
SHORT_REASONS = frozenset({"no_history", "idle_too_short", "coverage"})
# How far before the window's start to read, so the idle stretch shown can be longer
# than the window, as with the agent's own history.
LOOKBACK_SECONDS = 3600.0
MAX_SAMPLES = 10080  # the route's bound: a week of one-minute buckets
MAX_LIFETIMES = 1000


class Lifetime(Protocol):
    """What the server says of one process on one GPU (``ProcessOut``)."""

    @property
    def id(self) -> int: ...
    @property
    def hostname(self) -> str: ...
    @property
    def gpu_index(self) -> int: ...
    @property
    def gpu_uuid(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def start_time(self) -> float | None: ...
    @property
    def first_seen_at(self) -> float: ...
    @property
    def last_seen_at(self) -> float: ...


class Bucket(Protocol):
    """One closed bucket (``ProcessSampleOut``): ``t`` is its start, epoch seconds."""

    @property
    def t(self) -> float: ...
    @property
    def used_bytes(self) -> int | None: ...
    @property
    def sm_ratio(self) -> float | None: ...


class Samples(Protocol):
    """A lifetime and its buckets, oldest first (``ProcessSamples``)."""

    @property
    def lifetime(self) -> Lifetime: ...
    @property
    def sample_interval_seconds(self) -> float: ...
    @property
    def samples(self) -> Sequence[Bucket]: ...


class ReadApi(Protocol):
    """The server's read API (:class:`gpuwatch.server.client.HistoryClient`); its
    methods raise :class:`~gpuwatch.errors.GpuwatchError` subclasses."""

    def processes(self, *, limit: int, **filters: Any) -> Sequence[Lifetime]: ...

    def process_samples(
        self, lifetime_id: int, *, since: float | None = ..., limit: int = ...
    ) -> Samples: ...


class ServerLookup(Protocol):
    """Runs from elsewhere for one process on one GPU since ``since`` (``None``: none)."""

    def __call__(
        self, *, gpu_index: int, gpu_uuid: str, pid: int, start_time: float, since: float
    ) -> list[Run] | None: ...


def on_clock(lookup: ServerLookup, wall_ahead_seconds: float) -> ServerLookup:
    """``lookup`` (epoch seconds: the server's buckets) on the reaper's steady clock
    (:mod:`gpuwatch.agent.reaper.clock`), which the wall clock is ``wall_ahead_seconds``
    ahead of now. The server's times are as good as the wall clock they were taken on;
    the agent's own polls, on the steady clock, win wherever the two overlap."""
    if wall_ahead_seconds == 0:
        return lookup

    def shifted(
        *, gpu_index: int, gpu_uuid: str, pid: int, start_time: float, since: float
    ) -> list[Run] | None:
        runs = lookup(
            gpu_index=gpu_index,
            gpu_uuid=gpu_uuid,
            pid=pid,
            start_time=start_time,
            since=since + wall_ahead_seconds,
        )
        if runs is None:
            return None
        d = wall_ahead_seconds
        return [
            Run(r.start - d, r.end - d, r.activity, r.low_bytes, r.high_bytes,
                r.busiest_ratio, r.cpu_busy)
            for r in runs
        ]  # fmt: skip

    return shifted


def matches(
    lifetime: Lifetime,
    *,
    hostname: str,
    gpu_index: int,
    gpu_uuid: str,
    pid: int,
    start_time: float | None,
) -> bool:
    """Whether ``lifetime`` is this very process on this GPU (a reused PID is not)."""
    return (
        start_time is not None
        and lifetime.start_time is not None
        and lifetime.hostname == hostname
        and lifetime.gpu_uuid == gpu_uuid
        and lifetime.gpu_index == gpu_index
        and lifetime.pid == pid
        and same_start(lifetime.start_time, start_time)
    )


def bucket_runs(
    buckets: Sequence[Bucket],
    *,
    interval_seconds: float,
    first_seen_at: float,
    last_seen_at: float,
) -> list[Run]:
    """Runs standing for the server's buckets: each covers ``[t, t + interval]`` (cut
    to when the server saw the process), consecutive ones with the same activity
    joined, a missing bucket left as a gap."""
    runs: list[Run] = []
    for bucket in sorted(buckets, key=lambda b: b.t):
        start = max(bucket.t, first_seen_at)
        end = min(bucket.t + interval_seconds, last_seen_at)
        if end <= start:
            continue
        sm = bucket.sm_ratio
        activity: Activity = "unknown" if sm is None else "active" if sm > 0 else "idle"
        used = bucket.used_bytes
        last = runs[-1] if runs else None
        # Buckets are aligned to the interval, so "next to each other" is exact up to
        # float rounding.
        if last is not None and last.activity == activity and start - last.end < 1e-6:
            last.end = end
            last.low_bytes = (
                None if used is None or last.low_bytes is None else min(last.low_bytes, used)
            )
            last.high_bytes = (
                None if used is None or last.high_bytes is None else max(last.high_bytes, used)
            )
            last.busiest_ratio = max(last.busiest_ratio, sm or 0.0)
        else:
            runs.append(Run(start, end, activity, used, used, sm or 0.0))
    return runs


def server_may_help(agent: list[Run] | None, *, window_start: float) -> bool:
    """Whether the time before the agent's history could change its verdict: the
    agent saw nothing but quiet idleness, and its history begins inside the window."""
    if not agent:
        return True
    if any(r.activity != "idle" or r.cpu_busy for r in agent):
        return False
    return agent[0].start > window_start


# Where the server's runs meet the agent's there was an agent restart (or the agent
# began watching the process): time nobody can show was observed. The server's
# one-minute buckets cannot show that no poll was missed across it, so the junction is
# a gap of at least this much, never bridged (gpuwatch.agent.reaper.evidence).
JUNCTION_GAP_SECONDS = 1.0


def combine(server: list[Run], agent: list[Run] | None) -> list[Run]:
    """The server's runs up to where the agent's begin, then the agent's, with the
    junction a gap (:data:`JUNCTION_GAP_SECONDS`)."""
    if not agent:
        return server
    cut = agent[0].start - JUNCTION_GAP_SECONDS
    earlier = [
        Run(r.start, min(r.end, cut), r.activity, r.low_bytes, r.high_bytes, r.busiest_ratio)
        for r in server
        if r.start < cut
    ]
    return earlier + agent


class ServerHistory:
    """:class:`ServerLookup` over the server's read API, for one host.

    Lifetimes are listed once per GPU (``open`` ones: the process holds memory now)
    and matched with :func:`matches`. The first failure (unreachable, refused token,
    unexpected answer) turns it off; ``note`` says so once. ``used`` counts the
    processes it returned runs for.
    """

    def __init__(
        self, api: ReadApi, *, hostname: str, server_url: str, note: Callable[[str], None]
    ) -> None:
        self._api = api
        self._hostname = hostname
        self._url = server_url
        self._note = note
        self._open: dict[int, Sequence[Lifetime]] = {}
        self._failed = False
        self.used = 0

    def __call__(
        self, *, gpu_index: int, gpu_uuid: str, pid: int, start_time: float, since: float
    ) -> list[Run] | None:
        if self._failed:
            return None
        try:
            if gpu_index not in self._open:
                self._open[gpu_index] = self._api.processes(
                    limit=MAX_LIFETIMES, host=self._hostname, gpu=gpu_index, open=True
                )
            found = [
                lt
                for lt in self._open[gpu_index]
                if matches(
                    lt,
                    hostname=self._hostname,
                    gpu_index=gpu_index,
                    gpu_uuid=gpu_uuid,
                    pid=pid,
                    start_time=start_time,
                )
            ]
            if len(found) != 1:
                return None  # never seen there (or, impossibly, twice: trust neither)
            page = self._api.process_samples(
                found[0].id, since=since - LOOKBACK_SECONDS, limit=MAX_SAMPLES
            )
        except NotFound:
            return None  # the lifetime went between the two reads
        except GpuwatchError as err:
            self._failed = True
            log.info("central server history not used: %s", err)
            self._note(
                f"the central server's history is not used ({err}): the agent's history "
                "alone decides, and a process it has not watched for a whole window is not idle"
            )
            return None
        lifetime = page.lifetime
        if not matches(
            lifetime,
            hostname=self._hostname,
            gpu_index=gpu_index,
            gpu_uuid=gpu_uuid,
            pid=pid,
            start_time=start_time,
        ):
            return None
        runs = bucket_runs(
            page.samples,
            interval_seconds=page.sample_interval_seconds,
            first_seen_at=lifetime.first_seen_at,
            last_seen_at=lifetime.last_seen_at,
        )
        if runs:
            self.used += 1
        return runs or None

    def summary(self) -> str | None:
        """A note for the user when the server's history was used at all."""
        if not self.used:
            return None
        return (
            f"the agent's history was shorter than the window for {self.used} process(es): "
            f"the samples of the central server at {self._url} were used for the time before it"
        )
