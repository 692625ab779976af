"""deploy/kubernetes: manifests parse, every container is bounded and unprivileged, and the
objects point at each other correctly (selectors, ports, job names the rules expect)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatch.settings import ServerSettings, load

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
IMAGE = "gpuwatch:0.1.0"
# Needs the Prometheus Operator's CRDs, so it is applied separately, not via kustomize.
OPERATOR_ONLY = "monitoring.yaml"

Manifest = dict[str, Any]


def _documents(path: Path) -> list[Manifest]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    docs = [
        d
        for p in sorted(K8S.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in _documents(p)
    ]
    assert docs
    return docs


def _one(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _workloads(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["kind"] in {"DaemonSet", "Deployment", "StatefulSet", "Job"}]


def _containers(workload: Manifest) -> list[Manifest]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_every_object_is_namespaced_in_gpuwatch(manifests: list[Manifest]) -> None:
    for m in manifests:
        if m["kind"] != "Namespace":
            assert m["metadata"].get("namespace") == "gpuwatch", (
                f"{m['kind']}/{m['metadata']['name']}"
            )


def test_kustomization_lists_every_manifest_but_the_operator_ones() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", OPERATOR_ONLY}
    assert set(kustomization["resources"]) == files
    kinds = {d["apiVersion"].split("/")[0] for d in _documents(K8S / OPERATOR_ONLY)}
    assert kinds == {"monitoring.coreos.com"}, "only operator objects belong in monitoring.yaml"


def test_every_container_has_requests_and_a_memory_limit(manifests: list[Manifest]) -> None:
    for workload in _workloads(manifests):
        for c in _containers(workload):
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), c["name"]
            assert "memory" in resources.get("limits", {}), c["name"]


def test_every_container_is_non_root_read_only_and_without_capabilities(
    manifests: list[Manifest],
) -> None:
    for workload in _workloads(manifests):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        # Neither workload talks to the Kubernetes API: no token in the pod.
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostIPC")
        for c in _containers(workload):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc.get("privileged", False) is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert c["image"] == IMAGE, c["name"]


def test_nothing_requests_a_gpu(manifests: list[Manifest]) -> None:
    """The agent sees GPUs via NVIDIA_VISIBLE_DEVICES=all; requesting nvidia.com/gpu would
    take a GPU away from the jobs on every node."""
    for workload in _workloads(manifests):
        for c in _containers(workload):
            for section in ("requests", "limits"):
                assert not any("gpu" in k for k in c["resources"].get(section, {})), c["name"]


def test_agent_daemonset_sees_host_pids_on_gpu_nodes_only(manifests: list[Manifest]) -> None:
    agent = _one(manifests, "DaemonSet", "gpuwatch-agent")
    pod = agent["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # NVML reports host PIDs
    assert pod["nodeSelector"], "the agent belongs on GPU nodes only"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["GPUWATCH_AGENT_AGENT_ID"]["value"] == "$(NODE_NAME)"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/var/lib/gpuwatch/spool" in mounts


def test_agent_readiness_probe_is_healthz_on_the_metrics_port(manifests: list[Manifest]) -> None:
    (container,) = _one(manifests, "DaemonSet", "gpuwatch-agent")["spec"]["template"]["spec"][
        "containers"
    ]
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[probe["port"]] == 9402


def test_single_replica_sqlite_server_is_recreated_not_rolled(manifests: list[Manifest]) -> None:
    server = _one(manifests, "Deployment", "gpuwatch-server")
    assert server["spec"]["replicas"] == 1
    assert server["spec"]["strategy"]["type"] == "Recreate"
    pod = server["spec"]["template"]["spec"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"gpuwatch-server-data"}
    _one(manifests, "PersistentVolumeClaim", "gpuwatch-server-data")
    (container,) = pod["containers"]
    data = next(v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert {"name": data, "mountPath": "/var/lib/gpuwatch"} in container["volumeMounts"]
    for env in container["env"]:
        # Secrets only by reference, and optional: SQLite and open reads work without them.
        ref = env["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "gpuwatch-server" and ref["optional"] is True


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_service_and_monitors_select_the_pods_and_ports_that_exist(
    manifests: list[Manifest],
) -> None:
    server = _one(manifests, "Deployment", "gpuwatch-server")["spec"]["template"]
    service = _one(manifests, "Service", "gpuwatch-server")
    assert _selects(service["spec"]["selector"], server["metadata"]["labels"])
    server_ports = {p["name"] for p in server["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= server_ports

    monitor = _one(manifests, "ServiceMonitor", "gpuwatch-server")
    assert _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }

    agent = _one(manifests, "DaemonSet", "gpuwatch-agent")["spec"]["template"]
    pod_monitor = _one(manifests, "PodMonitor", "gpuwatch-agent")
    assert _selects(pod_monitor["spec"]["selector"]["matchLabels"], agent["metadata"]["labels"])
    agent_ports = {p["name"] for p in agent["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= agent_ports


def test_monitors_produce_the_job_names_and_labels_the_rules_expect(
    manifests: list[Manifest],
) -> None:
    (endpoint,) = _one(manifests, "PodMonitor", "gpuwatch-agent")["spec"]["podMetricsEndpoints"]
    relabel = endpoint["relabelings"]
    assert {"targetLabel": "job", "replacement": "gpuwatch-agent"} in relabel
    assert {"action": "labeldrop", "regex": "pod|container"} in relabel
    # No rename of a per-process `job` label is needed: the agent exports `slurm_job`.
    assert "metricRelabelings" not in endpoint
    # A ServiceMonitor's job is the Service's name, unless jobLabel overrides it.
    assert "jobLabel" not in _one(manifests, "ServiceMonitor", "gpuwatch-server")["spec"]
    _one(manifests, "Service", "gpuwatch-server")


def test_namespace_allows_host_pid_but_audits_everything_else(manifests: list[Manifest]) -> None:
    labels = _one(manifests, "Namespace", "gpuwatch")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"


AGENT_WRAPPER_CASES = [
    (
        "gpu-node-01",
        "s3cret",
        ["agent", "--server=http://gpuwatch-server.gpuwatch.svc:9403"],
        "s3cret",
    ),
    ("gpu-node-02", None, ["agent"], ""),
]


@pytest.mark.parametrize(("node", "token", "argv", "env_token"), AGENT_WRAPPER_CASES)
def test_agent_wrapper_pushes_only_with_this_nodes_token(
    manifests: list[Manifest],
    tmp_path: Path,
    node: str,
    token: str | None,
    argv: list[str],
    env_token: str,
) -> None:
    """Runs the DaemonSet's shell wrapper against a fake `gpuwatch` and token directory."""
    (container,) = _one(manifests, "DaemonSet", "gpuwatch-agent")["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["command"] == ["/bin/sh", "-ec"]
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "some-other-node").write_text("not-mine")
    if token is not None:
        (tokens / node).write_text(token)
    script = container["args"][0].replace("/etc/gpuwatch/tokens", str(tokens))
    fake = tmp_path / "bin" / "gpuwatch"
    fake.parent.mkdir()
    fake.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@"\nprintf "token=%s\\n" "${GPUWATCH_AGENT_TOKEN:-}"\n'
    )
    fake.chmod(0o755)
    result = subprocess.run(
        ["/bin/sh", "-ec", script],
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": f"{fake.parent}:{os.environ['PATH']}", "NODE_NAME": node},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [*argv, f"token={env_token}"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl missing")
def test_kubectl_kustomize_renders_the_base() -> None:
    # Offline: kustomize needs no cluster. (Schema validation would: not done here.)
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in rendered)
    assert kinds == [
        "DaemonSet/gpuwatch-agent",
        "Deployment/gpuwatch-server",
        "Namespace/gpuwatch",
        "PersistentVolumeClaim/gpuwatch-server-data",
        "Service/gpuwatch-server",
    ]
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpuwatch" for d in rendered)


