"""gpuwatch.torch against a real local HTTP server, fed real torch exception objects.

The CPU build of torch has no CUDA, so the allocator figures come from a scripted
AllocatorStats; the thread, the HTTP posts, the excepthook chain and the OOM handler
are the real ones.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
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
    # PyTorch's peak counters are the process's own: never reset unless asked.
    assert stats.resets == 0


def test_per_report_peaks_are_opt_in(agent: FakeAgent) -> None:
    stats = ScriptedStats()
    reporter = gt.install(
        agent_url=agent.url, interval_seconds=60, stats=stats, reset_peak_each_report=True
    )
    assert reporter is not None
    reporter.report_once()
    reporter.report_once()
    assert stats.resets == 2


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
    assert time.monotonic() - started < 0.4  # below the report timeout: nothing waited on
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
    # Reserved (no reserved peak from this source: the current reserved, 14 GiB, is
    # higher than every reported one).
    assert peak == 14 * GIB
    assert "epoch 3: peak reserved 14.00 GiB of 24.00 GiB on device 0 (42% headroom)" in caplog.text


def test_base_package_never_imports_torch() -> None:
    code = (
        "import sys, gpuwatch, gpuwatch.cli, gpuwatch.doctor.explain; "
        "assert 'torch' not in sys.modules and 'gpuwatch.torch' not in sys.modules; "
        "import gpuwatch.torch; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- the peak that matters, and PyTorch's counters left alone -----------------------------


class CacheHeavyStats(ScriptedStats):
    """10 GiB of tensors at most, but a 22.5 GiB cache: the card lost 22.5 GiB."""

    def sample(self, device: int) -> AllocatorSample:
        return AllocatorSample(
            device, 8 * GIB, 22 * GIB, 10 * GIB, peak_reserved_bytes=22 * GIB + GIB // 2
        )


def test_log_epoch_peak_compares_the_reserved_peak_with_the_card(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats = CacheHeavyStats()
    gt.install(agent_url="http://127.0.0.1:9", interval_seconds=60, stats=stats)
    with caplog.at_level(logging.INFO, logger="gpuwatch.torch"):
        peak = gt.log_epoch_peak(1)
    assert peak == 22 * GIB + GIB // 2
    (record,) = [r for r in caplog.records if "epoch 1" in r.getMessage()]
    assert record.levelno == logging.WARNING  # 6% headroom, not the 58% allocated suggests
    assert "peak reserved 22.50 GiB of 24.00 GiB" in record.getMessage()
    assert stats.resets == 0  # the training code's max_memory_*() still count from its start
    gt.log_epoch_peak(2, reset_peak=True)
    assert stats.resets == 1


# --- which GPU: UUIDs, CUDA_VISIBLE_DEVICES ------------------------------------------------

UUID_3 = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


def test_reports_name_the_gpu_by_uuid(agent: FakeAgent) -> None:
    reporter = gt.Reporter(
        agent_url=agent.url,
        stats=ScriptedStats(),
        identify=lambda ordinal: gt.DeviceRef(index=3, uuid=UUID_3),
    )
    assert reporter.report_once() == 1
    report = TorchReport.model_validate(agent.posts[TORCH_PATH][0])
    assert (report.device_index, report.device_uuid) == (3, UUID_3)


MIG_UUID = "MIG-84fa1e39-2b1b-5f5d-9a0c-0c3b2c1d0e01"


@pytest.mark.parametrize("printed", [UUID_3[4:], MIG_UUID[4:]])
def test_torch_uuid_is_sent_bare_as_torch_prints_it(
    monkeypatch: pytest.MonkeyPatch, printed: str
) -> None:
    # PyTorch prints a GPU's UUID and a MIG instance's alike, without a prefix: adding
    # "GPU-" would turn a MIG instance's into a GPU UUID no device has. The agent
    # compares UUIDs without their prefix (tests/agent/test_uuid_forms.py).
    from types import SimpleNamespace

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f" {printed}\n")
    )
    assert gt.cuda_device_ref(0) == gt.DeviceRef(index=0, uuid=printed)


@pytest.mark.parametrize(
    "entry", ["GPU-8932f937", f"MIG-GPU-{UUID_3[4:]}/1/0", MIG_UUID, MIG_UUID[:12]]
)
def test_a_uuid_in_cuda_visible_devices_is_sent_as_written(
    monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    # A unique prefix and CUDA 11's MIG form are the agent's to resolve.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
    assert gt.cuda_device_ref(0) == gt.DeviceRef(index=0, uuid=entry)


def test_without_a_uuid_cuda_visible_devices_translates_the_ordinal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CPU build cannot tell a UUID: CUDA_VISIBLE_DEVICES still says which GPU it is.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gt.cuda_device_ref(0) == gt.DeviceRef(index=3, uuid=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"5, {UUID_3}")
    assert gt.cuda_device_ref(0) == gt.DeviceRef(index=5, uuid=None)
    assert gt.cuda_device_ref(1) == gt.DeviceRef(index=1, uuid=UUID_3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gt.cuda_device_ref(0) == gt.DeviceRef(index=0, uuid=None)


def test_an_oom_incident_under_cuda_visible_devices_names_the_visible_gpu(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    reporter = gt.Reporter(agent_url=agent.url, stats=ScriptedStats())
    reporter.handle_oom(torch.OutOfMemoryError(NEW_OOM), stream=sys.stderr)  # "GPU 0"
    incident = OomIncident.model_validate(agent.posts[INCIDENTS_OOM_PATH][0])
    assert incident.device_index == 3


def _reporter_to_an_old_agent() -> tuple[gt.Reporter, list[dict[str, object]]]:
    """A reporter for GPU 3 whose agent predates ``device_uuid`` (422 when it is sent),
    and the bodies it is sent."""
    import httpx

    bodies: list[dict[str, object]] = []

    def old_agent(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(422 if "device_uuid" in body else 204)

    reporter = gt.Reporter(
        agent_url="http://127.0.0.1:9",
        stats=ScriptedStats(),
        transport=httpx.MockTransport(old_agent),
        identify=lambda ordinal: gt.DeviceRef(index=3, uuid=UUID_3),
    )
    return reporter, bodies


def test_an_agent_that_predates_device_uuid_gets_the_index_alone() -> None:
    reporter, bodies = _reporter_to_an_old_agent()
    assert reporter.report_once() == 1
    assert reporter.report_once() == 1
    assert ["device_uuid" in b for b in bodies] == [True, False, False]
    assert all(b["device_index"] == 3 for b in bodies)


# --- no device for memory no GPU holds -----------------------------------------------------

HOST_OOM = (
    "RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough "
    "memory: you tried to allocate 1000000000 bytes."
)
MPS_OOM = (
    "MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 2.00 GB, max "
    "allowed: 3.00 GB). Tried to allocate 256 MB on private pool."
)
XPU_OOM = "XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB"


@pytest.mark.parametrize("message", [HOST_OOM, MPS_OOM, XPU_OOM], ids=["host", "mps", "xpu"])
def test_an_oom_outside_cuda_memory_names_no_gpu(agent: FakeAgent, message: str) -> None:
    # This process holds CUDA memory on device 0 (ScriptedStats): that is still no reason
    # to pin a host-RAM (or MPS, XPU) OOM on NVML's GPU 0.
    reporter = gt.Reporter(agent_url=agent.url, stats=ScriptedStats())
    reporter.handle_oom(RuntimeError(message), stream=sys.stderr)
    incident = OomIncident.model_validate(agent.posts[INCIDENTS_OOM_PATH][0])
    assert incident.device_index is None and incident.device_uuid is None


def test_an_unrecognised_oom_in_a_process_without_cuda_memory_names_no_gpu(
    agent: FakeAgent,
) -> None:
    reporter = gt.Reporter(agent_url=agent.url, stats=ScriptedStats(devices=[]))
    reporter.handle_oom(torch.OutOfMemoryError("something new"), stream=sys.stderr)
    incident = OomIncident.model_validate(agent.posts[INCIDENTS_OOM_PATH][0])
    assert incident.device_index is None  # not a guessed 0


# --- never break the training process -----------------------------------------------------


def test_a_malformed_agent_url_never_replaces_the_users_oom(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_URL", "http://[::1")
    with caplog.at_level(logging.INFO, logger="gpuwatch.torch"):
        reporter = gt.install(interval_seconds=0.01, stats=ScriptedStats())
    assert reporter is not None and reporter.url_problem is not None
    assert sum("unusable" in r.getMessage() for r in caplog.records) == 1
    assert reporter.report_once() == 0  # no InvalidURL out of a report either
    exc = torch.OutOfMemoryError(NEW_OOM)
    with pytest.raises(torch.OutOfMemoryError) as raised, gt.guard():
        raise exc
    assert raised.value is exc
    # Without install() too: the offline reporter reads the same URL.
    gt.uninstall()
    other = torch.OutOfMemoryError(NEW_OOM)
    with pytest.raises(torch.OutOfMemoryError) as raised, gt.guard():
        raise other
    assert raised.value is other


def test_handle_oom_never_raises(agent: FakeAgent) -> None:
    class Broken(ScriptedStats):
        def devices(self) -> list[int]:
            raise AssertionError("Torch not compiled with CUDA enabled")

    reporter = gt.Reporter(agent_url=agent.url, stats=Broken())
    reporter._post = lambda *a, **k: 1 / 0  # type: ignore[method-assign]  # any failure inside
    explanation = reporter.handle_oom(torch.OutOfMemoryError("odd"), stream=sys.stderr)
    assert explanation.recognized is False


def test_install_without_cuda_does_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert not torch.cuda.is_available()  # the CPU build in this venv
    hook = sys.excepthook
    with caplog.at_level(logging.INFO, logger="gpuwatch.torch"):
        assert gt.install(interval_seconds=0.01) is None
    assert sys.excepthook is hook
    assert not [t for t in threading.enumerate() if t.name == "gpuwatch-torch-reporter"]
    (record,) = [r for r in caplog.records if r.name == "gpuwatch.torch"]
    assert "no usable CUDA" in record.getMessage()


def test_install_without_torch_does_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with caplog.at_level(logging.INFO, logger="gpuwatch.torch"):
        assert gt.install(interval_seconds=0.01) is None
    assert "torch cannot be imported" in caplog.text


def test_a_failing_allocator_read_never_ends_the_reporter(
    agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    class Flaky(ScriptedStats):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def devices(self) -> list[int]:
            self.calls += 1
            if self.calls <= 3:  # torch missing, CUDA not compiled in, ...
                raise (ImportError, AssertionError, TypeError)[self.calls - 1]("no")
            return [0]

    with caplog.at_level(logging.DEBUG, logger="gpuwatch.torch"):
        gt.install(agent_url=agent.url, interval_seconds=0.01, stats=Flaky())
        assert wait_for(agent, TORCH_PATH)  # the thread lived on past three failures
    failures = [r for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(failures) == 3 and [r.levelno for r in failures].count(logging.INFO) == 1


def test_log_epoch_peak_without_torch_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    assert gt.log_epoch_peak(1) is None


# --- the live view is of the GPU the reporter resolved -------------------------------------

A6000_OOM = (
    "CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 47.54 GiB of "
    "which 3.10 GiB is free. Including non-PyTorch memory, this process has 44.40 GiB memory in "
    "use. Of the allocated memory 40.00 GiB is allocated by PyTorch, and 3.20 GiB is reserved by "
    "PyTorch but unallocated."
)


def four_identical_cards() -> object:
    """Four 48 GiB cards; on each, another user's process with a telling command."""
    from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

    def gpu(index: int) -> Gpu:
        other = GpuProcess(
            pid=7000 + index,
            used_bytes=2 * GIB,
            command=f"python job_on_gpu{index}.py",
            owner=ProcessOwner(user=f"user{index}", uid=2000 + index),
        )
        return Gpu(
            index=index,
            uuid=f"GPU-{index}0000000-0000-0000-0000-000000000000",
            name="NVIDIA RTX A6000",
            memory_total_bytes=48 * GIB,
            memory_used_bytes=46 * GIB,
            memory_free_bytes=2 * GIB,
            processes=[other],
        )

    return HostSnapshot(
        agent_id="a", hostname="vm", boot_id="b", sequence=1, collected_at=time.time(),
        gpus=[gpu(i) for i in range(4)],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("visible", "ref", "shown"),
    [
        ("3", None, 3),  # CUDA_VISIBLE_DEVICES=3: PyTorch's "GPU 0" is NVML's GPU 3
        (None, gt.DeviceRef(index=0, uuid="20000000-0000-0000-0000-000000000000"), 2),
    ],
    ids=["cuda-visible-devices", "uuid"],
)
def test_the_printed_live_view_is_of_the_gpu_the_reporter_resolved(
    agent: FakeAgent,
    monkeypatch: pytest.MonkeyPatch,
    visible: str | None,
    ref: gt.DeviceRef | None,
    shown: int,
) -> None:
    import io

    agent.snapshot = four_identical_cards()  # type: ignore[assignment]
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    reporter = gt.Reporter(
        agent_url=agent.url,
        stats=ScriptedStats(),
        identify=None if ref is None else (lambda ordinal: ref),
    )
    out = io.StringIO()
    explanation = reporter.handle_oom(torch.OutOfMemoryError(A6000_OOM), stream=out)
    text = out.getvalue()
    assert explanation.live is not None and explanation.live.index == shown
    assert f"Right now on vm, GPU {shown} (NVIDIA RTX A6000)" in text
    assert f"job_on_gpu{shown}.py" in text and "job_on_gpu0.py" not in text
    assert explanation.device == "cuda:0"  # as the message and the training code say


