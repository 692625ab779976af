"""The exporter, scraped over real HTTP; the exposition linted by promtool."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.exposition import generate_latest
from support.snapshots import GiB, sample_snapshot

from gpuwatch.agent.collectors.agent import AgentCollector, PushStats
from gpuwatch.agent.collectors.dcgm import DcgmCompatCollector
from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.agent.collectors.process import ProcessCollector
from gpuwatch.agent.collectors.registry import ScrapeRenderer, build_registry
from gpuwatch.agent.exporter import Exporter
from gpuwatch.agent.incident_origin import IncidentOrigin, tcp_peer_uid
from gpuwatch.agent.port import PortPolicy
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.wire import OomIncident

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"


def _state() -> AgentState:
    state = AgentState()
    state.record_poll(sample_snapshot())
    state.nvml_errors.add("nvmlDeviceGetPowerUsage", "not_supported")
    return state


def _registry(
    state: AgentState, *, processes: bool = True, max_series: int = 100, dcgm: bool = True
):
    source = lambda: state.latest  # noqa: E731
    dcgm_collectors = [DcgmCompatCollector(source)] if dcgm else []
    return build_registry(
        [
            GpuCollector(source),
            ProcessCollector(source, enabled=processes, max_series=max_series),
            AgentCollector(
                state,
                torch_reports_total=lambda: 3,
                push_stats=_push_stats,
            ),
            *dcgm_collectors,
        ]
    )


def _push_stats() -> PushStats:
    return PushStats(
        batches={"success": 5},
        dropped={"spool_full": 1},
        pending=2,
        last_success_time=1.7e9,
        pushed={"accepted": 9},
    )


def _normalise(text: str) -> str:
    """Drop what legitimately varies between runs: durations and the Python version."""
    text = re.sub(
        r"(gpuwatch_scrape_collector_duration_seconds\{[^}]*\}) \S+", r"\1 <duration>", text
    )
    return re.sub(r'python_version="[^"]*"', 'python_version="<python>"', text)


def _renderer(state: AgentState, calls: list[str] | None = None) -> ScrapeRenderer:
    source = lambda: state.latest  # noqa: E731

    class Counting(GpuCollector):
        def collect(self):
            if calls is not None:
                calls.append("gpu")
            return super().collect()

    return ScrapeRenderer(
        [
            Counting(source),
            ProcessCollector(source, enabled=True, max_series=100),
            DcgmCompatCollector(source),
        ],
        [
            AgentCollector(
                state,
                torch_reports_total=lambda: 3,
                push_stats=_push_stats,
            )
        ],
        sequence=lambda: state.latest.sequence if state.latest else None,
    )


def test_metrics_match_golden_file() -> None:
    body, content_type = _renderer(_state()).render("")
    assert content_type.startswith("text/plain; version=0.0.4")
    text = _normalise(body.decode())
    if not GOLDEN.exists():
        GOLDEN.write_text(text)
        pytest.fail("golden file was missing and has been written: review it and commit")
    assert text == GOLDEN.read_text(), (
        "exposition changed: review and update tests/agent/golden/metrics.txt"
    )


def test_snapshot_part_is_encoded_once_per_poll() -> None:
    state = _state()
    calls: list[str] = []
    renderer = _renderer(state, calls)
    first, _ = renderer.render("")
    second, _ = renderer.render("")
    assert calls == ["gpu"]  # the second scrape reused the encoded snapshot part
    assert _normalise(first.decode()) == _normalise(second.decode())
    state.record_poll(sample_snapshot().model_copy(update={"sequence": 8}))
    renderer.render("")
    assert calls == ["gpu", "gpu"]


def test_openmetrics_document_has_one_eof() -> None:
    body, content_type = _renderer(_state()).render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.count(b"# EOF") == 1 and body.endswith(b"# EOF\n")
    assert b"gpuwatch_scrape_collector_success" in body


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_promtool_accepts_native_exposition() -> None:
    result = _promtool(generate_latest(_registry(_state(), dcgm=False)))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""
    # And what the exporter actually serves, snapshot part plus live part, in one document.
    state = _state()
    source = lambda: state.latest  # noqa: E731
    renderer = ScrapeRenderer(
        [GpuCollector(source), ProcessCollector(source, enabled=True, max_series=10)],
        [AgentCollector(state)],
        sequence=lambda: 1,
    )
    result = _promtool(renderer.render("")[0])
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_promtool_finds_only_dcgms_own_label_style_in_compat_set() -> None:
    # dcgm-exporter's names and camelCase labels (modelName) are the point of the compat
    # set; promtool's style lint on them is the one finding we accept.
    result = _promtool(generate_latest(_registry(_state())))
    findings = [line for line in result.stderr.decode().splitlines() if line.strip()]
    assert findings, "expected promtool to flag dcgm-exporter's camelCase labels"
    # ... and dcgm-exporter's own names (DCGM_FI_DEV_PCIE_REPLAY_COUNTER "includes a type").
    assert all(f.startswith("DCGM_FI_") for f in findings), findings


def _promtool(body: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30, check=False
    )


def test_unavailable_value_is_absent_not_zero() -> None:
    registry = _registry(_state())
    # GPU 1 is lost: it reports up=0 and lost=1, and no memory series at all.
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_up", {"gpu": "1", "uuid": "GPU-11111111-1111-1111-1111-111111111111"}
        )
        == 0
    )
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_lost", {"gpu": "1", "uuid": "GPU-11111111-1111-1111-1111-111111111111"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_memory_used_bytes",
            {"gpu": "1", "uuid": "GPU-11111111-1111-1111-1111-111111111111"},
        )
        is None
    )


def test_dead_and_orphaned_memory_are_flagged() -> None:
    registry = _registry(_state())
    labels = {"gpu": "0", "uuid": "GPU-00000000-0000-0000-0000-000000000000"}
    assert registry.get_sample_value("gpuwatch_gpu_memory_dead_process_bytes", labels) == 2 * GiB
    # The notebook kernel's server is gone: its 20 GiB counts as orphaned.
    assert registry.get_sample_value("gpuwatch_gpu_memory_orphaned_bytes", labels) == 20 * GiB
    assert registry.get_sample_value("DCGM_FI_DEV_FB_USED", {**_dcgm_labels()}) == 53 * 1024


def _dcgm_labels() -> dict[str, str]:
    return {
        "gpu": "0",
        "UUID": "GPU-00000000-0000-0000-0000-000000000000",
        "pci_bus_id": "00000000:07:00.0",
        "device": "nvidia0",
        "modelName": "NVIDIA A100-SXM4-80GB",
        "Hostname": "gpu-box",
        "DCGM_FI_DRIVER_VERSION": "550.54.15",
    }


def test_process_series_are_capped_largest_first() -> None:
    registry = _registry(_state(), max_series=1)
    assert registry.get_sample_value("gpuwatch_gpu_process_series_dropped", {}) == 2
    text = generate_latest(registry).decode()
    assert 'pid="5151"' in text  # the 30 GiB trainer is kept
    assert 'pid="4242"' not in text


def test_torch_figures_exported_even_without_process_metrics() -> None:
    text = generate_latest(_registry(_state(), processes=False)).decode()
    assert "gpuwatch_gpu_process_torch_reserved_unallocated_bytes{" in text
    assert "gpuwatch_gpu_process_memory_used_bytes{" not in text


def test_a_failing_collector_does_not_empty_the_scrape() -> None:
    class Broken:
        name = "broken"

        def collect(self):
            raise RuntimeError("boom")

    state = _state()
    registry = build_registry([Broken(), GpuCollector(lambda: state.latest)])
    assert (
        registry.get_sample_value("gpuwatch_scrape_collector_success", {"collector": "broken"}) == 0
    )
    assert registry.get_sample_value("gpuwatch_scrape_collector_success", {"collector": "gpu"}) == 1
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_memory_total_bytes",
            {"gpu": "0", "uuid": "GPU-00000000-0000-0000-0000-000000000000"},
        )
        == 80 * GiB
    )


@pytest.fixture
def exporter():
    state = _state()
    reports = TorchReports()
    incidents: list[OomIncident] = []
    source = lambda: state.latest  # noqa: E731
    renderer = ScrapeRenderer(
        [GpuCollector(source), ProcessCollector(source, enabled=True, max_series=100)],
        [AgentCollector(state)],
        sequence=lambda: state.latest.sequence if state.latest else None,
    )
    exp = Exporter(
        ("127.0.0.1", 0),
        render_metrics=renderer.render,
        state=state,
        torch_reports=reports,
        poll_interval_seconds=5,
        on_oom=incidents.append,
        clock=lambda: 1_700_010_001.0,
    )
    exp.start()
    yield exp, reports, incidents
    exp.stop()


def test_scrape_over_http(exporter) -> None:
    exp, _, _ = exporter
    response = httpx.get(f"{exp.url}/metrics", headers={"Accept-Encoding": "gzip"})
    assert response.status_code == 200
    assert response.headers["content-encoding"] == "gzip"
    assert "gpuwatch_gpu_memory_total_bytes{" in response.text
    openmetrics = httpx.get(
        f"{exp.url}/metrics", headers={"Accept": "application/openmetrics-text"}
    )
    assert openmetrics.text.rstrip().endswith("# EOF")
    snap = httpx.get(f"{exp.url}/snapshot").json()
    assert snap["gpus"][0]["processes"][0]["pid"] == 4242
    assert httpx.get(f"{exp.url}/healthz").status_code == 200
    assert httpx.get(f"{exp.url}/nope").status_code == 404


def test_torch_report_is_validated_and_recorded(exporter) -> None:
    exp, reports, _ = exporter
    body = {
        "pid": 5151, "device_index": 0, "allocated_bytes": 1, "reserved_bytes": 2,
        "reserved_unallocated_bytes": 1, "peak_allocated_bytes": 1, "reported_at": 1.7e9,
    }  # fmt: skip
    assert httpx.post(f"{exp.url}/torch", json=body).status_code == 204
    assert reports.get(5151, 0, start_time=None) is not None
    bad = httpx.post(f"{exp.url}/torch", json={**body, "extra": 1})
    assert bad.status_code == 422 and "extra" in bad.json()["error"]
    assert httpx.post(f"{exp.url}/torch", content=b"{not json").status_code == 400
    huge = httpx.post(f"{exp.url}/torch", content=b"x" * (17 * 1024))
    assert huge.status_code == 413


def test_oom_incident_is_handed_to_the_agent(exporter) -> None:
    exp, _, incidents = exporter
    response = httpx.post(
        f"{exp.url}/incidents/oom",
        json={"pid": 1, "device_index": 0, "message": "CUDA out of memory"},
    )
    assert response.status_code == 202
    assert incidents == [OomIncident(pid=1, device_index=0, message="CUDA out of memory")]
    assert json.loads(httpx.post(f"{exp.url}/incidents/oom", json=[1]).text)["error"]
    unknown = httpx.post(f"{exp.url}/incidents/oom", json={"pid": 1, "message": "x", "extra": 1})
    assert unknown.status_code == 422 and "extra" in unknown.json()["error"]
    assert len(incidents) == 1


# -- the port's bounds and access (PortPolicy) ---------------------------------------------


def _exporter(policy: PortPolicy, *, render=None, address=("127.0.0.1", 0), **kwargs) -> Exporter:
    state = _state()
    source = lambda: state.latest  # noqa: E731
    renderer = ScrapeRenderer([GpuCollector(source)], [AgentCollector(state)], sequence=lambda: 1)
    exp = Exporter(
        address,
        render_metrics=render or renderer.render,
        state=state,
        torch_reports=TorchReports(),
        poll_interval_seconds=5,
        clock=lambda: 1_700_010_001.0,
        policy=policy,
        **kwargs,
    )
    exp.start()
    return exp


def _port(exp: Exporter) -> int:
    return int(exp.url.rsplit(":", 1)[1])


def test_200_half_sent_requests_hold_no_threads_and_metrics_still_answers() -> None:
    exp = _exporter(PortPolicy(workers=4, max_waiting_connections=512))
    before = threading.active_count()
    stalled = []
    try:
        for _ in range(200):
            conn = socket.create_connection(("127.0.0.1", _port(exp)), timeout=5)
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
            stalled.append(conn)
        started = time.monotonic()
        response = httpx.get(f"{exp.url}/metrics", timeout=5)
        assert response.status_code == 200
        assert "gpuwatch_gpu_memory_total_bytes{" in response.text
        assert time.monotonic() - started < 2
        # At most the worker pool on top of what ran before (the selector thread is one).
        assert threading.active_count() - before <= 4
    finally:
        for conn in stalled:
            conn.close()
        exp.stop()


def test_a_request_that_never_finishes_is_cut_off_at_the_deadline() -> None:
    exp = _exporter(PortPolicy(workers=2, request_timeout_seconds=0.6, header_timeout_seconds=0.3))
    slow_head = socket.create_connection(("127.0.0.1", _port(exp)), timeout=5)
    slow_body = socket.create_connection(("127.0.0.1", _port(exp)), timeout=5)
    stop = threading.Event()

    def dribble() -> None:
        # A byte every 0.1 s: never idle long enough for the 0.3 s read timeout.
        for byte in b'{"pid": 1, "device_index": 0, "allocated_bytes": 1 ...':
            if stop.wait(0.1):
                return
            try:
                slow_body.send(bytes([byte]))
            except OSError:
                return

    try:
        # Half a head: closed at the header deadline, without a thread.
        slow_head.sendall(b"GET /metrics HTTP/1.1\r\n")
        # A whole head, then a body that trickles: cut at the request deadline.
        slow_body.sendall(
            b"POST /torch HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n"
        )
        threading.Thread(target=dribble, daemon=True).start()
        started = time.monotonic()
        assert slow_head.recv(1024) == b""
        assert slow_body.recv(1024) == b""
        elapsed = time.monotonic() - started
        assert 0.4 < elapsed < 3
        assert exp._server.timed_out_total >= 2
        assert httpx.get(f"{exp.url}/healthz", timeout=5).status_code == 200
    finally:
        stop.set()
        slow_head.close()
        slow_body.close()
        exp.stop()


def test_past_the_queue_new_requests_get_503_at_once() -> None:
    release = threading.Event()

    def blocking_render(accept: str) -> tuple[bytes, str]:
        release.wait(10)
        return b"# EOF\n", "text/plain"

    exp = _exporter(PortPolicy(workers=1), render=blocking_render)
    held = []
    try:
        for _ in range(4):  # 1 worker x 4 in flight: one running, three queued
            conn = socket.create_connection(("127.0.0.1", _port(exp)), timeout=5)
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            held.append(conn)
        deadline = time.monotonic() + 5
        while exp._server._in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.get(f"{exp.url}/metrics", timeout=5)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
    finally:
        release.set()
        for conn in held:
            conn.close()
        exp.stop()


def test_keep_alive_connections_serve_many_requests() -> None:
    exp = _exporter(PortPolicy(workers=1))
    try:
        with httpx.Client(timeout=5) as client:
            for _ in range(5):
                assert client.get(f"{exp.url}/healthz").status_code == 200
            assert client.get(f"{exp.url}/snapshot").json()["hostname"] == "gpu-box"
    finally:
        exp.stop()


def _non_loopback_ip() -> str | None:
    """An address of this host that is not loopback (to be a 'remote' client)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent for UDP connect
        except OSError:
            return None
        ip = probe.getsockname()[0]
    return None if ip.startswith("127.") else ip


