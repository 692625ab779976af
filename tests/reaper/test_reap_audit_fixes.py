"""``gpuwatch reap`` as users meet it, after the audit's findings (M1, M2, M3, L1-L3, H1).

Real victims on fake GPUs, the CLI in a child, the history from a stand-in agent
(the building blocks of ``test_reap_cli.py``).
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reaper.rig import ALICE, REPO_ROOT, Hold
from reaper.test_reap_cli import _audit, _env, _reap, _setup

from gpuwatch.agent.reaper.audit import AuditLog
from gpuwatch.agent.reaper.errors import AuditError
from gpuwatch.agent.reaper.settings import ReapSettings
from gpuwatch.errors import ConfigError


def _command(agent, scenario: Path, tmp_path: Path, *args: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [
        sys.executable, "-m", "gpuwatch", "reap", "--agent", agent.url, "--fake-gpus",
        str(scenario), "--audit-log", str(tmp_path / "audit.jsonl"), "--grace", "5s", *args,
    ]  # fmt: skip


def _on_a_terminal(command: list[str], env: dict[str, str], answer: bytes) -> tuple[str, str, int]:
    """Run ``command`` with stdin and stderr on a terminal and stdout piped; answer the
    prompt with ``answer``. Returns (the terminal's text, stdout, exit code)."""
    master, slave = pty.openpty()
    # A file, not a pipe: helpers the fake GPUs leave running may hold it open.
    out_path = Path(env["HOME"]) / "stdout.txt"
    with open(out_path, "wb") as out_file:
        process = subprocess.Popen(
            command, stdin=slave, stdout=out_file, stderr=slave, env=env, cwd=REPO_ROOT
        )
    os.close(slave)
    screen, answered = b"", False
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                screen += chunk
            if not answered and b"[y/N]" in screen:
                os.write(master, answer)
                answered = True
            if process.poll() is not None and not ready:
                break
        code = process.wait(60)
        return screen.decode(errors="replace"), out_path.read_text(), code
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)


# -- M1: --json on a terminal ---------------------------------------------------------------


def test_json_on_a_terminal_shows_what_it_asks_about_and_a_no_is_json(
    rig, victims, agent, tmp_path: Path
) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid, memory="3GiB")])
    command = _command(agent, scenario, tmp_path, "--idle", "2h", "--json")
    screen, out, code = _on_a_terminal(command, _env(tmp_path), b"n\n")
    assert code == 22, screen
    before_prompt = screen[: screen.index("[y/N]")]
    assert str(idle.pid) in before_prompt  # the table, on the terminal, before the question
    assert json.loads(out)["refused"] == "declined; nothing was signalled"
    assert idle.alive()


def test_json_refused_for_want_of_a_terminal_is_still_json(
    rig, victims, agent, tmp_path: Path
) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)])
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--json")
    assert done.returncode == 22, done.stderr
    out = json.loads(done.stdout)
    assert "pass --yes" in out["refused"] and out["results"] == []
    assert idle.alive()


# -- H1: the CLI in a nested PID namespace on the host's /proc ------------------------------


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_the_cli_refuses_in_a_nested_namespace_reading_the_hosts_proc(
    rig, victims, agent, tmp_path: Path
) -> None:
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)])
    base = _command(agent, scenario, tmp_path, "--idle", "2h", "--json")
    run = ["unshare", "--pid", "--fork", *base]
    kw = dict(capture_output=True, text=True, cwd=REPO_ROOT, env=_env(tmp_path), timeout=120,
              check=False, stdin=subprocess.DEVNULL)  # fmt: skip
    done = subprocess.run([*run, "--yes"], **kw)  # type: ignore[call-overload]
    assert done.returncode == 22, done.stderr
    assert json.loads(done.stdout)["refused"].startswith(
        "this gpuwatch runs in a nested PID namespace"
    )
    assert "Traceback" not in done.stderr
    assert idle.alive()
    assert _audit(tmp_path)[-1]["event"] == "refused"
    dry = subprocess.run([*run, "--dry-run"], **kw)  # type: ignore[call-overload]
    assert dry.returncode == 0, dry.stderr
    assert any(n.startswith("a real run would be refused") for n in json.loads(dry.stdout)["notes"])


# -- M3: the ranks of one job ---------------------------------------------------------------


