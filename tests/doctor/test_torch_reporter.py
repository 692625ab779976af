"""gpuwatch.torch against a real local HTTP server, fed real torch exception objects.

The CPU build of torch has no CUDA, so the allocator figures come from a scripted
AllocatorStats; the thread, the HTTP posts, the excepthook chain and the OOM handler
are the real ones.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from types import TracebackType

import pytest

import gpuwatch.torch as gt
from doctor.fake_agent_server import FakeAgent
from gpuwatch.torch import AllocatorSample
from gpuwatch.wire import INCIDENTS_OOM_PATH, TORCH_PATH, OomIncident, TorchReport

torch = pytest.importorskip("torch")

GIB = 2**30
NEW_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of "
    "which 1.12 GiB is free. Including non-PyTorch memory, this process has 22.51 GiB memory in "
    "use. Of the allocated memory 20.87 GiB is allocated by PyTorch, and 1.19 GiB is reserved by "
    "PyTorch but unallocated."
)
OLD_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity; 6.52 GiB "
    "already allocated; 9.31 MiB free; 6.57 GiB reserved in total by PyTorch)"
)


class ScriptedStats:
    """An AllocatorStats whose allocated memory climbs 1 GiB per sample."""

    def __init__(self, devices: list[int] | None = None) -> None:
        self._devices = [0] if devices is None else devices
        self.samples = 0
        self.resets = 0

    def devices(self) -> list[int]:
        return list(self._devices)

    def sample(self, device: int) -> AllocatorSample:
        self.samples += 1
        allocated = (10 + self.samples) * GIB
        return AllocatorSample(device, allocated, allocated + GIB, allocated + GIB // 2)

    def reset_peak(self, device: int) -> None:
        self.resets += 1

    def total_memory(self, device: int) -> int | None:
        return 24 * GIB


@pytest.fixture(autouse=True)
def clean_install() -> Iterator[None]:
    yield
    gt.uninstall()


def wait_for(agent: FakeAgent, path: str, count: int = 1) -> list[dict[str, object]]:
    deadline = time.monotonic() + 5
    while len(agent.posts.get(path, [])) < count and time.monotonic() < deadline:
        agent.received.wait(0.05)
        agent.received.clear()
    return agent.posts.get(path, [])


def test_reports_allocator_figures_from_a_daemon_thread(agent: FakeAgent) -> None:
    stats = ScriptedStats()
    gt.install(agent_url=agent.url, interval_seconds=0.02, stats=stats)
    posts = wait_for(agent, TORCH_PATH, count=2)
    assert len(posts) >= 2
    first = TorchReport.model_validate(posts[0])  # what the agent's /torch accepts
    assert first.device_index == 0
    assert first.allocated_bytes == 11 * GIB
    assert first.reserved_unallocated_bytes == GIB
    assert stats.resets >= 2  # peak is "since the last report"


def test_a_figure_the_wire_model_refuses_is_skipped_not_fatal(agent: FakeAgent) -> None:
    class Negative(ScriptedStats):
        def sample(self, device: int) -> AllocatorSample:
            return AllocatorSample(device, -1, 0, 0)  # a broken allocator reading

    reporter = gt.Reporter(agent_url=agent.url, stats=Negative())
    assert reporter.report_once() == 0
    assert TORCH_PATH not in agent.posts


def test_unreachable_agent_costs_the_caller_nothing(no_agent_url: str) -> None:
    started = time.monotonic()
    reporter = gt.install(agent_url=no_agent_url, interval_seconds=0.01, stats=ScriptedStats())
    assert time.monotonic() - started < 0.1
    assert reporter.report_once() == 0  # dropped silently
    time.sleep(0.05)  # the thread keeps running into refused connections without raising


def test_agent_url_from_the_environment(monkeypatch: pytest.MonkeyPatch, agent: FakeAgent) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_URL", agent.url)
    reporter = gt.install(interval_seconds=60, stats=ScriptedStats())
    assert reporter.agent_url == agent.url


def test_torch_without_cuda_reports_nothing(agent: FakeAgent) -> None:
    reporter = gt.Reporter(agent_url=agent.url)  # the real torch-backed source
    assert reporter.report_once() == 0
    assert "/torch" not in agent.posts


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.OutOfMemoryError(NEW_OOM),
        lambda: torch.cuda.OutOfMemoryError(NEW_OOM),
        lambda: RuntimeError(OLD_OOM),
    ],
    ids=["torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError", "old RuntimeError"],
)
def test_guard_reports_and_reraises(
    make, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    reporter = gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())
    exc = make()
    with pytest.raises(type(exc)) as raised, gt.guard(reporter):
        raise exc
    assert raised.value is exc
    incident = OomIncident.model_validate(wait_for(agent, INCIDENTS_OOM_PATH)[0])
    assert incident.message == str(exc)
    assert incident.device_index == 0
    explanation = incident.explanation
    assert isinstance(explanation, dict) and explanation["recognized"] is True
    assert explanation["diagnoses"]
    assert "gpuwatch: diagnosis of this out-of-memory error" in capsys.readouterr().err


def test_guard_as_decorator_and_non_oom_passes_untouched(agent: FakeAgent) -> None:
    reporter = gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())

    @gt.guard(reporter)
    def step(error: BaseException) -> None:
        raise error

    with pytest.raises(ValueError):
        step(ValueError("not memory"))
    with pytest.raises(RuntimeError):
        step(RuntimeError("Expected all tensors to be on the same device"))
    assert "/incidents/oom" not in agent.posts
    with pytest.raises(torch.OutOfMemoryError):
        step(torch.OutOfMemoryError(NEW_OOM))
    assert len(wait_for(agent, "/incidents/oom")) == 1


def test_excepthook_is_chained_and_reports_once(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[BaseException] = []

    def previous(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        seen.append(exc)

    monkeypatch.setattr(sys, "excepthook", previous)
    reporter = gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())
    assert sys.excepthook is not previous
    exc = torch.OutOfMemoryError(NEW_OOM)
    with pytest.raises(torch.OutOfMemoryError), gt.guard(reporter):
        raise exc
    sys.excepthook(type(exc), exc, None)  # what the interpreter does with it next
    assert seen == [exc]
    assert len(wait_for(agent, "/incidents/oom")) == 1  # not twice
    gt.uninstall()
    assert sys.excepthook is previous


def test_growth_history_reaches_the_diagnosis(agent: FakeAgent) -> None:
    reporter = gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())
    for _ in range(5):
        reporter.report_once()
    explanation = reporter.handle_oom(torch.OutOfMemoryError(NEW_OOM), stream=sys.stderr)
    assert "memory_held_across_steps" in [d.fix for d in explanation.diagnoses]


def test_log_epoch_peak_uses_reported_peaks(
    agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())
    reporter.report_once()  # peak 11.5 GiB
    reporter.report_once()  # peak 12.5 GiB
    with caplog.at_level(logging.INFO, logger="gpuwatch.torch"):
        peak = gt.log_epoch_peak(3)
    assert peak == 13 * GIB + GIB // 2  # the current counter is higher still
    assert (
        "epoch 3: peak allocated 13.50 GiB of 24.00 GiB on device 0 (44% headroom)" in caplog.text
    )


def test_base_package_never_imports_torch() -> None:
    code = (
        "import sys, gpuwatch, gpuwatch.cli, gpuwatch.doctor.explain; "
        "assert 'torch' not in sys.modules and 'gpuwatch.torch' not in sys.modules; "
        "import gpuwatch.torch; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
