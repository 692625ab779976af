"""NVML failing on one GPU of a running agent: UNKNOWN, TIMEOUT, a hung call, a GPU lost
mid-poll. The other GPUs keep reporting, and no stale value is ever served.

Real parts: the agent (sampler, state, exporter) over the real pynvml over the fake
GPUs, read back through its own ``/metrics`` and ``/snapshot`` over HTTP. The fake
host runs on an injected clock, and every GPU's memory grows with scenario time, so
a value from an earlier poll is told apart from a fresh one. Faults the scenario
format has (``hang``, ``gpu_lost``) come from ``[[fault]]`` entries; UNKNOWN and
TIMEOUT, which it lacks, from :mod:`faults.nvml_faults`, beneath pynvml all the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.clock import FakeClock

from faults.nvml_faults import NVML_ERROR_TIMEOUT, NVML_ERROR_UNKNOWN, Misbehaving, Rule, misbehave
from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.agent.service import Agent
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession
from gpuwatch.settings import AgentSettings

GiB = 2**30
NVML_TIMEOUT = 0.5  # the agent's nvml_timeout_seconds
HANG = 3.0  # real seconds the hung call sleeps
HANG_AT, HANG_FOR = 600.0, 60.0  # scenario seconds
LOST_AT = 1200.0

# Three A100s, each held by a (ghost) process whose memory grows 1 GiB a minute.
SCENARIO = f"""
[fake]
name = "faults"
lifetime = "10m"
{
    "".join(
        f'''
[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[process]]
gpu = {i}
ghost = {4_100_001 + i}
memory = {{ linear = ["1GiB", "61GiB"], over = "60m" }}
sm_percent = 30
'''
        for i in range(3)
    )
}
[[fault]]
gpu = 1
kind = "hang"
function = "nvmlDeviceGetPowerUsage"
seconds = {HANG:g}
at = "{HANG_AT:g}s"
duration = "{HANG_FOR:g}s"

