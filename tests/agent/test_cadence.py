"""Poll and push cadence: fixed deadlines on a monotonic clock, driven by a fake one.

The agent runs its real loop (``Agent.run``) for an hour or more of fake time: each
poll costs the fake seconds the test gives it, each wait moves the clock by what was
asked plus some oversleep (timer slack), and nothing sleeps for real.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from support.agent_sink import RecordingSink
from support.clock import FakeClock

from gpuwatch.agent.cadence import PollSchedule, PushSchedule
from gpuwatch.agent.service import Agent
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.errors import NvmlUnavailable
from gpuwatch.settings import AgentSettings, load
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

EPOCH = 1_700_000_000.0
T0 = 1000.0  # where the fake monotonic clock starts


class TimedSampler:
    """A stand-in Sampler: each poll takes ``duration()`` seconds of fake time.

    ``collected_at`` is the fake time the poll started at (plus EPOCH), as the real
    sampler stamps it. Polls whose number is in ``failing`` raise, as a poll does when
    NVML cannot be read.
    """

    def __init__(
        self, clock: FakeClock, duration: Callable[[], float], failing: set[int] | None = None
    ) -> None:
        self.clock = clock
        self.duration = duration
        self.failing = failing or set()
        self.started: list[float] = []

    def poll(self) -> HostSnapshot:
        self.started.append(self.clock.now)
        assert len(self.started) < 100_000, "the loop never waits"
        number = len(self.started)
        self.clock.advance(self.duration())
        if number in self.failing:
            raise NvmlUnavailable("the driver went away")
        return HostSnapshot(
            agent_id="agent-1",
            hostname="gpu-box",
            boot_id="boot-1",
            sequence=number,
            collected_at=EPOCH + self.started[-1],
        )


def run_agent(
    tmp_path: Path,
    *,
    poll: float,
    push: float,
    seconds: float,
    duration: Callable[[], float],
    oversleep: Callable[[], float] = lambda: 0.0,
    failing: set[int] | None = None,
) -> tuple[TimedSampler, RecordingSink]:
    """Run the agent's real loop for ``seconds`` of fake time."""
    clock = FakeClock(T0)
    sampler = TimedSampler(clock, duration, failing)
    sink = RecordingSink()
    end = T0 + seconds

    def wait(timeout: float) -> bool:
        clock.advance(timeout + oversleep())
        return clock.now >= end

    settings = load(
        AgentSettings,
        listen="127.0.0.1:0",
        poll_interval_seconds=poll,
        push_interval_seconds=push,
        spool_dir=tmp_path / "spool",
    )
    agent = Agent(
        settings,
        sampler=sampler,
        state=AgentState(),
        torch_reports=TorchReports(),
        sink=sink,
        clock=lambda: EPOCH + clock.now,
        monotonic=clock,
        wait=wait,
    )
    agent.run()
    return sampler, sink


def gaps(snapshots: list[HostSnapshot]) -> list[float]:
    times = [s.collected_at for s in snapshots]
    return [b - a for a, b in pairwise(times)]


def uniform(seed: int, low: float, high: float) -> Callable[[], float]:
    rng = random.Random(seed)
    return lambda: rng.uniform(low, high)


@pytest.mark.parametrize(
    ("poll", "push", "slowest_poll"),
    [
        (5.0, 15.0, 0.0),
        (5.0, 15.0, 3.0),
        (1.0, 1.0, 0.0),
        (1.0, 1.0, 0.5),
        (1.0, 1.0, 0.9),
        (2.0, 10.0, 1.5),
    ],
    ids=["5s-15s", "5s-15s-jitter", "1s-1s", "1s-1s-jitter", "1s-1s-slow", "2s-10s-jitter"],
)
def test_pushes_keep_the_interval_and_no_poll_is_skipped(
    tmp_path: Path, poll: float, push: float, slowest_poll: float
) -> None:
    late = 0.05 * poll  # timer slack: each wait may end up to this much late
    sampler, sink = run_agent(
        tmp_path,
        poll=poll,
        push=push,
        seconds=3600,
        duration=uniform(1, 0.0, slowest_poll),
        oversleep=uniform(2, 0.0, late),
    )
    # Every slot of the poll grid got its poll, on time (none skipped, no drift).
    assert len(sampler.started) == pytest.approx(3600 / poll, abs=1)
    for n, started in enumerate(sampler.started):
        assert T0 + n * poll <= started <= T0 + n * poll + late + 1e-9
    # Pushed snapshots are the push interval apart, within 10%.
    pushed = gaps(sink.offered)
    assert len(sink.offered) == pytest.approx(3600 / push, abs=1)
    assert all(abs(gap - push) <= 0.1 * push for gap in pushed), sorted(pushed)[-5:]


