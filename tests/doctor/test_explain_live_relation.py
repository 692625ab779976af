"""explain's live view against what the message says: the process that printed it, the
processes it blames that have gone, another host's message, and MIG instances."""

from __future__ import annotations

from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.report import render
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, MigInstance, ProcessOwner

GIB = 2**30
NOW = 1_700_500_000.0


def _process(
    pid: int, gib: float, user: str, *, kernel: bool = False, instance: int | None = None
) -> GpuProcess:
    return GpuProcess(
        pid=pid,
        used_bytes=int(gib * GIB),
        sm_ratio=0.0,
        name="python",
        command="python -m ipykernel_launcher" if kernel else "python job.py",
        start_time=NOW - 7200,
        jupyter_kernel=kernel,
        gpu_instance_id=instance,
        owner=ProcessOwner(user=user, uid=2000 + pid % 100),
    )


def _snapshot(*gpus: Gpu, hostname: str = "node-a") -> HostSnapshot:
    return HostSnapshot(
        agent_id="a",
        hostname=hostname,
        boot_id="b",
        sequence=1,
        collected_at=NOW,
        gpus=list(gpus),
    )


def _card(index: int, processes: list[GpuProcess], *, total_gib: float = 32) -> Gpu:
    used = sum(p.used_bytes or 0 for p in processes)
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA Test",
        memory_total_bytes=int(total_gib * GIB),
        memory_used_bytes=used,
        memory_free_bytes=int(total_gib * GIB) - used,
        processes=processes,
    )


# A 32 GiB card (31.36 GiB as CUDA prints it): a neighbour's 18 GiB, this process's 12 GiB.
SELF_AND_NEIGHBOUR = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a "
    "total capacity of 31.36 GiB of which 900.00 MiB is free. Process 60606 has 18.00 GiB "
    "memory in use. Including non-PyTorch memory, this process has 12.40 GiB memory in use. "
    "Of the allocated memory 11.50 GiB is allocated by PyTorch, and 300.00 MiB is reserved "
    "by PyTorch but unallocated."
)


def test_the_kernel_that_printed_the_oom_is_marked_and_never_offered_for_a_kill() -> None:
    # The notebook that failed keeps its 12.4 GiB; the blamed 60606 has exited since.
    kernel = _process(7101, 12.41, "dana", kernel=True)
    snapshot = _snapshot(_card(0, [kernel]))
    explanation = explain(SELF_AND_NEIGHBOUR, snapshot=snapshot, now=NOW)
    assert explanation.live is not None
    assert explanation.live.processes[0].probably_this_process is True
    assert explanation.live.absent_message_pids == [60606]
    commands = "\n".join(d for diag in explanation.diagnoses for d in diag.commands)
    assert "kill 7101" not in commands and "reap --pid 7101" not in commands
    assert "probably the process that printed this message" in commands
    assert "pid 60606 (18.00 GiB per the message) is not on this GPU now" in commands
    # The card has room now: the report says a retry may work.
    assert any("enough for the 3.00 GiB request" in n for n in explanation.notes)


def test_a_neighbour_still_there_is_offered_and_this_process_is_not() -> None:
    neighbour = _process(60606, 18.0, "erin")
    mine = _process(7101, 12.45, "dana")
    snapshot = _snapshot(_card(0, [neighbour, mine]))
    explanation = explain(SELF_AND_NEIGHBOUR, snapshot=snapshot, now=NOW)
    commands = explanation.diagnoses[0].commands
    assert "gpuwatch reap --pid 60606   # or: kill 60606" in commands
    assert not any("7101" in c and ("reap --pid" in c or "kill" in c) for c in commands)
    assert explanation.live is not None and explanation.live.absent_message_pids == []
    assert not any("enough for the" in n for n in explanation.notes)  # still full