@pytest.mark.parametrize(
    ("access", "headers", "status"),
    [
        ("loopback", {}, 403),
        ("token", {}, 403),
        ("token", {"Authorization": "Bearer wrong"}, 403),
        ("token", {"Authorization": "Bearer s3cret"}, 200),
        ("open", {}, 200),
    ],
)
def test_snapshot_from_another_host_needs_the_access_the_option_gives(
    access: str, headers: dict[str, str], status: int
) -> None:
    remote = _non_loopback_ip()
    if remote is None:
        pytest.skip("no non-loopback address to act as another host")
    policy = PortPolicy(snapshot_access=access, snapshot_token="s3cret")  # type: ignore[arg-type]
    exp = _exporter(policy, address=("0.0.0.0", 0))
    try:
        response = httpx.get(f"http://{remote}:{_port(exp)}/snapshot", headers=headers, timeout=5)
        assert response.status_code == status
        if status == 403:
            assert "snapshot" in response.json()["error"]
        # /metrics stays open to Prometheus; this host always reads /snapshot.
        assert httpx.get(f"http://{remote}:{_port(exp)}/metrics", timeout=5).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{_port(exp)}/snapshot", timeout=5).status_code == 200
    finally:
        exp.stop()


def test_oom_incidents_say_who_posted_them() -> None:
    received: list[tuple[OomIncident, IncidentOrigin]] = []
    exp = _exporter(PortPolicy(), on_oom_from=lambda i, o: received.append((i, o)))
    try:
        response = httpx.post(
            f"{exp.url}/incidents/oom", json={"pid": 1, "message": "CUDA out of memory"}
        )
        assert response.status_code == 202
        ((incident, origin),) = received
        assert incident.pid == 1
        assert origin.reported_by == "agent-local"
        assert origin.peer_uid == os.getuid()  # from /proc/net/tcp, not from the body
        assert origin.evidence()["reporter_uid"] == os.getuid()
    finally:
        exp.stop()


