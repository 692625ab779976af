"""What an ordinary user, or another host, can claim, through ``gpuwatch reap``
(reaper audit, findings 2 to 5). Real processes on fake GPUs, a history served over
HTTP, the command run as a child.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from reaper.helpers import by_pid
from reaper.rig import ALICE, BOB, REPO_ROOT, HistoryServer, Hold, write_config
from reaper.test_reap_cli import _env, _reap, _setup

from gpuwatch.agent.reaper.errors import ReapRefused
from gpuwatch.agent.reaper.served import is_local, listeners, verify_agent

ELSEWHERE = "203.0.113.7"  # TEST-NET-3: an address of no host here


def _wildcard_port() -> int:
    """A port in this test's range (19900-19999) free on the wildcard address."""
    for port in range(19990, 19900, -1):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 19900-19999")


@pytest.fixture
def wildcard() -> Iterator[HistoryServer]:
    """The agent as deployed for remote scraping: root, listening on 0.0.0.0."""
    if is_local(ELSEWHERE):
        pytest.skip(f"{ELSEWHERE} is an address of this host")
    server = HistoryServer("0.0.0.0", _wildcard_port())
    yield server
    server.close()


# -- finding 2: --agent naming another host ----------------------------------------------------


def test_a_wildcard_listener_here_does_not_vouch_for_another_host(wildcard) -> None:
    assert listeners(wildcard.port, {"127.0.0.1"})  # this host: the agent's socket
    assert listeners(wildcard.port, {ELSEWHERE}) == []  # another host: nothing here
    with pytest.raises(ReapRefused, match=f"{ELSEWHERE} is not an address of this host"):
        verify_agent(f"http://{ELSEWHERE}:{wildcard.port}")
    assert verify_agent(f"http://127.0.0.1:{wildcard.port}")


def test_cli_refuses_an_agent_url_on_another_host(rig, victims, agent, wildcard, tmp_path) -> None:
    # Another host serves a history that calls everything idle for 3h (here: through
    # a proxy, which is also where an operator's HTTP_PROXY would send it). Before:
    # "reap idle", exit 0, on that host's word.
    idle = victims()
    scenario = _setup(rig, agent, [Hold(idle.pid)])
    wildcard.body = agent.body
    agent.url = f"http://{ELSEWHERE}:{wildcard.port}"
    env = {**_env(tmp_path), "HTTP_PROXY": wildcard.url, "http_proxy": wildcard.url}
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--json", env=env)
    assert done.returncode == 22, done.stderr
    assert f"{ELSEWHERE} is not an address of this host" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert wildcard.requests == []  # nothing was asked of the other host


def test_the_history_never_comes_through_a_proxy(rig, victims, agent, tmp_path) -> None:
    # The local agent (root, 127.0.0.1) has watched the process for 20 minutes only;
    # a proxy named by HTTP_PROXY answers with 3 idle hours. Before: the proxy's
    # answer was used, though the socket checked was the agent's.
    idle = victims()
    forger = HistoryServer()
    try:
        scenario = _setup(rig, agent, [Hold(idle.pid)])
        forger.body = agent.body
        _setup(rig, agent, [Hold(idle.pid)], seconds=20 * 60)
        env = {**_env(tmp_path), "HTTP_PROXY": forger.url, "http_proxy": forger.url}
        done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--json", env=env)
    finally:
        forger.close()
    assert done.returncode == 20, done.stderr
    assert by_pid(done) == {idle.pid: ("spare", "idle_too_short")}
    assert forger.requests == [] and agent.requests


# -- findings 3 and 4: protections an ordinary user could claim -------------------------------


def test_a_slurm_job_id_in_the_environment_protects_nothing(rig, victims, agent, tmp_path) -> None:
    # SLURM_JOB_ID=881 set by the user, no Slurm cgroup. Before: "protected_job".
    job_env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "881"}
    claimer = victims(env=job_env)
    scenario = _setup(rig, agent, [Hold(claimer.pid)])
    config = write_config(tmp_path / "slurm.toml", '[agent.reap]\nprotected_slurm_jobs = ["881"]\n')
    done = _reap(
        tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--json", env=_env(tmp_path, config)
    )
    assert done.returncode == 0, done.stderr
    (candidate,) = json.loads(done.stdout)["candidates"]
    assert (candidate["decision"], candidate["reason"]) == ("reap", "idle")
    assert candidate["workload"] == "job 881"  # still shown, for attribution


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as other users")
def test_a_display_server_name_protects_only_a_system_account(rig, victims, agent) -> None:
    # Run as a user with CAP_KILL only, as the policy runs: other users' executables
    # cannot be read, so only names are seen. Alice's process named Xorg was protected
    # for ever before; a system account's (uid 500) still is.
    users, system = victims(uid=ALICE, name="Xorg"), victims(uid=500, name="Xorg")
    plain = victims(uid=ALICE)
    scenario = _setup(
        rig, agent, [Hold(users.pid), Hold(system.pid, gpu=1), Hold(plain.pid, gpu=1)]
    )
    with _shared_dir() as shared:
        config = write_config(shared / "low.toml", "[agent.reap]\nsystem_uid_max = 99\n")
        config.chmod(0o644)
        done = _reap_with_cap_kill(shared, scenario, agent.url, config)
    assert done.returncode == 0, done.stderr
    assert by_pid(done) == {
        users.pid: ("reap", "idle"),
        system.pid: ("spare", "protected_display_server"),
        plain.pid: ("reap", "idle"),
    }


def _reap_with_cap_kill(
    shared: Path, scenario: Path, url: str, config: Path
) -> subprocess.CompletedProcess[str]:
    home = shared / "bob"
    home.mkdir()
    os.chown(home, BOB, BOB)
    readable = shutil.copy(scenario, shared / scenario.name)
    env = _env(home, config)
    return subprocess.run(
        ["setpriv", f"--reuid={BOB}", f"--regid={BOB}", "--clear-groups",
         "--inh-caps=+kill", "--ambient-caps=+kill", "--",
         sys.executable, "-m", "gpuwatch", "reap", "--idle", "2h", "--dry-run", "--json",
         "--agent", url, "--fake-gpus", str(readable),
         "--audit-log", str(home / "audit.jsonl")],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip


class _shared_dir:
    """A directory other users can read (pytest's tmp dirs are root's, 0700)."""

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix="gpuwatch-claims-"))
        self.path.chmod(0o755)
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path)


# -- finding 5 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--idle", "--grace"])
def test_an_empty_duration_is_the_usual_one_line_error(option, rig, agent, tmp_path) -> None:
    scenario = _setup(rig, agent, [], seconds=600)
    args = ["--idle", "2h", option, ""] if option == "--grace" else [option, ""]
    done = _reap(tmp_path, agent, scenario, *args, "--dry-run")
    assert done.returncode == 3
    assert done.stderr.strip().splitlines() == [
        f"gpuwatch: error: {option}: expected a duration such as 90s, 10m or 1h30m, got ''"
    ]