def test_a_live_process_of_the_reserve_size_is_this_process_without_this_process_figure() -> None:
    # 1.x wording: no "this process"; PyTorch reserved 9.5 GiB, a live process holds 10 GiB.
    text = (
        "RuntimeError: CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 31.36 GiB total "
        "capacity; 9.00 GiB already allocated; 200.00 MiB free; 9.50 GiB reserved in total by "
        "PyTorch)"
    )
    snapshot = _snapshot(_card(0, [_process(8202, 10.0, "fay"), _process(8303, 21.0, "gus")]))
    explanation = explain(text, snapshot=snapshot, now=NOW)
    assert explanation.live is not None
    marks = {p.pid: p.probably_this_process for p in explanation.live.processes}
    assert marks == {8202: True, 8303: False}
    commands = explanation.diagnoses[0].commands
    assert "gpuwatch reap --pid 8303   # or: kill 8303" in commands
    assert not any("reap --pid 8202" in c for c in commands)


NCCL_ELSEWHERE = (
    "worker-17:4401:4460 [2] include/alloc.h:103 NCCL WARN Cuda failure 'out of memory'\n"
    "worker-17:4401:4460 [2] NCCL INFO transport.cc:120 -> 1\n"
)


def test_a_message_from_another_host_gets_no_live_view() -> None:
    busy = _card(2, [_process(9909, 20.0, "hal")])
    snapshot = _snapshot(_card(0, []), _card(1, []), busy, hostname="login-3")
    explanation = explain(NCCL_ELSEWHERE, snapshot=snapshot, now=NOW)
    assert explanation.live is None
    assert explanation.live_note is not None
    assert "from worker-17; this agent is on login-3" in explanation.live_note
    assert all(d.fix != "other_processes" for d in explanation.diagnoses)
    assert "9909" not in render(explanation)


def test_the_same_host_fully_qualified_keeps_the_live_view() -> None:
    snapshot = _snapshot(
        _card(0, []), _card(1, []), _card(2, [_process(9909, 20.0, "hal")]),
        hostname="Worker-17.cluster.local",
    )  # fmt: skip
    explanation = explain(NCCL_ELSEWHERE, snapshot=snapshot, now=NOW)
    assert explanation.live is not None and explanation.live.index == 2


def _mig_gpu() -> Gpu:
    inside = _process(3131, 30.0, "ivy", instance=1)
    elsewhere = _process(3232, 15.0, "jon", instance=2)
    return Gpu(
        index=0,
        uuid="GPU-mig",
        name="NVIDIA A100 80GB",
        memory_total_bytes=80 * GIB,
        memory_used_bytes=45 * GIB,
        memory_free_bytes=35 * GIB,
        processes=[inside, elsewhere],
        mig_instances=[
            MigInstance(index=0, uuid="MIG-a", gpu_instance_id=1, profile="4g.40gb",
                        memory_total_bytes=39_600_000_000, memory_used_bytes=30 * GIB),
            MigInstance(index=1, uuid="MIG-b", gpu_instance_id=2, profile="3g.40gb-x",
                        memory_total_bytes=20_000_000_000, memory_used_bytes=15 * GIB),
        ],
    )  # fmt: skip


def test_a_mig_instance_of_the_message_size_is_matched_with_only_its_processes() -> None:
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
        "total capacity of 36.75 GiB of which 500.00 MiB is free. Including non-PyTorch memory, "
        "this process has 6.00 GiB memory in use. Process 3131 has 30.00 GiB memory in use. "
        "Of the allocated memory 5.20 GiB is allocated by PyTorch, and 100.00 MiB is reserved "
        "by PyTorch but unallocated."
    )
    explanation = explain(text, snapshot=_snapshot(_mig_gpu()), now=NOW)
    live = explanation.live
    assert live is not None and live.mig_profile == "4g.40gb"
    assert [p.pid for p in live.processes] == [3131]
    commands = "\n".join(explanation.diagnoses[0].commands)
    assert "3232" not in commands and "reap --pid 3131" in commands
    assert explanation.live_note is not None and "MIG instance 4g.40gb" in explanation.live_note
