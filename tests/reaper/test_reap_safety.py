"""``gpuwatch reap`` safety fixes from the reaper audit (/tmp/audit/reap.md), end to end:
a child process, real victims, fake GPUs, a history served over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

from reaper.helpers import by_pid
from reaper.rig import Hold
from reaper.test_reap_cli import _reap, _setup, reaping_as_alice
from support.served_as import served_by


def test_activity_in_the_commands_own_poll_vetoes(rig, victims, agent, tmp_path: Path) -> None:
    # Finding 1: the history says idle for 3h, but the process is busy now (60 % SM).
    # Before: chosen by the plan, then confirmed "idle" by a re-read milliseconds later
    # that found no new sample, and terminated.
    victim = victims()
    scenario = _setup(rig, agent, [Hold(victim.pid)])
    scenario.write_text(scenario.read_text().replace("sm_percent = 0", "sm_percent = 60"))
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", "--json")
    assert done.returncode == 20, done.stderr
    assert by_pid(done) == {victim.pid: ("spare", "active")}
    assert victim.alive()


def test_a_history_that_stopped_updating_is_not_current(rig, victims, agent, tmp_path) -> None:
    # Finding 6: polls stopped 590 s ago (inside max_gap); before, still "idle for 3h10m".
    victim = victims()
    scenario = _setup(rig, agent, [Hold(victim.pid)])
    body = json.loads(agent.body)
    for track in body["tracks"]:
        track["last_seen"] -= 590
        for run in track["runs"]:
            run["start"] -= 590
            run["end"] -= 590
    agent.body = json.dumps(body).encode()
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", "--json")
    assert done.returncode == 20, done.stderr
    assert by_pid(done) == {victim.pid: ("spare", "unknown")}
    assert victim.alive()


def test_idle_has_a_floor(rig, victims, agent, tmp_path: Path) -> None:
    # Finding 7: `--idle 1ms` reaped after two polls. The served history polls every 60 s.
    victim = victims()
    scenario = _setup(rig, agent, [Hold(victim.pid)])
    for short in ("1ms", "4m"):
        done = _reap(tmp_path, agent, scenario, "--idle", short, "--yes", "--json")
        assert done.returncode == 3, done.stderr
        assert "--idle" in done.stderr and "at least 5 of the agent's poll intervals" in done.stderr
    assert victim.alive()
    ok = _reap(tmp_path, agent, scenario, "--idle", "5m", "--dry-run", "--json")
    assert ok.returncode == 0, ok.stderr


def test_a_history_served_by_another_user_is_refused(rig, victims, agent, tmp_path) -> None:
    # Finding 4: any local user could serve a made-up history ("idle for 3h").
    victim = victims()
    scenario = _setup(rig, agent, [Hold(victim.pid)])
    with served_by(4343, {"reaper/history": agent.body}) as url:
        agent.url = url
        done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", "--json")
    assert done.returncode == 22, done.stderr
    assert "served by uid 4343" in done.stderr and "cannot be trusted" in done.stderr
    assert victim.alive()


def test_a_caller_who_may_stop_only_its_own_trusts_its_own_agent(
    rig, victims, agent, tmp_path: Path
) -> None:
    # gpuwatch demo: a user's own agent serves the history. A history made up by the
    # caller could only get the caller's own processes stopped, so it is trusted then.
    from reaper.rig import ALICE, BOB

    mine, theirs = victims(uid=ALICE), victims(uid=BOB)
    scenario = _setup(rig, agent, [Hold(mine.pid), Hold(theirs.pid, gpu=1)])
    with reaping_as_alice(scenario) as reap_as_alice:
        with served_by(BOB, {"reaper/history": agent.body}) as url:
            refused = reap_as_alice(url)
        assert refused.returncode == 22, refused.stderr
        assert "nor by you" in refused.stderr and mine.alive()
        with served_by(ALICE, {"reaper/history": agent.body}) as url:
            done = reap_as_alice(url)
    assert done.returncode == 0, done.stderr
    assert [r["outcome"] for r in json.loads(done.stdout)["results"]] == ["terminated"]
    assert mine.exit_signal() == 15 and theirs.alive()
