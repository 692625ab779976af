"""Build the agent's parts from settings, once, at start-up (the CLI calls these)."""

from __future__ import annotations

import logging

from gpuwatch.agent.identity import host_identity
from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import Sampler
from gpuwatch.agent.service import Agent, SnapshotSink
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.nvml.connect import connect
from gpuwatch.settings import AgentSettings

log = logging.getLogger(__name__)


def build_sampler(
    settings: AgentSettings,
    state: AgentState,
    torch_reports: TorchReports | None = None,
    *,
    one_shot: bool = False,
) -> Sampler:
    """Open NVML (real or fake) and wire a sampler (``one_shot``: for a single poll).
    Raises NvmlUnavailable/ScenarioError."""
    session = connect(settings.fake_gpus, errors=state.nvml_errors)
    procinfo = ProcInfo(
        settings.proc_root,
        declared_users=_declared_users() if settings.fake_gpus is not None else None,
    )
    if not one_shot:  # `gpuwatch status` prints them above its table instead
        for note in procinfo.reader_notes:
            log.warning("attribution: %s", note)
    return Sampler(
        session,
        procinfo,
        host_identity(settings.agent_id, hostname=settings.hostname, proc_root=settings.proc_root),
        timeout_seconds=settings.nvml_timeout_seconds,
        torch_reports=torch_reports,
        pid_namespace_isolated=procinfo.pid_namespace_isolated,
        fake=settings.fake_gpus is not None,
        confirm_gone=not one_shot,
    )


def _declared_users() -> dict[tuple[int, int], str]:
    """On simulated GPUs, the owners the scenario names (docs/scenarios.md, "Owners")."""
    from gpuwatch.nvml import fake
    from gpuwatch.nvml.fake.owners import declared_users

    host = fake.installed_host()
    return {} if host is None else declared_users(host)


def build_agent(settings: AgentSettings, *, sink: SnapshotSink | None = None) -> Agent:
    state = AgentState()
    torch_reports = TorchReports()
    sampler = build_sampler(settings, state, torch_reports)
    if sink is None and settings.server_url:
        from gpuwatch.agent.push import ServerSink

        sink = ServerSink(settings)
    return Agent(settings, sampler=sampler, state=state, torch_reports=torch_reports, sink=sink)
