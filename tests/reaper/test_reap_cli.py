"""``gpuwatch reap`` as users run it: a child process, real victims, fake GPUs.

The agent's history is served by a stand-in HTTP server with a history recorded over
the same fake GPUs (``recorded_history``), so the command line sees hours of
idleness ending now; its own NVML view comes from ``--fake-gpus`` on the same
scenario file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from reaper.rig import ALICE, BOB, GiB, HistoryServer, Hold, recorded_history, run_cli, write_config
from support.clock import FakeClock
from support.sink import sink


def _env(tmp_path: Path, config: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "cli-runtime")
    env["GPUWATCH_CONFIG"] = str(config or "/dev/null")
    env["HOME"] = str(tmp_path)
    return env


def _reap(
    tmp_path: Path, agent: HistoryServer, scenario: Path, *args: str, **kw: object
) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "reap",
        "--agent",
        agent.url,
        "--fake-gpus",
        str(scenario),
        "--audit-log",
        str(tmp_path / "audit.jsonl"),
        "--grace",
        "5s",
        *args,
        env=kw.pop("env", None) or _env(tmp_path),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _setup(rig, agent: HistoryServer, holds: list[Hold], seconds: float = 3 * 3600) -> Path:  # type: ignore[no-untyped-def]
    agent.body = recorded_history(rig, holds, seconds=seconds)
    return rig.tmp_path / f"reap-{rig._count}.toml"


def _audit(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_idle_is_stopped_active_spared_and_the_json_says_so(
    rig, victims, agent, tmp_path: Path
) -> None:
    idle, busy = victims(), victims(uid=BOB)
    scenario = _setup(
        rig, agent, [Hold(idle.pid, gpu=0, memory="11GiB"), Hold(busy.pid, gpu=1, sm="70")]
    )
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    by_pid = {c["pid"]: c for c in out["candidates"]}
    assert by_pid[idle.pid]["decision"] == "reap" and by_pid[idle.pid]["reason"] == "idle"
    assert by_pid[idle.pid]["user"] == str(ALICE) and by_pid[idle.pid]["gpu"] == 0
    assert by_pid[idle.pid]["memory_bytes"] == 11 * GiB
    assert by_pid[idle.pid]["idle_seconds"] > 2 * 3600
    assert by_pid[busy.pid]["decision"] == "spare" and by_pid[busy.pid]["reason"] == "active"
    (result,) = out["results"]
    assert result["pid"] == idle.pid and result["outcome"] == "terminated"
    assert result["memory_freed"] is True and result["memory_freed_bytes"] == 11 * GiB
    assert idle.exit_signal() == 15 and busy.alive()
    events = [row["event"] for row in _audit(tmp_path)]
    assert events == ["decision", "decision", "signal", "outcome"]


def test_dry_run_lists_the_same_decisions_and_sends_nothing(
    rig, victims, agent, tmp_path: Path
) -> None:
    idle, short = victims(), victims()
    scenario = _setup(rig, agent, [Hold(idle.pid), Hold(short.pid, gpu=1)], seconds=90 * 60)
    dry = _reap(tmp_path, agent, scenario, "--idle", "1h", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert idle.alive() and short.alive()
    real = _reap(tmp_path, agent, scenario, "--idle", "1h", "--yes", "--json")
    assert real.returncode == 0, real.stderr

    def decisions(text: str) -> list[tuple[int, str, str]]:
        return sorted(
            (c["pid"], c["decision"], c["reason"]) for c in json.loads(text)["candidates"]
        )

    assert decisions(dry.stdout) == decisions(real.stdout)
    assert [r["outcome"] for r in json.loads(dry.stdout)["results"]] == ["dry_run", "dry_run"]
    assert [r["outcome"] for r in json.loads(real.stdout)["results"]] == [
        "terminated",
        "terminated",
    ]
    assert all(
        row["dry_run"] for row in _audit(tmp_path) if row["run"] == _audit(tmp_path)[0]["run"]
    )


def test_an_unwritable_audit_log_stops_a_real_run_but_not_a_dry_one(
    rig, victims, agent, tmp_path: Path
) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)])
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    unwritable = ("--audit-log", str(blocker / "audit.jsonl"))
    dry = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--json", *unwritable)
    assert dry.returncode == 0, dry.stderr
    out = json.loads(dry.stdout)
    assert [r["outcome"] for r in out["results"]] == ["dry_run"]
    assert any(
        n.startswith("this dry run is not in the audit log: cannot write") for n in out["notes"]
    )
    real = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", *unwritable)
    assert real.returncode == 22, real.stderr
    assert "cannot write the reaper's audit log" in real.stderr
    assert "Traceback" not in real.stderr
    assert idle.alive()


@pytest.mark.parametrize("planted", ["symlink", "hard link", "fifo"])
def test_an_audit_log_planted_by_its_directory_s_owner_is_never_written_through(
    rig, victims, agent, tmp_path: Path, planted: str
) -> None:
    # Root appends to the audit log, whose default directory is the service user's
    # (the units' StateDirectory): a symlink planted there made root append rows, with
    # other users' command lines in them, to any file (a shell's rc file). Nothing is
    # written through a symlink, a second name or a FIFO; a real run is refused (22).
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)])
    target = tmp_path / "roots-bashrc"
    target.write_text("# root's\n")
    planted_at = tmp_path / "state" / "reap-audit.jsonl"
    planted_at.parent.mkdir()
    if planted == "symlink":
        planted_at.symlink_to(target)
    elif planted == "hard link":
        os.link(target, planted_at)
    else:
        os.mkfifo(planted_at)
    log = ("--audit-log", str(planted_at))
    dry = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--json", *log)
    assert dry.returncode == 0, dry.stderr
    assert any(
        n.startswith("this dry run is not in the audit log: cannot write")
        for n in json.loads(dry.stdout)["notes"]
    )
    real = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", *log, timeout=60)
    assert real.returncode == 22, real.stderr
    assert "cannot write the reaper's audit log" in real.stderr
    assert "Traceback" not in real.stderr
    assert target.read_text() == "# root's\n"
    assert idle.alive()


def test_nothing_to_do_and_not_a_terminal(rig, victims, agent, tmp_path: Path) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)], seconds=30 * 60)
    nothing = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes")
    assert nothing.returncode == 20, nothing.stderr
    assert (
        "idle for 30m, less than 2h00m" in nothing.stdout.replace("\n", " ")
        or "Nothing to reap" in nothing.stdout
    )
    unconfirmed = _reap(tmp_path, agent, scenario, "--idle", "10m")
    assert unconfirmed.returncode == 22
    assert "pass --yes" in unconfirmed.stderr
    assert idle.alive()
    assert _audit(tmp_path)[-1]["event"] == "refused"


def test_pid_must_be_idle_unless_forced_and_protections_hold(
    rig, victims, agent, tmp_path: Path
) -> None:
    busy, root = victims(), victims(uid=0)
    scenario = _setup(rig, agent, [Hold(busy.pid, sm="40"), Hold(root.pid, gpu=1)])
    refused = _reap(tmp_path, agent, scenario, "--pid", str(busy.pid), "--yes")
    assert refused.returncode == 22 and "active now" in refused.stderr
    assert busy.alive()
    protected = _reap(tmp_path, agent, scenario, "--pid", str(root.pid), "--force", "--yes")
    assert protected.returncode == 22 and "root's processes are never reaped" in protected.stderr
    assert root.alive()
    forced = _reap(tmp_path, agent, scenario, "--pid", str(busy.pid), "--force", "--yes", "--json")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["candidates"][0]["reason"] == "forced"
    assert busy.exit_signal() == 15


def test_without_history_nothing_is_idle(rig, victims, tmp_path: Path) -> None:
    idle = victims()
    scenario = rig.tmp_path / "solo.toml"
    from reaper.rig import scenario_text

    scenario.write_text(scenario_text([Hold(idle.pid)]))
    done = run_cli(
        "reap",
        "--idle",
        "1m",
        "--yes",
        "--json",
        "--agent",
        "http://127.0.0.1:9",
        "--fake-gpus",
        str(scenario),
        "--audit-log",
        str(tmp_path / "audit.jsonl"),
        env=_env(tmp_path),
    )
    assert done.returncode == 20, done.stderr
    out = json.loads(done.stdout)
    assert out["candidates"][0]["reason"] == "no_history"
    assert any("without history no process can be called idle" in n for n in out["notes"])
    assert idle.alive()


@contextmanager
def reaping_as_alice(
    scenario: Path,
) -> Iterator[Callable[[str], subprocess.CompletedProcess[str]]]:
    """``gpuwatch reap --idle 2h --yes --json --agent URL`` run as alice, in a home of
    her own (pytest's tmp dirs are root's, 0700) with her own copy of ``scenario``."""
    shared = Path(tempfile.mkdtemp(prefix="gpuwatch-reap-"))
    try:
        shared.chmod(0o755)
        home = shared / "alice"
        home.mkdir()
        os.chown(home, ALICE, ALICE)
        readable = shutil.copy(scenario, shared / scenario.name)

        def reap(url: str) -> subprocess.CompletedProcess[str]:
            return run_cli(
                "reap", "--idle", "2h", "--yes", "--json", "--agent", url,
                "--fake-gpus", str(readable), "--audit-log", str(home / "audit.jsonl"),
                "--grace", "5s", env=_env(home), user=ALICE,
            )  # fmt: skip

        yield reap
    finally:
        shutil.rmtree(shared)


def test_a_non_root_caller_reaps_only_its_own(rig, victims, agent, tmp_path: Path) -> None:
    mine, theirs = victims(uid=ALICE), victims(uid=BOB)
    scenario = _setup(rig, agent, [Hold(mine.pid), Hold(theirs.pid, gpu=1)])
    with reaping_as_alice(scenario) as reap:
        done = reap(agent.url)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    by_pid = {c["pid"]: (c["decision"], c["reason"]) for c in out["candidates"]}
    assert by_pid == {mine.pid: ("reap", "idle"), theirs.pid: ("spare", "not_own_process")}
    assert any("not root" in n for n in out["notes"])
    assert [r["outcome"] for r in out["results"]] == ["terminated"]
    assert mine.exit_signal() == 15 and theirs.alive()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_refuses_where_host_pids_are_not_visible(rig, victims, agent, tmp_path: Path) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)])
    import sys

    from reaper.rig import REPO_ROOT

    done = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-m",
            "gpuwatch",
            "reap",
            "--idle",
            "2h",
            "--yes",
            "--agent",
            agent.url,
            "--fake-gpus",
            str(scenario),
            "--audit-log",
            str(tmp_path / "audit.jsonl"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=_env(tmp_path),
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 22, done.stderr
    assert "cannot see the host's processes" in done.stderr
    assert idle.alive()
    assert _audit(tmp_path)[-1]["event"] == "refused"


def test_the_reaped_event_reaches_the_server(rig, victims, agent, tmp_path: Path) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid, memory="3GiB")])
    with sink(FakeClock()) as server:
        config = write_config(
            tmp_path / "gpuwatch.toml",
            f'[agent]\nserver_url = "{server.url.removesuffix("/hook")}"\ntoken = "host-token"\n',
        )
        done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", env=_env(tmp_path, config))
        assert done.returncode == 0, done.stderr
        (delivery,) = server.deliveries
    assert delivery.headers["Authorization"] == "Bearer host-token"
    event = delivery.body
    assert event["kind"] == "reaped" and event["pid"] == idle.pid and event["held_bytes"] == 3 * GiB
    assert event["evidence"]["stage"] == "stopped" and event["evidence"]["outcome"] == "terminated"
    assert event["evidence"]["actor"]["via"] == "gpuwatch reap"


def test_with_a_running_agents_own_history(victims, tmp_path: Path) -> None:
    """The real path: the agent polls, keeps history, serves it; the CLI reads it."""
    import threading
    import time

    import httpx
    from reaper.rig import Rig

    from gpuwatch.agent.service import Agent
    from gpuwatch.agent.state import AgentState
    from gpuwatch.agent.torch_reports import TorchReports
    from gpuwatch.nvml import fake
    from gpuwatch.nvml.fake.lifecycle import stop_all
    from gpuwatch.settings import AgentSettings, load

    idle, busy = victims(), victims()
    live = Rig(tmp_path, time.time)  # type: ignore[arg-type]
    scenario = live.install([Hold(idle.pid, memory="4GiB"), Hold(busy.pid, gpu=1, sm="30")])
    settings = load(
        AgentSettings, listen="127.0.0.1:0", poll_interval_seconds=1.0, spool_dir=tmp_path / "spool"
    )
    agent = Agent(
        settings, sampler=live.sampler(), state=AgentState(), torch_reports=TorchReports()
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        # --idle 5s (at least 5 poll intervals): until the agent's own history has held
        # the process idle that long, and a poll more, rather than a fixed 8.5 s.
        deadline = time.monotonic() + 60
        while True:
            served = httpx.get(
                f"{agent.exporter.url}/reaper/history", params={"pid": idle.pid}
            ).json()
            runs = [run for track in served["tracks"] for run in track["runs"]]
            if runs and runs[-1]["activity"] == "idle" and runs[-1]["end"] - runs[-1]["start"] >= 6:
                break
            assert time.monotonic() < deadline, served
            time.sleep(0.1)
        assert [t["pid"] for t in served["tracks"]] == [idle.pid]
        assert served["tracks"][0]["runs"][-1]["activity"] == "idle"
        assert httpx.get(f"{agent.exporter.url}/reaper/history?pid=x").status_code == 400
        config = write_config(tmp_path / "gpuwatch.toml", "[agent.reap]\ncoverage = 0.6\n")
        done = run_cli(
            "reap",
            "--idle",
            "5s",
            "--yes",
            "--json",
            "--agent",
            agent.exporter.url,
            "--fake-gpus",
            str(scenario),
            "--audit-log",
            str(tmp_path / "audit.jsonl"),
            env=_env(tmp_path, config),
        )
    finally:
        agent.stop()
        thread.join(10)
        live.close()
        fake.uninstall()
        stop_all(live.runtime_dir)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert {c["pid"]: c["decision"] for c in out["candidates"]} == {
        idle.pid: "reap",
        busy.pid: "spare",
    }
    assert [(r["pid"], r["outcome"]) for r in out["results"]] == [(idle.pid, "terminated")]
    assert busy.alive()


def test_a_gpu_that_does_not_exist_is_an_error_not_nothing_to_do(
    rig, victims, agent, tmp_path: Path
) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)])
    typo = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--gpu", "99")
    assert typo.returncode == 3, typo.stderr
    assert typo.stderr.startswith("gpuwatch: error: --gpu 99: no such GPU")
    assert idle.alive()


@pytest.mark.parametrize("idle", ["1s", "1ms", "24s"])
def test_a_window_below_the_floor_is_refused_without_an_agent(idle: str, tmp_path: Path) -> None:
    """The floor (5 poll intervals: 25 s at the default 5 s) holds before anything is
    asked of an agent: with none listening, --idle 1s was "nothing to do" (exit 20)."""
    from gpuwatch.nvml.fake.lifecycle import stop_all

    env = _env(tmp_path)
    try:
        done = run_cli(
            "reap", "--idle", idle, "--agent", "http://127.0.0.1:9", "--dry-run",
            "--fake-gpus", "workstation", env=env,
        )  # fmt: skip
    finally:
        stop_all(Path(env["XDG_RUNTIME_DIR"]) / "gpuwatch-fake")
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("gpuwatch: error: --idle: ")
    assert done.stderr.count("\n") == 1 and "too short: at least 5 of" in done.stderr