def test_a_poll_that_overruns_is_caught_up_once_then_the_grid_holds(tmp_path: Path) -> None:
    durations: Iterator[float] = iter([0.2] * 10 + [3.5] + [0.2] * 100)
    sampler, sink = run_agent(
        tmp_path, poll=1.0, push=1.0, seconds=20, duration=lambda: next(durations)
    )
    starts = [s - T0 for s in sampler.started]
    # Polls 0..10 on time; poll 10 runs until 13.5. Slots 11 and 12 passed during it
    # and are not made up; slot 13 is polled at once (late), then 14, 15, ... on time.
    assert starts[:11] == pytest.approx([float(n) for n in range(11)])
    assert starts[11] == pytest.approx(13.5)
    assert starts[12:] == pytest.approx([float(n) for n in range(14, 14 + len(starts) - 12)])
    # Only one poll ran before its slot came round again: no burst.
    assert sum(1 for a, b in pairwise(starts) if b - a < 0.9) == 1
    assert [s.collected_at - EPOCH - T0 for s in sink.offered][10:13] == pytest.approx(
        [10.0, 13.5, 14.0]
    )


def test_a_push_missed_while_polls_fail_is_made_up_once_on_the_grid(tmp_path: Path) -> None:
    # Polls every 5 s, pushes every 15 s; the polls at 15 s and 20 s fail.
    _, sink = run_agent(
        tmp_path, poll=5.0, push=15.0, seconds=60, duration=lambda: 0.1, failing={4, 5}
    )
    offered = [s.collected_at - EPOCH - T0 for s in sink.offered]
    assert offered == pytest.approx([0.0, 25.0, 30.0, 45.0])


def test_a_push_interval_that_is_no_multiple_of_the_poll_interval_keeps_its_average(
    tmp_path: Path,
) -> None:
    _, sink = run_agent(tmp_path, poll=5.0, push=12.0, seconds=3600, duration=lambda: 1.0)
    assert len(sink.offered) == pytest.approx(3600 / 12, abs=1)
    assert {round(gap, 6) for gap in gaps(sink.offered)} <= {10.0, 15.0}


def test_poll_schedule_rounding_never_moves_the_grid_backwards() -> None:
    polls = PollSchedule(0.1, start=0.0)
    scheduled = [polls.claim(polls.next_at) for _ in range(1000)]
    assert scheduled == [n * 0.1 for n in range(1000)]


def test_push_schedule_meets_deadlines_despite_float_sums() -> None:
    # 0.1 s polls summed ten times are not exactly 1.0; the deadline is still met.
    pushes = PushSchedule(1.0, tolerance_seconds=0.05)
    t, offered = 0.0, []
    for _ in range(100):
        if pushes.due(t):
            pushes.offered(t)
            offered.append(t)
        t += 0.1
    assert len(offered) == 10


class BusyAtSampler(TimedSampler):
    """One GPU and one process, busy (SM 60 %) only at the polls numbered in ``busy``."""

    def __init__(self, clock: FakeClock, busy: set[int]) -> None:
        super().__init__(clock, lambda: 0.0)
        self.busy = busy

    def poll(self) -> HostSnapshot:
        snapshot = super().poll()
        sm = 0.6 if len(self.started) in self.busy else 0.0
        gpu = Gpu(index=0, uuid="GPU-0", processes=[GpuProcess(pid=42, sm_ratio=sm)])
        return snapshot.model_copy(update={"gpus": [gpu]})


def test_activity_at_a_poll_that_is_not_pushed_reaches_the_next_push(tmp_path: Path) -> None:
    # Polls every 5 s, pushes every 15 s: only every third poll is pushed. A request
    # served during poll 2 (or 6) must still reach the server, or an inference server
    # answering one short request every few minutes could be called idle.
    clock = FakeClock(T0)
    sampler = BusyAtSampler(clock, busy={2, 6})
    sink = RecordingSink()
    settings = load(
        AgentSettings,
        listen="127.0.0.1:0",
        poll_interval_seconds=5.0,
        push_interval_seconds=15.0,
        spool_dir=tmp_path / "spool",
    )

    def wait(timeout: float) -> bool:
        clock.advance(timeout)
        return clock.now >= T0 + 60

    Agent(
        settings, sampler=sampler, state=AgentState(), torch_reports=TorchReports(), sink=sink,
        clock=lambda: EPOCH + clock.now, monotonic=clock, wait=wait,
    ).run()  # fmt: skip
    pushed = [(s.sequence, s.gpus[0].processes[0].sm_ratio) for s in sink.offered]
    assert [n for n, _ in pushed][:4] == [1, 4, 7, 10]
    assert [sm for _, sm in pushed][:4] == [0.0, 0.6, 0.6, 0.0]
