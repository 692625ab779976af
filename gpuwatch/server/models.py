"""Every table, imported in one place so ``Base.metadata`` is complete (Alembic, tests)."""

from gpuwatch.server.alerts.models import AlertGroupRow, AlertRow, NotificationRow, SilenceRow
from gpuwatch.server.auth.models import AgentToken
from gpuwatch.server.database.core import Base
from gpuwatch.server.events.models import Event
from gpuwatch.server.events.outbox import OutboxRow
from gpuwatch.server.hosts.models import Gpu, GpuIndex, GpuSample, GpuWindow, Host
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample, ProcessWindow

metadata = Base.metadata

__all__ = [
    "AgentToken",
    "AlertGroupRow",
    "AlertRow",
    "Base",
    "Event",
    "Gpu",
    "GpuIndex",
    "GpuSample",
    "GpuWindow",
    "Host",
    "NotificationRow",
    "OutboxRow",
    "ProcessLifetime",
    "ProcessSample",
    "ProcessWindow",
    "SilenceRow",
    "SnapshotSeen",
    "metadata",
]
