"""Per-process activity from nvmlDeviceGetProcessUtilization, over the fake GPUs.

Two defects these pin down (reaper audit, finding 1; detector audit):

* a re-read a few milliseconds after the previous one finds no new sample (NOT_FOUND);
  that silence must not read as idle, or a busy process looks idle right before a
  signal;
* a process busy only on the video encoder or decoder (``encUtil`` / ``decUtil``, SM 0)
  is busy: activity is the busiest engine.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pynvml
import pytest

from gpuwatch.nvml.library import PROCESS_SAMPLE_PERIOD_SECONDS, NvmlSession

BUSY = """
[fake]
name = "busy"

[[gpu]]
memory_total = "16GiB"

[[process]]
gpu = 0
attach = "self"
memory = "2GiB"
sm_percent = 40
"""


def _sm(session: NvmlSession) -> dict[int, float] | None:
    return session.read_device(0).process_sm


def test_a_quick_reread_keeps_the_last_known_activity(fake_gpus) -> None:
    fake_gpus(BUSY)
    with NvmlSession.open() as session:
        first = _sm(session)
        again = _sm(session)  # milliseconds later: NVML has no newer sample (NOT_FOUND)
    assert first == {os.getpid(): pytest.approx(0.4)}
    # Before the fix this was {} (every listed process idle, 0.0).
    assert again == {os.getpid(): pytest.approx(0.4)}


def test_after_a_sample_period_a_silence_is_idle_again(fake_gpus) -> None:
    steps = 'sm_percent = { steps = [["0s", 40], ["1s", 0]] }'
    fake_gpus(BUSY.replace("sm_percent = 40", steps), at=None)  # scenario time runs
    with NvmlSession.open() as session:
        assert _sm(session) == {os.getpid(): pytest.approx(0.4)}
        time.sleep(PROCESS_SAMPLE_PERIOD_SECONDS + 1.2)  # past the step and a full period
        assert _sm(session) == {}  # no sample over a full period: idle, as documented


def _engine_moved(fake_lib: Any, engine: str) -> None:
    """Make the fake C symbol report the busy share on ``engine`` instead of the SMs.

    The fake's scenarios cannot express encoder/decoder use (it writes encUtil and
    decUtil as 0), so the test rewrites the samples the fake C function fills in,
    beneath pynvml; pynvml's own Python code runs unchanged.
    """
    function = fake_lib._functions["nvmlDeviceGetProcessUtilization"]
    original = function._call

    def call(handle: Any, samples: Any, count: Any, last_seen: Any) -> Any:
        code = original(handle, samples, count, last_seen)
        if code == pynvml.NVML_SUCCESS and samples is not None:
            for i in range(count._obj.value if hasattr(count, "_obj") else int(count.value)):
                setattr(samples[i], engine, samples[i].smUtil)
                samples[i].smUtil = 0
        return code

    function._call = call


@pytest.mark.parametrize("engine", ["encUtil", "decUtil"])
def test_a_process_busy_on_the_video_engines_is_busy(fake_gpus, engine: str) -> None:
    fake_gpus(BUSY)
    with NvmlSession.open() as session:
        _engine_moved(pynvml.nvmlLib, engine)
        # Before the fix: 0.0 (only smUtil was read), i.e. idle.
        assert _sm(session) == {os.getpid(): pytest.approx(0.4)}


def test_an_all_zero_sample_is_idle(fake_gpus) -> None:
    fake_gpus(BUSY)
    with NvmlSession.open() as session:
        function = pynvml.nvmlLib._functions["nvmlDeviceGetProcessUtilization"]
        original = function._call

        def zero(handle: Any, samples: Any, count: Any, last_seen: Any) -> Any:
            code = original(handle, samples, count, last_seen)
            if code == pynvml.NVML_SUCCESS and samples is not None:
                for slot in samples:
                    slot.smUtil = slot.encUtil = slot.decUtil = 0
            return code

        function._call = zero
        assert _sm(session) == {os.getpid(): 0.0}


def test_after_the_clock_steps_back_a_busy_process_is_still_busy(fake_gpus) -> None:
    # The newest sample this session saw was stamped an hour ahead of the wall clock as
    # it reads now: the clock stepped back (NTP, a VM restore). Asking only for samples
    # after that stamp would find none for an hour, and every process would read idle.
    fake_gpus(BUSY)
    with NvmlSession.open() as session:
        _sm(session)
        session._util_ts[0] = int((time.time() + 3600) * 1_000_000)
        assert _sm(session) == {os.getpid(): pytest.approx(0.4)}
