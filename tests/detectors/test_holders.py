"""detect_share, detect_orphan and detect_unattributed on snapshot fragments."""

from __future__ import annotations

import pytest

from gpuwatch.detectors import detect_orphan, detect_share, detect_unattributed
from gpuwatch.snapshot import Gpu, GpuProcess, MigInstance, ProcessOwner

GIB = 2**30


def proc(pid: int, used: int | None = 4 * GIB, user: str | None = "ana") -> GpuProcess:
    return GpuProcess(pid=pid, used_bytes=used, owner=ProcessOwner(user=user))


def gpu(*processes: GpuProcess, total: int | None = 80 * GIB) -> Gpu:
    return Gpu(index=0, uuid="GPU-0", memory_total_bytes=total, processes=list(processes))


# --- share -----------------------------------------------------------------------------


def test_process_above_the_share_of_a_shared_gpu_is_runaway() -> None:
    hog, other = proc(1, 76 * GIB, "ana"), proc(2, 2 * GIB, "bo")
    finding = detect_share(hog, gpu(hog, other), share_ratio=0.9)
    assert finding is not None
    assert (finding.kind, finding.reason) == ("runaway", "share")
    assert finding.held_bytes == 76 * GIB
    assert finding.evidence["share_ratio"] == pytest.approx(0.95)
    assert finding.evidence["users"] == ["ana", "bo"]
    assert finding.evidence["processes"] == 2
    assert "95%" in finding.summary


def test_two_processes_of_one_user_make_a_shared_gpu() -> None:
    hog, other = proc(1, 76 * GIB), proc(2, 1 * GIB)
    assert detect_share(hog, gpu(hog, other), share_ratio=0.9) is not None


def test_process_alone_on_its_gpu_is_not_runaway() -> None:
    hog = proc(1, 79 * GIB)
    assert detect_share(hog, gpu(hog), share_ratio=0.9) is None


def test_share_at_or_below_the_ratio_is_fine() -> None:
    hog, other = proc(1, 72 * GIB), proc(2, 1 * GIB)
    assert detect_share(hog, gpu(hog, other), share_ratio=0.9) is None


def test_unknown_memory_or_total_gives_no_share_finding() -> None:
    hog, other = proc(1, None), proc(2)
    assert detect_share(hog, gpu(hog, other), share_ratio=0.9) is None
    hog = proc(1, 76 * GIB)
    assert detect_share(hog, gpu(hog, other, total=None), share_ratio=0.9) is None


def test_mig_parent_gives_no_share_finding() -> None:
    hog, other = proc(1, 76 * GIB), proc(2)
    board = gpu(hog, other).model_copy(
        update={"mig_instances": [MigInstance(index=0, uuid="MIG-0")]}
    )
    assert detect_share(hog, board, share_ratio=0.9) is None


# --- orphan ----------------------------------------------------------------------------


def with_facts(process: GpuProcess, **facts: object) -> GpuProcess:
    return process.model_copy(update=facts)


def test_dead_pid_holding_memory_is_orphaned() -> None:
    finding = detect_orphan(with_facts(proc(41, 6 * GIB), alive=False))
    assert finding is not None
    assert (finding.kind, finding.reason) == ("orphaned", "dead_pid")
    assert finding.held_bytes == 6 * GIB
    assert "41" in finding.summary and "6.0 GiB" in finding.summary


def test_pid_hidden_by_a_pid_namespace_is_not_called_dead() -> None:
    assert detect_orphan(with_facts(proc(41), alive=False, visible=False)) is None


def test_reparented_process_is_orphaned() -> None:
    finding = detect_orphan(with_facts(proc(42), orphaned=True, ppid=1))
    assert finding is not None
    assert finding.reason == "reparented"
    assert finding.evidence["ppid"] == 1


def test_jupyter_kernel_without_its_server_is_orphaned() -> None:
    kernel = with_facts(proc(43), jupyter_kernel=True, jupyter_server_alive=False, orphaned=True)
    finding = detect_orphan(kernel)
    assert finding is not None
    assert finding.reason == "jupyter_server_gone"


def test_jupyter_kernel_with_unknown_server_state_is_not_judged() -> None:
    assert detect_orphan(with_facts(proc(43), jupyter_kernel=True)) is None


@pytest.mark.parametrize(
    ("owner", "label"),
    [
        (ProcessOwner(slurm_job_id="8812"), "Slurm job 8812"),
        (ProcessOwner(pod_uid="p-1"), "pod p-1"),
    ],
)
def test_reparented_process_of_a_job_or_pod_means_the_job_ended(
    owner: ProcessOwner, label: str
) -> None:
    finding = detect_orphan(with_facts(proc(44), orphaned=True, owner=owner))
    assert finding is not None
    assert finding.reason == "job_ended"
    assert label in finding.summary


def test_healthy_process_is_not_orphaned() -> None:
    assert detect_orphan(proc(45)) is None


def test_dead_pid_holding_nothing_is_not_reported() -> None:
    assert detect_orphan(with_facts(proc(46, 0), alive=False)) is None


def test_dead_pid_with_unreadable_memory_still_holds_a_context() -> None:
    finding = detect_orphan(with_facts(proc(47, None), alive=False))
    assert finding is not None
    assert finding.held_bytes is None
    assert "unknown amount" in finding.summary


# --- unattributed ------------------------------------------------------------------------


def board(unattributed: int | None, **facts: object) -> Gpu:
    return gpu(proc(1)).model_copy(update={"unattributed_bytes": unattributed, **facts})


def test_memory_no_process_holds_is_unattributed() -> None:
    finding = detect_unattributed(board(3 * GIB), min_bytes=1 * GIB)
    assert finding is not None
    assert (finding.kind, finding.reason) == ("orphaned", "unattributed")
    assert finding.held_bytes == 3 * GIB
    assert finding.evidence["processes"] == 1


def test_unattributed_below_the_minimum_is_ignored() -> None:
    assert detect_unattributed(board(512 * 2**20), min_bytes=1 * GIB) is None
    assert detect_unattributed(board(None), min_bytes=0) is None


@pytest.mark.parametrize(
    "facts",
    [
        {"processes_visible": False},
        {"coherent_memory": True},
        {"mig_instances": [MigInstance(index=0, uuid="MIG-0")]},
        {"lost": True},
        {"read_error": "timeout"},
    ],
)
def test_unattributed_is_masked_where_it_is_not_a_leak_signal(facts: dict[str, object]) -> None:
    assert detect_unattributed(board(3 * GIB, **facts), min_bytes=1 * GIB) is None


def test_a_desktop_or_an_empty_context_beside_one_job_is_not_sharing() -> None:
    # A workstation: one job at 93% of a 24 GiB card, beside Xorg (a graphics client at
    # a few hundred MiB, or of unknown size) or a compute process holding nothing.
    hog = proc(1, int(22.3 * GIB))
    for other in (
        GpuProcess(pid=2, kind="graphics", used_bytes=300 * 2**20),
        GpuProcess(pid=2, kind="graphics", used_bytes=None),
        proc(2, 0),
        proc(2, 100 * 2**20),
    ):
        assert detect_share(hog, gpu(hog, other, total=24 * GIB), share_ratio=0.9) is None
    # A second job of any size worth naming, or of unknown size, shares it.
    for other in (proc(2, 1 * GIB), proc(2, None)):
        assert detect_share(hog, gpu(hog, other, total=24 * GIB), share_ratio=0.9) is not None