def test_an_idle_rank_of_a_job_with_a_working_rank_is_spared(
    rig, victims, agent, tmp_path: Path
) -> None:
    job = {"PATH": os.environ["PATH"], "TORCHELASTIC_RUN_ID": "run-7"}
    idle_rank, busy_rank = victims(env=job), victims(env=job)
    lone = victims()  # same user and parent, no job: not linked
    scenario = _setup(
        rig,
        agent,
        [
            Hold(idle_rank.pid, gpu=0, memory="3GiB"),
            Hold(busy_rank.pid, gpu=1, memory="3GiB", sm="70"),
            Hold(lone.pid, gpu=0, memory="3GiB"),
        ],
    )
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    by_pid = {c["pid"]: c for c in json.loads(done.stdout)["candidates"]}
    assert by_pid[idle_rank.pid]["decision"] == "spare"
    assert by_pid[idle_rank.pid]["detail"].startswith(f"its fellow rank pid {busy_rank.pid} did")
    assert by_pid[lone.pid]["decision"] == "reap"


# -- L1: names that name nobody --------------------------------------------------------------


def test_a_user_that_does_not_exist_is_an_error_not_nothing_to_do(
    rig, agent, tmp_path: Path
) -> None:
    scenario = _setup(rig, agent, [], seconds=600)
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--user", "nosuchuser", "--dry-run")
    assert done.returncode == 3
    assert done.stderr.strip() == "gpuwatch: error: --user nosuchuser: no such user on this host"
    numeric = _reap(tmp_path, agent, scenario, "--idle", "2h", "--user", "4242", "--dry-run")
    assert numeric.returncode == 20, numeric.stderr


@pytest.mark.parametrize(
    ("key", "value"),
    [("protected_slurm_jobs", "not-a-job"), ("protected_slurm_jobs", "1234_5"),
     ("protected_pods", "NOT-A-POD")],
)  # fmt: skip
def test_a_protection_that_can_match_nothing_is_refused(key: str, value: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="is not a"):
        ReapSettings.model_validate({key: [value]})
    ReapSettings.model_validate(
        {
            "protected_slurm_jobs": ["881"],
            "protected_pods": ["0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"],
        }
    )


def test_a_protected_user_that_does_not_exist_is_logged(caplog) -> None:
    from gpuwatch.agent.reaper.policy import Protections

    Protections.from_settings(
        ReapSettings(protected_users=["svc-infernce", "root", "4242"]), self_pids=()
    )
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'svc-infernce' is no user on this host" in warned[0]


# -- M2, L2: the audit log's owner and mode ----------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="root creates the log in another user's directory")
def test_root_creates_the_log_for_its_directorys_owner(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, ALICE, ALICE)  # the agent's StateDirectory, its service user's
    AuditLog(state / "audit.jsonl").write({"event": "decision"})
    info = (state / "audit.jsonl").stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (ALICE, ALICE, 0o600)
    AuditLog(state / "audit.jsonl").write({"event": "decision"})  # root appends still
    assert len(AuditLog(state / "audit.jsonl").read()) == 2


def test_a_log_others_may_write_is_refused(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_text("")
    log.chmod(0o666)
    with pytest.raises(AuditError, match=r"other users may write it \(mode 0666\)"):
        AuditLog(log).write({"event": "decision"})
    assert log.read_text() == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a file of another user")
def test_a_log_of_another_user_is_refused(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_text("")
    log.chmod(0o600)
    os.chown(log, ALICE, ALICE)
    with pytest.raises(AuditError, match="belongs to uid 4242"):
        AuditLog(log).write({"event": "decision"})


# -- L3: what the outcomes say -----------------------------------------------------------------


def test_a_sigterm_ignoring_process_is_said_to_be_killed_by_sigkill(
    rig, victims, agent, tmp_path: Path
) -> None:
    stubborn = victims(stubborn=True)
    scenario = _setup(rig, agent, [Hold(stubborn.pid)])
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes", "--grace", "1s")
    assert done.returncode == 0, done.stderr
    assert f"pid {stubborn.pid}: killed (killed by SIGKILL " in done.stdout
    assert "after SIGTERM (it ignored SIGTERM))" in done.stdout


def test_one_that_exited_by_itself_is_not_said_to_be_freed_by_the_reaper() -> None:
    from rich.console import Console

    from gpuwatch.agent.reaper.execute import Result
    from gpuwatch.agent.reaper.report import print_results

    console = Console(record=True, width=200)
    gone = Result(4242, "already_exited", "it exited by itself before any signal; nothing was sent",
                  memory_bytes=2**30, memory_freed=True, memory_freed_bytes=2**30,
                  seconds_to_freed=0.0)  # fmt: skip
    print_results([gone], console)
    text = console.export_text()
    assert "exited by itself before any signal" in text and "freed in" not in text


def test_config_error_is_the_exit_3_kind() -> None:
    assert ConfigError.exit_code == 3