def test_a_uuid_no_gpu_of_the_host_has_gets_no_live_view(agent: FakeAgent) -> None:
    import io

    agent.snapshot = four_identical_cards()  # type: ignore[assignment]
    reporter = gt.Reporter(
        agent_url=agent.url,
        stats=ScriptedStats(),
        identify=lambda ordinal: gt.DeviceRef(index=0, uuid="GPU-elsewhere"),
    )
    explanation = reporter.handle_oom(torch.OutOfMemoryError(A6000_OOM), stream=io.StringIO())
    assert explanation.recognized and explanation.live is None  # not GPU 0's by its ordinal


# --- small things that must not break the job ----------------------------------------------


def test_an_oom_in_another_thread_is_diagnosed(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())
    exc = torch.OutOfMemoryError(NEW_OOM)

    def train() -> None:
        raise exc

    trainer = threading.Thread(target=train, name="trainer")
    trainer.start()
    trainer.join()
    assert "gpuwatch: diagnosis of this out-of-memory error" in capsys.readouterr().err
    assert len(wait_for(agent, INCIDENTS_OOM_PATH)) == 1
    assert seen == [exc]  # chained: the previous hook still sees it
    gt.uninstall()
    assert threading.excepthook is not gt._thread_excepthook


def test_uninstall_keeps_a_hook_installed_after_install(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append("original"))
    gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())
    under = sys.excepthook

    def crash_reporter(*args: object) -> None:
        seen.append("crash reporter")
        under(*args)  # type: ignore[arg-type]

    sys.excepthook = crash_reporter
    gt.uninstall()
    assert sys.excepthook is crash_reporter
    sys.excepthook(ValueError, ValueError("boom"), None)
    assert seen == ["crash reporter", "original"]  # and gpuwatch's passes it on
    gt.install(agent_url=agent.url, interval_seconds=60, stats=ScriptedStats())
    assert sys.excepthook is crash_reporter  # not wrapped twice


