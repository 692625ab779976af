"""A process with memory on a GPU that cannot be read is never stopped (reaper audit,
finding 1): not by the policy, not by ``gpuwatch reap``, not by ``--force``.

Real processes on fake GPUs. Each victim holds memory on gpu0 and gpu1, idle on both;
gpu1 falls off the bus (``gpu_lost``) before the plan, while the confirmation prompt
is open, or between the policy's warning and its action. Without the loss each of
these is stopped (the other reaper tests show that), so "alive" here is the loss's doing.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from reaper.helpers import HOUR, Signals, drive, executor, history, plan_over
from reaper.policy_rig import Events, policy_agent, run_polls
from reaper.rig import REPO_ROOT, Hold, Rig, Victim, scenario_text
from reaper.test_reap_cli import _audit, _env, _reap, _setup

from gpuwatch.agent.reaper.audit import AuditLog


def lost(gpu: int, at: str) -> str:
    return f'\n[[fault]]\ngpu = {gpu}\nkind = "gpu_lost"\nat = "{at}"\n'


def both_gpus(pid: int, memory: str = "12GiB") -> list[Hold]:
    return [Hold(pid, gpu=0, memory=memory), Hold(pid, gpu=1, memory=memory)]


# -- the automatic policy ------------------------------------------------------------------


def test_policy_lost_between_warning_and_action_withdraws_and_never_stops(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    # Warned at minute 30 (idle 30m), due at 40; gpu1 is lost at 35. Before: stopped
    # at 40 on gpu0's evidence ("terminated", 24 GiB "freed"); and once the agent
    # forgot gpu1's track (max_gap after the loss), warned and stopped again.
    idle = victims()
    rig.install_text(scenario_text(both_gpus(idle.pid)) + lost(1, "35m"))
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink)
    run_polls(agent, rig, 100)
    assert idle.alive()
    assert sink.stages(idle.pid) == ["warning", "withdrawn"]
    rows = AuditLog(tmp_path / "audit.jsonl").read()
    (row,) = [r for r in rows if r["event"] == "withdrawn"]
    assert row["withdrawn_because"] == "gpu1 cannot be read now (lost, or an NVML error)"
    assert not [r for r in rows if r["event"] == "signal"]
    auto = agent.reaper.auto
    assert auto is not None
    counts = auto.stats.snapshot()
    assert counts.withdrawn == {"gpu_unreadable": 1} and counts.stops == {}


def test_policy_lost_before_any_warning_never_warns(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    # Lost at minute 10 with its UUID kept. Before: the history forgot the process's
    # gpu1 track 10 minutes later (not seen for max_gap), so it was judged on gpu0
    # alone: warned at 30, stopped at 40.
    idle = victims()
    rig.install_text(scenario_text(both_gpus(idle.pid)) + lost(1, "10m"))
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink)
    run_polls(agent, rig, 100)
    assert idle.alive()
    assert sink.stages(idle.pid) == []
    latest = agent.state.latest
    assert latest is not None and latest.gpus[1].lost
    assert not latest.gpus[1].uuid.startswith("GPU-unknown-")  # kept (commit 27a35fb)


# -- the executor's last look before the signal ---------------------------------------------


def test_lost_after_the_plan_nothing_is_sent(rig: Rig, clock, victims, tmp_path: Path) -> None:
    # The plan saw both GPUs idle; gpu1 is lost before the re-check. Before: the re-check
    # looked only at GPUs still listing the process (gpu0), and signalled.
    idle = victims()
    rig.install_text(scenario_text(both_gpus(idle.pid, "6GiB")) + lost(1, "121m"))
    sampler = rig.sampler()
    hist = history()
    snapshot = drive(sampler, hist, clock, 2 * HOUR)
    plan = plan_over(snapshot, hist, clock(), held_on=hist.gpus_for)
    assert [(d.candidate.pid, d.candidate.gpus) for d in plan.chosen] == [(idle.pid, [0, 1])]
    clock.advance(90)
    signals = Signals()
    (result,) = executor(sampler, tmp_path / "audit.jsonl", signals=signals).run(
        plan, dry_run=False
    )
    assert result.outcome == "no_longer_eligible"
    assert "gpu1 cannot be read now" in result.detail
    assert signals.names == [] and idle.alive()


def test_the_plan_spares_a_process_whose_gpu_is_absent_or_named_by_a_placeholder(
    rig: Rig, clock, victims, tmp_path: Path
) -> None:
    # History of both GPUs, then a look by a reader that never read gpu1 (placeholder
    # UUID ``GPU-unknown-1``, as a fresh `gpuwatch reap` or a restarted agent has) or
    # that no longer lists it at all. Before: judged on gpu0 alone, and chosen.
    idle = victims()
    rig.install(both_gpus(idle.pid, "6GiB"))
    hist = history()
    drive(rig.sampler(), hist, clock, 2 * HOUR)
    clock.advance(30)
    rig.install_text(scenario_text(both_gpus(idle.pid, "6GiB")) + lost(1, "0s"))
    placeholder = rig.sampler().poll()
    assert placeholder.gpus[1].uuid == "GPU-unknown-1" and placeholder.gpus[1].lost
    rig.install(both_gpus(idle.pid, "6GiB")[:1], gpus=1)
    absent = rig.sampler().poll()
    assert [g.index for g in absent.gpus] == [0]
    for snapshot in (placeholder, absent):
        plan = plan_over(snapshot, hist, clock(), held_on=hist.gpus_for)
        (decision,) = plan.decisions
        assert (decision.verdict, decision.reason) == ("spare", "unknown")
        assert "it also held GPU 1, which cannot be read now" in decision.detail
        forced = plan_over(snapshot, hist, clock(), held_on=hist.gpus_for, pid=idle.pid, force=True)
        assert [d.verdict for d in forced.decisions] == ["spare"]


# -- gpuwatch reap ----------------------------------------------------------------------------


def test_cli_lost_before_the_plan_is_spared_and_never_signalled(
    rig, victims, agent, tmp_path: Path
) -> None:
    # The agent's history has both GPUs by their UUIDs; the command's own first poll
    # finds gpu1 lost and names it GPU-unknown-1. Before: `reap idle` on gpu0, then
    # `terminated`, exit 0.
    idle = victims()
    recorded = _setup(rig, agent, both_gpus(idle.pid, "4GiB"))
    scenario = tmp_path / "lost-now.toml"
    scenario.write_text(recorded.read_text() + lost(1, "0s"))
    for extra in (["--idle", "2h"], ["--pid", str(idle.pid), "--force"]):
        done = _reap(tmp_path, agent, scenario, *extra, "--yes", "--json")
        assert done.returncode in (20, 22), done.stderr
        (candidate,) = json.loads(done.stdout)["candidates"]
        assert (candidate["decision"], candidate["reason"]) == ("spare", "unknown")
        assert "GPU 1, which cannot be read now" in candidate["detail"]
    assert idle.alive()
    assert not [r for r in _audit(tmp_path) if r["event"] == "signal"]


def test_cli_lost_while_the_prompt_is_open_sends_nothing(
    rig, victims, agent, tmp_path: Path
) -> None:
    # The table shows gpu0 and gpu1 idle; gpu1 is lost while the question waits; the
    # answer is yes. Before: terminated, "8.0 GiB freed", though gpu1's 4 GiB was
    # never seen freed.
    idle = victims()
    recorded = _setup(rig, agent, both_gpus(idle.pid, "4GiB"))
    scenario = tmp_path / "lost-soon.toml"
    loss_at = 12.0  # scenario seconds: the command boots the scenario when it starts
    scenario.write_text(recorded.read_text() + lost(1, f"{loss_at:.0f}s"))
    command = [
        sys.executable, "-m", "gpuwatch", "reap", "--idle", "2h", "--agent", agent.url,
        "--fake-gpus", str(scenario), "--audit-log", str(tmp_path / "audit.jsonl"),
        "--grace", "5s",
    ]  # fmt: skip
    screen, code = _answer_yes_after(command, _env(tmp_path), delay=loss_at + 2)
    assert "gpu1 cannot be read now" in screen, screen
    assert code == 21, screen  # partial: the one chosen process was not stopped
    assert idle.alive()
    events = [r["event"] for r in _audit(tmp_path)]
    assert "signal" not in events and events[-1] == "outcome"
    assert _audit(tmp_path)[-1]["outcome"] == "no_longer_eligible"


def _answer_yes_after(command: list[str], env: dict[str, str], *, delay: float) -> tuple[str, int]:
    """Run ``command`` on a terminal; answer ``y`` ``delay`` seconds after its prompt
    appeared (the scenario booted before the prompt, so its clock is past ``delay``)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        command, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO_ROOT
    )
    os.close(slave)
    screen = b""
    answered_at: float | None = None
    prompt_at: float | None = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if (
                prompt_at is not None
                and answered_at is None
                and time.monotonic() >= prompt_at + delay
            ):
                os.write(master, b"y\n")
                answered_at = time.monotonic()
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break  # the command exited: the terminal closed
                if not chunk:
                    break
                screen += chunk
                if prompt_at is None and b"[y/N]" in screen:
                    prompt_at = time.monotonic()
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        os.close(master)
    assert prompt_at is not None, screen.decode(errors="replace")
    return screen.decode(errors="replace"), code