def test_oom_incidents_can_be_turned_off() -> None:
    received: list[OomIncident] = []
    exp = _exporter(PortPolicy(accept_oom_incidents=False), on_oom=received.append)
    try:
        response = httpx.post(f"{exp.url}/incidents/oom", json={"pid": 1, "message": "x"})
        assert response.status_code == 403
        assert "accept_oom_incidents" in response.json()["error"]
        assert received == []
    finally:
        exp.stop()


def test_tcp_peer_uid_reads_a_proc_net_fixture(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:2302 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
        "   1: 0100007F:D431 0100007F:2302 01 00000000:00000000 00:00000000 00000000  1001        0 2 1\n"
    )
    assert tcp_peer_uid(("127.0.0.1", 0xD431), ("127.0.0.1", 0x2302), proc_root=tmp_path) == 1001
    assert tcp_peer_uid(("127.0.0.1", 1), ("127.0.0.1", 0x2302), proc_root=tmp_path) is None
    # A client end its owner closed: TIME_WAIT (06) and FIN_WAIT2 (05) rows have uid 0
    # and inode 0, which is no one, not root.
    (net / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:D432 0100007F:2302 06 00000000:00000000 03:00000F8A 00000000     0        0 0 3\n"
        "   1: 0100007F:D433 0100007F:2302 05 00000000:00000000 00:00000000 00000000     0        0 0 3\n"
    )
    for port in (0xD432, 0xD433):
        assert tcp_peer_uid(("127.0.0.1", port), ("127.0.0.1", 0x2302), proc_root=tmp_path) is None


