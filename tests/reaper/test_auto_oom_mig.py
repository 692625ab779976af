"""On a MIG GPU, contention is an instance's: its fullness, and OOMs in that instance.

MIG memory is partitioned: stopping an idle process in one instance frees nothing for a
process that ran out of memory in another. Real processes under other uids attached to
the MIG instances of a fake H100; OOM reports are posted over HTTP by their owners
(``setpriv``), as in test_auto_oom_trust.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from reaper.policy_rig import Events, run_polls
from reaper.rig import ALICE, BOB, Rig, Victim
from reaper.test_auto_oom_trust import _agent, post_as, serving  # noqa: F401 (fixture)

from gpuwatch.agent.service import Agent

CAROL = 4444


def _scenario(*processes: tuple[int, int, str, int]) -> str:
    """One H100 (16 GiB) split into MIG instances 3 and 5 (8 GiB each); ``processes``
    are (pid, MIG index 0 or 1, memory, SM percent)."""
    text = """
[fake]
name = "reap-mig-oom"
lifetime = "10m"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "16GiB"
reserved = "0MiB"
[[gpu.mig]]
profile = "2g.8gb"
memory_total = "8GiB"
gpu_instance_id = 3
[[gpu.mig]]
profile = "2g.8gb"
memory_total = "8GiB"
gpu_instance_id = 5
"""
    for pid, mig, memory, sm in processes:
        text += (
            f'\n[[process]]\ngpu = 0\nmig = {mig}\nattach = {pid}\nmemory = "{memory}"\n'
            f"sm_percent = {sm}\n"
        )
    return text


def _oom(uid: int, agent: Agent, pid: int, device_uuid: str | None, **more: object) -> None:
    body: dict[str, object] = {"pid": pid, "message": "CUDA out of memory", **more}
    if device_uuid is not None:
        body["device_uuid"] = device_uuid
    post_as(uid, agent, body)


def _not_counted(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not counted as contention" in r.getMessage()]


def test_an_oom_in_one_mig_instance_makes_no_other_instance_contended(
    rig: Rig,
    victims: Callable[..., Victim],
    tmp_path: Path,
    serving: list[Agent],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    bobs_job, idle = victims(uid=BOB), victims(uid=ALICE)
    rig.install_text(_scenario((bobs_job.pid, 0, "1GiB", 40), (idle.pid, 1, "1GiB", 0)))
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving)
    run_polls(agent, rig, 31)  # idle long enough: only contention is missing
    gpu0 = agent.state.latest.gpus[0]  # type: ignore[union-attr]
    instance3 = next(m for m in gpu0.mig_instances if m.gpu_instance_id == 3)
    assert sink.stages(idle.pid) == []

    # Bob runs out of memory in instance 3, named as PyTorch prints it (no prefix).
    with caplog.at_level(logging.INFO, logger="gpuwatch.agent.service"):
        _oom(BOB, agent, bobs_job.pid, instance3.uuid.removeprefix("MIG-"))
        run_polls(agent, rig, 2)
    assert _not_counted(caplog) == []  # a genuine report: counted, for instance 3
    auto = agent.reaper.auto
    assert auto is not None and list(auto._ooms) == [(0, 3)]
    # Alice's memory is instance 5's: stopping her frees nothing for bob.
    assert sink.stages(idle.pid) == [] and idle.alive()


@pytest.mark.parametrize("form", ["uuid", "cuda_11"])
def test_an_oom_in_the_same_mig_instance_counts(
    form: str,
    rig: Rig,
    victims: Callable[..., Victim],
    tmp_path: Path,
    serving: list[Agent],  # noqa: F811
) -> None:
    # The instance named by its MIG UUID, or as CUDA 11 named it in
    # CUDA_VISIBLE_DEVICES: MIG-GPU-<parent uuid>/<gi>/<ci>.
    bobs_job, idle = victims(uid=BOB), victims(uid=ALICE)
    # Bob's job waits (no activity): a busy one would make the whole instance, alice
    # included, active (MIG activity is the instance's).
    rig.install_text(_scenario((bobs_job.pid, 1, "1GiB", 0), (idle.pid, 1, "1GiB", 0)))
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving)
    run_polls(agent, rig, 31)
    gpu = agent.state.latest.gpus[0]  # type: ignore[union-attr]
    instance5 = gpu.mig_instances[1]
    assert instance5.gpu_instance_id == 5
    named = instance5.uuid if form == "uuid" else f"MIG-{gpu.uuid}/5/0"

    _oom(BOB, agent, bobs_job.pid, named)
    run_polls(agent, rig, 2)
    assert sink.stages(idle.pid) == ["warning"]
    warning = next(e for e in sink.events if e.pid == idle.pid)
    assert "another process ran out of memory on MIG instance 5 of gpu0" in warning.summary
    auto = agent.reaper.auto
    assert auto is not None and list(auto._ooms) == [(0, 5)]


@pytest.mark.parametrize("names", ["parent_uuid", "index"])
def test_an_oom_on_a_mig_gpu_that_names_no_instance_counts_for_nobody(
    rig: Rig,
    victims: Callable[..., Victim],
    tmp_path: Path,
    serving: list[Agent],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    names: str,
) -> None:
    # The whole GPU cannot run out of memory in MIG mode: only one instance can, and
    # the report does not say which.
    bobs_job, idle = victims(uid=BOB), victims(uid=ALICE)
    # Bob's job waits (no activity): a busy one would make the whole instance, alice
    # included, active (MIG activity is the instance's).
    rig.install_text(_scenario((bobs_job.pid, 1, "1GiB", 0), (idle.pid, 1, "1GiB", 0)))
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving)
    run_polls(agent, rig, 31)
    parent = agent.state.latest.gpus[0].uuid  # type: ignore[union-attr]

    with caplog.at_level(logging.INFO, logger="gpuwatch.agent.service"):
        if names == "parent_uuid":
            _oom(BOB, agent, bobs_job.pid, parent)
        else:
            _oom(BOB, agent, bobs_job.pid, None, device_index=0)
        run_polls(agent, rig, 2)
    assert sink.stages(idle.pid) == []
    (why,) = _not_counted(caplog)
    assert "gpu0 is in MIG mode and the report names none of its MIG instances" in why
    auto = agent.reaper.auto
    assert auto is not None and auto._ooms == {}
    # Even noted directly, a whole-GPU entry on a MIG GPU counts for no instance.
    auto.note_oom(0, bobs_job.pid, rig.clock.now)
    run_polls(agent, rig, 2)
    assert sink.stages(idle.pid) == [] and auto._ooms == {}


def test_an_oom_from_a_process_in_another_instance_than_named_is_not_counted(
    rig: Rig,
    victims: Callable[..., Victim],
    tmp_path: Path,
    serving: list[Agent],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Bob's job runs in instance 3; he names instance 5, where alice idles.
    bobs_job, idle = victims(uid=BOB), victims(uid=ALICE)
    rig.install_text(_scenario((bobs_job.pid, 0, "1GiB", 40), (idle.pid, 1, "1GiB", 0)))
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving)
    run_polls(agent, rig, 31)
    instance5 = agent.state.latest.gpus[0].mig_instances[1]  # type: ignore[union-attr]

    with caplog.at_level(logging.INFO, logger="gpuwatch.agent.service"):
        _oom(BOB, agent, bobs_job.pid, instance5.uuid)
        run_polls(agent, rig, 2)
    assert sink.stages(idle.pid) == []
    (why,) = _not_counted(caplog)
    assert f"pid {bobs_job.pid} holds no context on MIG instance 5 of gpu0" in why


def test_fullness_on_a_mig_gpu_is_the_instances(
    rig: Rig,
    victims: Callable[..., Victim],
    tmp_path: Path,
    serving: list[Agent],  # noqa: F811
) -> None:
    # Instance 3 is full (carol's 7.5 of 8 GiB), instance 5 nearly empty: the whole
    # card is 53% used, above contended_ratio 0.5, but instance 5 has room to spare.
    carols, idle = victims(uid=CAROL), victims(uid=ALICE)
    rig.install_text(_scenario((carols.pid, 0, "7680MiB", 0), (idle.pid, 1, "1GiB", 0)))
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving, contended_ratio=0.5)
    run_polls(agent, rig, 32)
    gpu0 = agent.state.latest.gpus[0]  # type: ignore[union-attr]
    assert gpu0.memory_used_bytes is not None and gpu0.memory_total_bytes is not None
    assert gpu0.memory_used_bytes / gpu0.memory_total_bytes >= 0.5
    assert sink.stages(idle.pid) == []
    assert sink.stages(carols.pid) == ["warning"]
    warning = next(e for e in sink.events if e.pid == carols.pid)
    assert "MIG instance 3 of gpu0 is 94% full" in warning.summary


def test_a_full_mig_instance_is_contended_on_a_card_that_is_not(
    rig: Rig,
    victims: Callable[..., Victim],
    tmp_path: Path,
    serving: list[Agent],  # noqa: F811
) -> None:
    # Alice holds 7 of instance 5's 8 GiB; the card as a whole is under half full.
    idle = victims(uid=ALICE)
    rig.install_text(_scenario((idle.pid, 1, "7GiB", 0)))
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving, contended_ratio=0.8)
    run_polls(agent, rig, 32)
    gpu0 = agent.state.latest.gpus[0]  # type: ignore[union-attr]
    assert gpu0.memory_used_bytes is not None and gpu0.memory_total_bytes is not None
    assert gpu0.memory_used_bytes / gpu0.memory_total_bytes < 0.8
    assert sink.stages(idle.pid) == ["warning"]
    warning = next(e for e in sink.events if e.pid == idle.pid)
    assert "MIG instance 5 of gpu0 is 88% full" in warning.summary
