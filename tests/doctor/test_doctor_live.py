"""fetch_local_snapshot against a real HTTP server, and the live view explain adds."""

from __future__ import annotations

import time

from doctor.fake_agent_server import COLLECTED_AT, FakeAgent
from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.live import fetch_local_snapshot, live_gpu
from gpuwatch.doctor.report import render

# Another process holds the card: this one has 1.2 GiB and nothing is free.
STARVED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 20.00 MiB is free. Including non-PyTorch memory, this process "
    "has 1.20 GiB memory in use. Of the allocated memory 800.00 MiB is allocated by PyTorch, and "
    "100.00 MiB is reserved by PyTorch but unallocated."
)


def test_fetches_and_validates_the_snapshot(agent: FakeAgent) -> None:
    snapshot = fetch_local_snapshot(agent.url)
    assert snapshot is not None
    assert snapshot.hostname == "gpu-box"
    assert [p.pid for p in snapshot.gpus[0].processes] == [5151, 4242]


def test_accepts_the_full_snapshot_url(agent: FakeAgent) -> None:
    assert fetch_local_snapshot(agent.url + "/snapshot/") is not None


def test_absent_agent_gives_none_quickly(no_agent_url: str) -> None:
    started = time.monotonic()
    assert fetch_local_snapshot(no_agent_url, timeout=0.5) is None
    assert time.monotonic() - started < 2


def test_http_error_and_garbage_give_none(agent: FakeAgent) -> None:
    agent.snapshot = 503
    assert fetch_local_snapshot(agent.url) is None
    agent.snapshot = b'{"not": "a snapshot"}'
    assert fetch_local_snapshot(agent.url) is None
    agent.snapshot = b"\xff\xfe garbage"
    assert fetch_local_snapshot(agent.url) is None


def test_live_view_ages_processes_and_sorts_by_memory(agent: FakeAgent) -> None:
    snapshot = fetch_local_snapshot(agent.url)
    assert snapshot is not None
    view = live_gpu(snapshot, 0, now=COLLECTED_AT)
    assert view is not None
    notebook = view.processes[0]
    assert (notebook.pid, notebook.user, notebook.sm_ratio) == (4242, "alice", 0.0)
    assert notebook.running_seconds == 3 * 3600 + 300
    # A snapshot is one instant: idle duration is not knowable from it.
    assert notebook.idle_seconds is None
    assert live_gpu(snapshot, 3) is None


def test_explain_names_the_live_holders_with_commands(agent: FakeAgent) -> None:
    snapshot = fetch_local_snapshot(agent.url)
    explanation = explain(STARVED, snapshot=snapshot, now=COLLECTED_AT)
    first = explanation.diagnoses[0]
    assert first.fix == "other_processes"
    assert "gpuwatch reap --pid 4242   # or: kill 4242" in first.commands
    assert any("alice" in c and "SM 0% now" in c and "running 3h05m" in c for c in first.commands)
    text = render(explanation)
    assert "Right now on gpu-box, GPU 0 (NVIDIA GeForce RTX 4090):" in text
    assert "pid 4242 alice" in text


def test_driver_error_uses_the_live_view_as_evidence(agent: FakeAgent) -> None:
    snapshot = fetch_local_snapshot(agent.url)
    explanation = explain("RuntimeError: CUDA error: out of memory", snapshot=snapshot)
    assert [d.fix for d in explanation.diagnoses] == ["other_processes", "unknown"]
    assert "live view" in explanation.diagnoses[0].evidence
    # No card size in the message: nothing ties it to this GPU, so the view is shown
    # with a note, and only the reaper (which checks idleness itself) is offered.
    assert explanation.live is not None and explanation.live.confirmed is False
    assert explanation.live_note is not None and "gives no card size" in explanation.live_note
    commands = explanation.diagnoses[0].commands
    assert "gpuwatch reap --pid 4242" in commands
    assert not any("kill" in c for c in commands)


def _with_gpus(*totals_gib: int):
    """The fake agent's snapshot with GPUs of these sizes (the holders on GPU 0)."""
    from doctor.fake_agent_server import shared_gpu_snapshot

    snapshot = shared_gpu_snapshot()
    first = snapshot.gpus[0]
    gpus = [
        first.model_copy(
            update={
                "index": i,
                "uuid": f"GPU-{i}",
                "memory_total_bytes": gib * 2**30,
                "processes": first.processes if i == 0 else [],
            }
        )
        for i, gib in enumerate(totals_gib)
    ]
    return snapshot.model_copy(update={"gpus": gpus})


def test_a_message_from_another_size_of_card_gets_no_live_context() -> None:
    # The issue: 23.65 GiB in the message, 48 GiB locally, context attached regardless.
    explanation = explain(STARVED, snapshot=_with_gpus(48), now=COLLECTED_AT)
    assert explanation.live is None
    assert explanation.live_note == (
        "this message is from a 23.65 GiB card; this host's GPU 0 has 48.00 GiB: "
        "live context not attached"
    )
    assert explanation.live_note in explanation.notes
    assert all("4242" not in " ".join(d.commands) for d in explanation.diagnoses)
    assert "Right now on" not in render(explanation)


def test_the_one_local_gpu_of_the_messages_size_is_matched() -> None:
    # GPU 0 in the message is the process's own numbering (CUDA_VISIBLE_DEVICES=1).
    explanation = explain(STARVED, snapshot=_with_gpus(48, 24), now=COLLECTED_AT)
    assert explanation.live is not None and explanation.live.index == 1
    assert explanation.live_note is not None
    assert "showing GPU 1 (24.00 GiB), the only GPU here of that size" in explanation.live_note


def test_several_local_gpus_of_that_size_are_ambiguous() -> None:
    explanation = explain(STARVED, snapshot=_with_gpus(48, 24, 24), now=COLLECTED_AT)
    assert explanation.live is None
    assert explanation.live_note is not None and "ambiguous" in explanation.live_note


def test_the_same_size_of_card_is_attached_without_a_note() -> None:
    explanation = explain(STARVED, snapshot=_with_gpus(24), now=COLLECTED_AT)
    assert explanation.live is not None and explanation.live.index == 0
    assert explanation.live_note is None


def test_a_message_from_another_accelerator_gets_no_nvidia_context() -> None:
    mps = (
        "RuntimeError: MPS backend out of memory (MPS allocated: 7.23 GB, other allocations: "
        "1.54 GB, max allowed: 9.07 GB). Tried to allocate 896.00 MB on private pool."
    )
    explanation = explain(mps, snapshot=_with_gpus(24), now=COLLECTED_AT)
    assert explanation.live is None
    assert explanation.live_note is not None and "about MPS memory" in explanation.live_note


def test_a_holder_owned_by_root_is_not_offered_to_the_reaper() -> None:
    # gpuwatch reap never stops root's processes: offering it would be refused (22).
    from gpuwatch.doctor.live import LiveGpu, LiveProcess
    from gpuwatch.doctor.remedies import reap_commands

    live = LiveGpu(
        hostname="gpu-box",
        index=0,
        collected_at=0.0,
        processes=[
            LiveProcess(pid=10, user="root", uid=0, used_bytes=8 * 2**30, sm_ratio=0.0),
            LiveProcess(pid=20, user="alice", uid=1000, used_bytes=8 * 2**30, sm_ratio=0.0),
        ],
    )
    commands = reap_commands(live, min_bytes=2**30)
    assert "gpuwatch reap --pid 20   # or: kill 20" in commands
    assert not any("--pid 10" in c or "kill 10" in c for c in commands)
    assert any("root's process" in c for c in commands)