@pytest.mark.parametrize("interval", [float("inf"), float("nan"), 0, -1.0, 1e12, True, "10"])
def test_an_interval_the_thread_cannot_wait_on_is_refused_at_install(
    interval: object, agent: FakeAgent
) -> None:
    with pytest.raises(ValueError, match="interval_seconds must be a number of seconds above 0"):
        gt.install(agent_url=agent.url, interval_seconds=interval, stats=ScriptedStats())  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name == "gpuwatch-torch-reporter"]


def test_a_listener_that_refuses_everything_does_not_cost_the_uuid() -> None:
    import httpx

    bodies: list[dict[str, object]] = []
    refusing = [True]

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(422 if refusing[0] else 204)

    reporter = gt.Reporter(
        agent_url="http://127.0.0.1:9",
        stats=ScriptedStats(),
        transport=httpx.MockTransport(answer),
        identify=lambda ordinal: gt.DeviceRef(index=3, uuid=UUID_3),
    )
    assert reporter.report_once() == 0  # 422 with the UUID and without: not about it
    refusing[0] = False  # the agent is back
    assert reporter.report_once() == 1
    assert bodies[-1]["device_uuid"] == UUID_3


def test_an_agent_that_predates_device_uuid_is_asked_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reporter, bodies = _reporter_to_an_old_agent()
    assert reporter.report_once() == 1
    monkeypatch.setattr(gt, "UUID_RETRY_SECONDS", 0.0)  # upgraded since
    assert reporter.report_once() == 1
    assert ["device_uuid" in b for b in bodies] == [True, False, True, False]