def test_server_takes_a_read_token_an_admin_token_and_receivers_from_its_secret(
    manifests: list[Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read token goes to Prometheus, Grafana and reapers; without an admin token
    it would also create silences. Receivers' URLs and secrets are credentials."""
    (container,) = _containers(_one(manifests, "Deployment", "gpuwatch-server"))
    from_secret = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert from_secret["GPUWATCH_SERVER_READ_TOKEN"] == "read-token"
    assert from_secret["GPUWATCH_SERVER_ADMIN_TOKEN"] == "admin-token"
    assert from_secret["GPUWATCH_SERVER_RECEIVERS"] == "receivers"
    # The header's `kubectl create secret` command makes every key the pod reads, and
    # its receivers value is one the server loads.
    header = (K8S / "server.yaml").read_text(encoding="utf-8").split("\napiVersion:")[0]
    command = " ".join(line.lstrip("# ").rstrip("\\ ") for line in header.splitlines())
    literals = dict(
        arg.removeprefix("--from-literal=").split("=", 1)
        for arg in shlex.split(command[command.index("kubectl") :])
        if arg.startswith("--from-literal=")
    )
    assert set(from_secret.values()) <= set(literals)
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")
    monkeypatch.setenv("GPUWATCH_SERVER_RECEIVERS", literals["receivers"])
    assert [r.name for r in load(ServerSettings).receivers] == ["oncall"]


def _wrapper_script(manifests: list[Manifest], tokens: Path, recheck_seconds: str) -> str:
    """The DaemonSet's wrapper, pointed at ``tokens`` and rechecking that often."""
    (container,) = _one(manifests, "DaemonSet", "gpuwatch-agent")["spec"]["template"]["spec"][
        "containers"
    ]
    script: str = container["args"][0]
    assert "recheck_seconds=30\n" in script
    return script.replace("/etc/gpuwatch/tokens", str(tokens)).replace(
        "recheck_seconds=30\n", f"recheck_seconds={recheck_seconds}\n"
    )


def _fake_long_running_gpuwatch(bin_dir: Path, log: Path) -> None:
    """A `gpuwatch` that logs each start (arguments and token) and runs until SIGTERM."""
    bin_dir.mkdir()
    fake = bin_dir / "gpuwatch"
    fake.write_text(
        "#!/bin/sh\n"
        f'printf "start %s token=%s\\n" "$*" "${{GPUWATCH_AGENT_TOKEN:-}}" >> {log}\n'
        f"trap 'kill $! 2>/dev/null; echo stopped >> {log}; exit 0' TERM\n"
        "sleep 60 &\nwait $!\n"
    )
    fake.chmod(0o755)


def _wait_for_lines(log: Path, count: int, proc: subprocess.Popen[str]) -> list[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= count:
            return lines
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    pytest.fail(f"wrapper log never reached {count} lines: {log.read_text()!r}")


def test_agent_wrapper_switches_to_pushing_when_the_token_arrives_in_the_secret(
    manifests: list[Manifest], tmp_path: Path
) -> None:
    """The documented order (pods first, token Secret later) must end with agents pushing,
    without a restart by hand: the kubelet fills the Secret volume in, the wrapper sees it.
    A rotated token restarts the agent with the new one; SIGTERM stops the agent."""
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    log = tmp_path / "starts.log"
    _fake_long_running_gpuwatch(tmp_path / "bin", log)
    proc = subprocess.Popen(
        ["/bin/sh", "-ec", _wrapper_script(manifests, tokens, "0.05")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "NODE_NAME": "gpu-node-01"},
    )
    try:
        assert _wait_for_lines(log, 1, proc) == ["start agent token="]
        (tokens / "gpu-node-01").write_text("first")
        server = "--server=http://gpuwatch-server.gpuwatch.svc:9403"
        assert _wait_for_lines(log, 3, proc)[1:] == ["stopped", f"start agent {server} token=first"]
        (tokens / "gpu-node-01").write_text("second")
        assert _wait_for_lines(log, 5, proc)[3:] == [
            "stopped",
            f"start agent {server} token=second",
        ]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert log.read_text().splitlines()[5:] == ["stopped"]
    assert "metrics only" in stderr and "changed: restarting the agent" in stderr


def test_agent_wrapper_exits_with_the_agents_status_when_it_fails(
    manifests: list[Manifest], tmp_path: Path
) -> None:
    """A failing agent is the kubelet's to restart (and count), not hidden in a loop."""
    fake = tmp_path / "bin" / "gpuwatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 4\n")
    fake.chmod(0o755)
    result = subprocess.run(
        ["/bin/sh", "-ec", _wrapper_script(manifests, tmp_path / "tokens", "30")],
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": f"{fake.parent}:{os.environ['PATH']}", "NODE_NAME": "gpu-node-01"},
    )
    assert result.returncode == 4, result.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl missing")
def test_the_postgres_component_runs_replicas_without_the_read_write_once_volume(
    tmp_path: Path,
) -> None:
    """A second replica (or a rolling update's surge pod) on another node cannot attach the
    ReadWriteOnce PVC: the rollout hangs in ContainerCreating. The component drops the PVC,
    and requires the database URL so replicas never fall back to SQLite files of their own."""
    base = tmp_path / "kubernetes"
    shutil.copytree(K8S, base)
    # What `kustomize edit add component postgres` writes (kubectl has no `edit`).
    with (base / "kustomization.yaml").open("a", encoding="utf-8") as kustomization:
        kustomization.write("components:\n  - postgres\n")
    result = subprocess.run(
        ["kubectl", "kustomize", str(base)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert not [d for d in rendered if d["kind"] == "PersistentVolumeClaim"]
    server = _one(rendered, "Deployment", "gpuwatch-server")
    assert server["spec"]["replicas"] >= 2
    assert server["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = server["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    (container,) = pod["containers"]
    mounted = {m["name"] for m in container["volumeMounts"]}
    assert mounted <= {v["name"] for v in pod["volumes"]}
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["GPUWATCH_SERVER_DATABASE_URL"]["optional"] is False
    # The rest of the base is untouched.
    _one(rendered, "DaemonSet", "gpuwatch-agent")
