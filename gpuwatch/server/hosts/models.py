"""Hosts and their GPUs: the latest state the agents reported, plus per-GPU coarse samples.

Times are Unix epoch seconds (float), as in the snapshot schema; sizes are bytes.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Double,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base, IdType, rewritten_in_place

SHORT = 256  # matches gpuwatch.snapshot.ShortStr

# The event kinds a GPU's ``open_flags`` mask records, in bit order: bit ``i`` set means
# an open ``GPU_FLAG_KINDS[i]`` event on that GPU (its host and index). The fleet page's
# flags; appending a kind keeps the stored masks' meaning.
GPU_FLAG_KINDS = ("orphaned", "idle", "filling_up", "runaway", "gpu_lost")


class Host(Base):
    """One machine running an agent. Created by ``gpuwatch token create``.

    ``last_seen_at`` is the agent's ``collected_at`` of the newest applied snapshot;
    ``last_received_at`` is the server's clock when a snapshot last arrived, which is
    what agent silence is measured against (agent clocks may be skewed).
    """

    __tablename__ = "hosts"
    __table_args__ = rewritten_in_place("hosts")

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    hostname: Mapped[str] = mapped_column(String(SHORT), unique=True)
    created_at: Mapped[float] = mapped_column(Double)
    agent_id: Mapped[str | None] = mapped_column(String(SHORT))
    boot_id: Mapped[str | None] = mapped_column(String(SHORT))
    last_sequence: Mapped[int | None] = mapped_column(BigInteger)
    last_seen_at: Mapped[float | None] = mapped_column(Double)
    last_received_at: Mapped[float | None] = mapped_column(Double)
    driver_version: Mapped[str | None] = mapped_column(String(SHORT))
    cuda_driver_version: Mapped[str | None] = mapped_column(String(SHORT))
    pid_namespace_isolated: Mapped[bool] = mapped_column(Boolean, default=False)
    fake: Mapped[bool] = mapped_column(Boolean, default=False)
    # Cumulative count the agent reports of snapshots its spool had to drop.
    spool_dropped_total: Mapped[int] = mapped_column(BigInteger, default=0)
    # Bumped by every write to the host's ingest state (this row, its GPUs, open
    # lifetimes, open events, windows), so a server process can tell whether the copy
    # it kept from its last ingest of the host is still current (ingest/cache.py).
    state_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The host's GPUs as the fleet page draws them (JSON, hosts/tiles.py), kept by
    # ingest on every write of its GPUs' state; None until its GPUs were first written.
    tiles: Mapped[str | None] = mapped_column(Text)
    # Set by ``gpuwatch token revoke --retire`` (hosts/retire.py): a decommissioned host,
    # not judged silent and not in the fleet's views; a new token brings it back.
    retired_at: Mapped[float | None] = mapped_column(Double)
    # The push interval the host's agent last reported (``Gpuwatch-Push-Interval``);
    # None: it reports none, and ``agent_push_interval_seconds`` stands for it.
    push_interval_seconds: Mapped[float | None] = mapped_column(Double)


class Gpu(Base):
    """One physical GPU of a host, identified by its UUID (indexes can change on reboot).

    The ``bucket_*`` columns accumulate the current downsampling interval; the bucket
    is written to ``gpu_samples`` when a snapshot falls into the next one.
    """

    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("host_id", "uuid"), rewritten_in_place("gpus"))

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    uuid: Mapped[str] = mapped_column(String(SHORT))
    gpu_index: Mapped[int] = mapped_column(Integer)
    name: Mapped[str | None] = mapped_column(String(SHORT))
    memory_total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    memory_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    memory_free_bytes: Mapped[int | None] = mapped_column(BigInteger)
    unattributed_bytes: Mapped[int | None] = mapped_column(BigInteger)
    utilization_ratio: Mapped[float | None] = mapped_column(Double)
    lost: Mapped[bool] = mapped_column(Boolean, default=False)
    read_error: Mapped[str | None] = mapped_column(String(SHORT))
    last_seen_at: Mapped[float] = mapped_column(Double)
    bucket_start_at: Mapped[float | None] = mapped_column(Double)
    bucket_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    bucket_unattributed_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # The bucket's lowest used memory: with bucket_used_bytes (its highest) the
    # filling-up detector sees the GPU's envelope, which oscillation cannot leave.
    bucket_low_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # collected_at of the first snapshot of the current run that showed unattributed
    # memory above the threshold: one snapshot alone never opens the event.
    unattributed_since: Mapped[float | None] = mapped_column(Double)
    # Health, as the newest readable snapshot reported it (None: NVML could not say).
    ecc_uncorrected_volatile: Mapped[int | None] = mapped_column(BigInteger)
    xid_errors: Mapped[int | None] = mapped_column(BigInteger)
    xid_last_code: Mapped[int | None] = mapped_column(BigInteger)
    # Server time the Xid count last rose: Xid alerts are about new errors.
    xid_seen_at: Mapped[float | None] = mapped_column(Double)
    # Comma-separated NVML throttle reasons (a plain string: the ingest writes GPU rows
    # through the driver's executemany, without JSON type processing).
    throttle_reasons: Mapped[str | None] = mapped_column(String(SHORT))
    remap_pending: Mapped[bool | None] = mapped_column(Boolean)
    remap_failure: Mapped[bool | None] = mapped_column(Boolean)
    # Who holds memory here now, kept by every writer of the GPU's open lifetimes
    # (ingest/state.py, on flush) so the fleet page reads it with the GPU instead of
    # aggregating the fleet's open lifetimes per request: the owner of the largest
    # (ties: the oldest lifetime) and its bytes, how many open lifetimes and distinct
    # users (a NULL owner not counted).
    holder_user: Mapped[str | None] = mapped_column(String(SHORT))
    holder_bytes: Mapped[int | None] = mapped_column(BigInteger)
    holder_processes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    holder_users: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The open events on this GPU (its host's events with its index) as a mask of
    # GPU_FLAG_KINDS, kept the same way from the host's open events (ingest/state.py):
    # the fleet page's flags, read with the GPU instead of from the open events.
    open_flags: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class GpuWindow(Base):
    """A GPU's recent coarse memory samples, packed like a process's
    (processes/window.py): what the filling-up detector reads when a bucket closes.
    A table of its own for the reason ``process_windows`` is (the GPU row is updated on
    every snapshot; the window once per ``sample_interval_seconds``)."""

    __tablename__ = "gpu_windows"
    __table_args__ = rewritten_in_place("gpu_windows")

    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"), primary_key=True)
    recent_window: Mapped[bytes] = mapped_column(LargeBinary)


class GpuSample(Base):
    """Coarse per-GPU trend: one row per GPU per ``sample_interval_seconds``.

    ``t`` is the bucket start; used and unattributed are the bucket's peaks.
    """

    __tablename__ = "gpu_samples"

    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"), primary_key=True)
    t: Mapped[float] = mapped_column(Double, primary_key=True, index=True)
    used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    unattributed_bytes: Mapped[int | None] = mapped_column(BigInteger)


class GpuIndex(Base):
    """The index a GPU had from ``since`` (ingest's time) until its next row: indices
    move between boots (NVML's PCI order changes when a board is removed, replaced or
    falls off the bus), and history answers "what was on GPU 2 at 14:05" by the GPU
    that had index 2 then. Ingest writes a row when it first sees a GPU and whenever
    its index changes, so there are few. A GPU stored before the server kept this has
    one row from ``since`` 0: the index it had at the upgrade stands for its past."""

    __tablename__ = "gpu_indices"

    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"), primary_key=True)
    since: Mapped[float] = mapped_column(Double, primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer)