def test_a_poster_that_closed_its_socket_is_no_one() -> None:
    # The forged-root attack: send the request, close at once, and be looked up late.
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
        with served:
            ends = (client.getsockname()[:2], listener.getsockname()[:2])
            assert tcp_peer_uid(*ends) == os.getuid()
            client.close()  # the client end goes to FIN_WAIT2, owned by no process
            assert tcp_peer_uid(*ends) is None


def test_the_reapers_history_follows_the_snapshots_access_rule() -> None:
    remote = _non_loopback_ip()
    if remote is None:
        pytest.skip("no non-loopback address to act as another host")
    exp = _exporter(
        PortPolicy(snapshot_access="loopback"),
        address=("0.0.0.0", 0),
        history=lambda pid: b'{"processes": []}',
    )
    try:
        far = httpx.get(f"http://{remote}:{_port(exp)}/reaper/history", timeout=5)
        near = httpx.get(f"http://127.0.0.1:{_port(exp)}/reaper/history", timeout=5)
        assert (far.status_code, near.status_code) == (403, 200)
    finally:
        exp.stop()


def test_a_sample_must_carry_exactly_the_labels_its_spec_declares() -> None:
    # The reference (docs/metrics.md) is generated from the specs: a collector that
    # adds or drops a label would make it wrong without this check.
    from gpuwatch.agent.collectors.agent import BUILD, POLLS
    from gpuwatch.metricspec import Families

    families = Families([BUILD, POLLS])
    build = {"version": "1", "python_version": "3", "driver_version": "", "nvml_version": ""}
    families.add_info(BUILD, (), build)
    with pytest.raises(ValueError, match="gpuwatch_agent_build"):
        families.add_info(BUILD, (), {"version": "1"})
    with pytest.raises(ValueError, match="gpuwatch_agent_polls"):
        families.add(POLLS, (), 1.0)