[[fault]]
gpu = 2
kind = "gpu_lost"
at = "{LOST_AT:g}s"
"""


def expected_used(scenario_seconds: float) -> int:
    """What the fake reports as used on each GPU at that scenario time (bytes)."""
    return int(GiB + 60 * GiB * min(scenario_seconds, 3600) / 3600)


@dataclass
class Rig:
    agent: Agent
    clock: FakeClock
    host: fake.FakeHost
    nvml: Misbehaving

    def at(self, scenario_seconds: float) -> None:
        self.clock.now = self.host.state.epoch + scenario_seconds

    def poll(self) -> float:
        """Poll once; its wall time in seconds."""
        started = time.monotonic()
        assert self.agent.poll_once() is not None
        return time.monotonic() - started

    def snapshot(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.agent.exporter.url}/snapshot").json()
        return data

    def gpus(self) -> dict[int, dict[str, Any]]:
        return {g["index"]: g for g in self.snapshot()["gpus"]}

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = httpx.get(f"{self.agent.exporter.url}/metrics").text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def gpu_metric(self, name: str, index: int) -> float | None:
        """The sample of ``name`` for GPU ``index`` (any uuid), or None if absent."""
        found = [
            v
            for (n, labels), v in self.metrics().items()
            if n == name and ("gpu", str(index)) in labels
        ]
        assert len(found) <= 1
        return found[0] if found else None

    def nvml_errors(self, error: str) -> float:
        return sum(
            v
            for (n, labels), v in self.metrics().items()
            if n == "gpuwatch_nvml_errors_total" and ("error", error) in labels
        )


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    path = tmp_path / "faults.toml"
    path.write_text(SCENARIO)
    clock = FakeClock(time.time())
    host = fake.install(path, runtime_dir=tmp_path / "runtime", clock=clock)
    nvml = misbehave()
    session = NvmlSession.open()
    try:
        state = AgentState(nvml_errors=session.errors)
        settings = AgentSettings(
            listen="127.0.0.1:0", poll_interval_seconds=15, nvml_timeout_seconds=NVML_TIMEOUT
        )
        sampler = Sampler(
            session,
            ProcInfo(Path("/proc")),
            HostIdentity("agent-1", "host-1", "boot-1"),
            timeout_seconds=NVML_TIMEOUT,
            fake=True,
            clock=clock,
        )
        agent = Agent(
            settings, sampler=sampler, state=state, torch_reports=TorchReports(), clock=clock
        )
        agent.exporter.start()
        try:
            yield Rig(agent, clock, host, nvml)
        finally:
            agent.exporter.stop()
    finally:
        session.close()
        fake.uninstall()
        host.stop()


def assert_fresh(rig: Rig, index: int, scenario_seconds: float) -> None:
    """GPU ``index`` is served with the value of the latest poll, in both views."""
    want = expected_used(scenario_seconds)
    gpu = rig.gpus()[index]
    assert gpu["memory_used_bytes"] == pytest.approx(want, rel=0.01)
    assert rig.gpu_metric("gpuwatch_gpu_memory_used_bytes", index) == gpu["memory_used_bytes"]
    assert rig.gpu_metric("gpuwatch_gpu_up", index) == 1


@pytest.mark.parametrize(
    ("code", "name"), [(NVML_ERROR_UNKNOWN, "unknown"), (NVML_ERROR_TIMEOUT, "timeout")]
)
def test_unknown_or_timeout_on_one_gpu_blanks_its_fields_and_the_others_report(
    rig: Rig, code: int, name: str
) -> None:
    rig.at(60)
    rig.poll()
    for i in range(3):
        assert_fresh(rig, i, 60)

    for family in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates"):
        rig.nvml.rules.append(Rule(family, gpu=1, code=code))
    rig.at(120)
    rig.poll()

    gpu1 = rig.gpus()[1]
    assert gpu1["memory_used_bytes"] is None and gpu1["utilization_ratio"] is None
    assert not gpu1["lost"] and gpu1["read_error"] is None
    assert gpu1["processes"], "the rest of the GPU is still read"
    # Absent, not the previous poll's value (and never 0).
    assert rig.gpu_metric("gpuwatch_gpu_memory_used_bytes", 1) is None
    assert rig.gpu_metric("gpuwatch_gpu_utilization_ratio", 1) is None
    assert rig.gpu_metric("gpuwatch_gpu_up", 1) == 1  # the GPU answered; two fields did not
    assert rig.nvml_errors(name) >= 2
    for i in (0, 2):
        assert_fresh(rig, i, 120)

    rig.nvml.rules.clear()
    rig.at(180)
    rig.poll()
    for i in range(3):
        assert_fresh(rig, i, 180)


def _identity(gpu: dict[str, Any]) -> tuple[str, str | None, str | None]:
    return gpu["uuid"], gpu["name"], gpu["pci_bus_id"]


def test_a_hung_call_is_bounded_and_the_gpu_is_served_as_timed_out_not_stale(rig: Rig) -> None:
    rig.at(HANG_AT - 60)
    rig.poll()
    assert_fresh(rig, 1, HANG_AT - 60)
    board = _identity(rig.gpus()[1])

    rig.at(HANG_AT + 1)  # GPU 1's power reading now hangs for HANG real seconds
    took = rig.poll()
    again = rig.poll()  # its reader is still stuck: skipped, not waited for again

    assert took < NVML_TIMEOUT + 1.0
    assert again < NVML_TIMEOUT  # no second wait for the stuck GPU
    gpus = rig.gpus()
    assert gpus[1]["read_error"] == "timeout" and gpus[1]["memory_used_bytes"] is None
    assert _identity(gpus[1]) == board  # still the board it was, not GPU-unknown-1
    assert rig.gpu_metric("gpuwatch_gpu_up", 1) == 0
    assert rig.gpu_metric("gpuwatch_gpu_memory_used_bytes", 1) is None
    assert_fresh(rig, 0, HANG_AT + 1)
    assert_fresh(rig, 2, HANG_AT + 1)

    # The fault ends; once the stuck call returns, GPU 1 is read afresh: the late
    # answer of the hung read is thrown away, never served.
    rig.at(HANG_AT + HANG_FOR + 60)
    deadline = time.monotonic() + HANG + 5
    while rig.gpus()[1]["read_error"] is not None:
        assert time.monotonic() < deadline, "GPU 1 never came back after the hang"
        time.sleep(0.2)
        rig.poll()
    for i in range(3):
        assert_fresh(rig, i, HANG_AT + HANG_FOR + 60)


def test_a_gpu_lost_mid_poll_serves_nothing_read_before_the_loss(rig: Rig) -> None:
    rig.at(LOST_AT - 60)
    rig.poll()
    assert_fresh(rig, 2, LOST_AT - 60)
    board = _identity(rig.gpus()[2])
    assert not board[0].startswith("GPU-unknown") and board[2]

    # GPU 2 falls off the bus between its memory read and its utilisation read, in
    # the middle of one poll: the scenario clock jumps past LOST_AT right there.
    rig.at(LOST_AT - 30)
    jump = Rule(
        "nvmlDeviceGetUtilizationRates", gpu=2, before=lambda: rig.at(LOST_AT + 1), once=True
    )
    rig.nvml.rules.append(jump)
    rig.poll()

    gpu2 = rig.gpus()[2]
    assert jump not in rig.nvml.rules, "the loss did not come mid-read"
    assert gpu2["lost"] is True
    assert gpu2["memory_used_bytes"] is None and gpu2["processes"] == []
    assert rig.gpu_metric("gpuwatch_gpu_lost", 2) == 1
    assert rig.gpu_metric("gpuwatch_gpu_up", 2) == 0
    assert rig.gpu_metric("gpuwatch_gpu_memory_used_bytes", 2) is None
    assert_fresh(rig, 0, LOST_AT - 30)
    assert_fresh(rig, 1, LOST_AT - 30)

    rig.at(LOST_AT + 60)  # later polls: still lost, the others still fresh
    rig.poll()
    assert rig.gpus()[2]["lost"] is True
    # NVML no longer answers its UUID: the board is still named as it was read, so the
    # alert says which one to pull and the server does not count a new GPU.
    assert _identity(rig.gpus()[2]) == board
    [info] = [
        labels
        for (n, labels) in rig.metrics()
        if n == "gpuwatch_gpu_info" and ("gpu", "2") in labels
    ]
    assert ("uuid", board[0]) in info and ("pci_bus_id", board[2]) in info
    assert_fresh(rig, 0, LOST_AT + 60)
    assert rig.agent.state.poll_counts() == {"success": 3}


def test_when_a_whole_poll_fails_the_last_good_values_are_not_served(rig: Rig) -> None:
    rig.at(60)
    rig.poll()
    assert_fresh(rig, 0, 60)

    rig.nvml.rules.append(Rule("nvmlDeviceGetCount", gpu=None, code=NVML_ERROR_UNKNOWN))
    rig.at(120)
    assert rig.agent.poll_once() is None  # NVML cannot even count the GPUs

    assert rig.agent.state.poll_counts() == {"success": 1, "failure": 1}
    for i in range(3):
        assert rig.gpu_metric("gpuwatch_gpu_memory_used_bytes", i) is None


def test_an_error_on_the_first_memory_read_does_not_cost_every_gpu_its_v2_figures(
    rig: Rig,
) -> None:
    # Was a bug: one UNKNOWN on the session's first v2 memory read switched every GPU
    # to v1 for good (no reserved figure; "used" then counts the reserved memory).
    rig.nvml.rules.append(Rule("nvmlDeviceGetMemoryInfo", gpu=0, code=NVML_ERROR_UNKNOWN))
    rig.at(60)
    rig.poll()
    rig.nvml.rules.clear()
    rig.at(120)
    rig.poll()
    for i in range(3):
        assert rig.gpus()[i]["memory_reserved_bytes"] is not None
        assert_fresh(rig, i, 120)


@pytest.mark.parametrize(("code", "name"), [(999, "unknown"), (10, "timeout")])
def test_a_process_list_nvml_would_not_give_is_unknown_not_empty(
    rig: Rig, code: int, name: str
) -> None:
    """The list failing is not "no processes": that read every context's memory as held
    by no visible process, and to the server every process on the GPU as ended (its
    lifetimes closed, reopened a poll later as new ones). Its processes are not visible
    this poll; the memory is still read."""
    rig.at(60)
    rig.poll()
    assert rig.gpus()[1]["processes"]
    rig.nvml.rules.append(Rule("nvmlDeviceGetComputeRunningProcesses", gpu=1, code=code))
    rig.at(120)
    rig.poll()
    gpu1 = rig.gpus()[1]
    assert gpu1["processes_visible"] is False and gpu1["unattributed_bytes"] is None
    assert gpu1["memory_used_bytes"] is not None and gpu1["read_error"] is None
    assert rig.nvml_errors(name) >= 1
    assert_fresh(rig, 0, 120)