@pytest.mark.parametrize("visible", ["²", "٣", "9" * 5000, "3²", "0x1", "GPU-\udcff"])
def test_cuda_device_ref_never_raises(monkeypatch: pytest.MonkeyPatch, visible: str) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gt.cuda_device_ref(0).index == 0


@pytest.mark.parametrize(
    "url",
    [
        "http://gpu-node..cluster:9402",  # an empty label: the resolver's IDNA codec refuses it
        "http://" + "a" * 64 + ".cluster:9402",  # a label over 63 characters
        "http://127.0.0.1:9402?x=1",  # /torch would go after the query
        "http://127.0.0.1:9402#frag",  # and be dropped after the fragment
    ],
)
def test_an_agent_url_that_cannot_work_is_one_warning_and_the_diagnosis_still_prints(
    url: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with caplog.at_level(logging.INFO, logger="gpuwatch"):
        reporter = gt.install(agent_url=url, interval_seconds=0.01, stats=ScriptedStats())
        assert reporter is not None and reporter.url_problem is not None
        with pytest.raises(torch.OutOfMemoryError), gt.guard():
            raise torch.OutOfMemoryError(NEW_OOM)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unusable" in warnings[0]
    assert not any("allocator" in r.getMessage() for r in caplog.records)
    assert "gpuwatch: diagnosis of this out-of-memory error" in capsys.readouterr().err
