"""The HostSnapshot schema: the one contract between agent, server, CLI and reaper.

One poll of one host produces one :class:`HostSnapshot`. The agent exports it as
Prometheus metrics, prints it (``gpuwatch status --json``), serves it on its local
HTTP port (``GET /snapshot``) and pushes it to the central server
(``POST /api/v1/snapshots``). Nobody else invents another shape of the same data.

Conventions:

* Sizes are bytes, durations seconds, times Unix epoch seconds (float), ratios 0..1.
* ``None`` means "not available" (NVML said NOT_SUPPORTED / NO_PERMISSION / value
  not available, or the process is not visible). It never means zero.
* The schema is strict (``extra="forbid"``) and bounded, because the server ingests
  it from the network. ``schema_version`` changes when a field changes meaning.
* Types are the published schema's, exactly: an integer is a JSON integer (or a
  number with no fractional part, ``1.0``, as JSON Schema allows), never a boolean or
  a numeric string; a number is never a boolean or a string; a boolean is ``true`` or
  ``false`` only. Pydantic's default (lax) mode would take ``true`` as 1 and ``"7"``
  as 7 (:data:`JSON_INTEGER`, ``Strict()``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Strict,
    StrictBool,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from gpuwatch.quantities import MAX_BYTES  # 1 PiB: no single GPU figure is larger

SCHEMA_VERSION = 1

# Bounds chosen well above any real host (8-16 GPUs, a few hundred processes) but low
# enough that a hostile or buggy client cannot make the server allocate without limit.
MAX_GPUS = 64
MAX_PROCESSES_PER_GPU = 1024
MAX_MIG_INSTANCES = 7
MAX_PID = 2**22  # Linux pid_max ceiling
# The server stores these in signed 64-bit (BIGINT) columns; a Linux uid is a uint32.
MAX_SEQUENCE = 2**63 - 1
MAX_UID = 2**32 - 1
# No string may hold NUL: Postgres text cannot store it, and nothing the agent reads
# from NVML or /proc contains one. Refused (422 at the server), not stripped.
NO_NUL = r"^[^\x00]*$"


class _JsonInteger:
    """Validation of an ``int`` field as the JSON Schema ``integer`` it is published as.

    Put it after the field's bounds: ``Annotated[int, Field(ge=0), JSON_INTEGER]``.
    First the value must be a number and not a boolean or a string (strict int, or
    strict float, which takes no booleans either), then it is the bounded integer
    (lax, so ``1.0`` is 1 and ``1.5`` is refused). Both steps run in pydantic-core:
    a Python validator per field would cost a third of a snapshot's validation, and
    strict checks are cheaper than lax ones. The JSON schema is the bounded integer's.
    """

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        bounded = handler(source)
        if bounded["type"] != "int":
            raise TypeError(f"JSON_INTEGER annotates an int, not {bounded['type']}")
        number = core_schema.union_schema(
            [core_schema.int_schema(strict=True), core_schema.float_schema(strict=True)],
            custom_error_type="int_type",
        )
        return core_schema.chain_schema([number, {**bounded, "strict": False}])

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        assert schema["type"] == "chain"
        return handler(schema["steps"][1])


JSON_INTEGER = _JsonInteger()

Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INTEGER]
Ratio = Annotated[float, Strict(), Field(ge=0.0, le=1.0)]
Epoch = Annotated[float, Strict(), Field(ge=0.0, le=2**33)]
# Event counters: the largest a signed 64-bit column (BIGINT) holds, as the server stores them.
Count = Annotated[int, Field(ge=0, le=2**63 - 1), JSON_INTEGER]
Hertz = Annotated[float, Strict(), Field(ge=0, le=1e11)]
Celsius = Annotated[float, Strict(), Field(ge=-100, le=300)]
# NVML's clock event ("throttle") reasons, nvmlClocksEventReason* in nvml.h, by name.
ThrottleReason = Literal[
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
]
ShortStr = Annotated[str, Field(max_length=256, pattern=NO_NUL)]
LongStr = Annotated[str, Field(max_length=4096, pattern=NO_NUL)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


class TorchAllocatorStats(_Strict):
    """PyTorch's own allocator view, reported by ``gpuwatch.torch`` inside the process."""

    allocated_bytes: Bytes
    reserved_bytes: Bytes
    reserved_unallocated_bytes: Bytes
    peak_allocated_bytes: Bytes
    reported_at: Epoch


class ProcessOwner(_Strict):
    """Who a process belongs to: Unix user, and container / Kubernetes pod / Slurm job.

    Frozen, so the agent can share one instance between its cache and every snapshot.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    user: ShortStr | None = None
    uid: Annotated[int, Field(ge=0, le=MAX_UID), JSON_INTEGER] | None = None
    container_runtime: Literal["docker", "containerd", "podman", "cri-o", "lxc"] | None = None
    container_id: ShortStr | None = None
    pod_uid: ShortStr | None = None
    pod_qos: ShortStr | None = None
    slurm_job_id: ShortStr | None = None
    systemd_unit: ShortStr | None = None
    cgroup: LongStr | None = None


class GpuProcess(_Strict):
    """One process holding a context on one GPU (nvidia-smi's bottom table)."""

    pid: Annotated[int, Field(ge=0, le=MAX_PID), JSON_INTEGER]
    kind: Literal["compute", "graphics", "mps"] = "compute"
    used_bytes: Bytes | None = None
    sm_ratio: Ratio | None = None
    # The MIG GPU instance it runs in (MigInstance.gpu_instance_id); None off MIG.
    gpu_instance_id: Annotated[int, Field(ge=0, le=2**32), JSON_INTEGER] | None = None
    # Process facts from /proc. ``visible`` is False when the agent cannot see the PID
    # (another PID namespace, e.g. the agent in a container without hostPID).
    visible: StrictBool = True
    alive: StrictBool = True
    name: ShortStr | None = None
    command: LongStr | None = None
    start_time: Epoch | None = None
    ppid: Annotated[int, Field(ge=0, le=MAX_PID), JSON_INTEGER] | None = None
    # True when the original parent is gone and the process was reparented to init
    # or a subreaper (the "training run whose shell died" case).
    orphaned: StrictBool = False
    # A Jupyter kernel (ipykernel_launcher and friends): its connection file and
    # whether the notebook server that started it is still running.
    jupyter_kernel: StrictBool = False
    jupyter_server_alive: StrictBool | None = None
    owner: ProcessOwner = Field(default_factory=ProcessOwner)
    torch: TorchAllocatorStats | None = None


# Bytes per second over PCIe: PCIe 6.0 x16 moves ~128 GB/s each way; 2**40 leaves room.
BytesPerSecond = Annotated[float, Strict(), Field(ge=0, le=2**40)]


class Profiling(_Strict):
    """Hardware activity over the time since the previous poll, from NVML's GPU
    Performance Monitoring (Hopper and later): what DCGM's profiler reports as
    ``DCGM_FI_PROF_*``. Each field is ``None`` where the driver did not answer it.

    Ratios are shares of the interval (pipes: of cycles; occupancy: of warp slots; DRAM:
    of peak bandwidth); PCIe is bytes/s, headers and payload, seen from the GPU.
    """

    graphics_ratio: Ratio | None = None  # a graphics or compute engine busy
    sm_active_ratio: Ratio | None = None  # SMs with at least one warp assigned
    sm_occupancy_ratio: Ratio | None = None  # resident warps vs the theoretical maximum
    tensor_ratio: Ratio | None = None  # any tensor pipe
    tensor_dfma_ratio: Ratio | None = None
    tensor_hmma_ratio: Ratio | None = None
    tensor_imma_ratio: Ratio | None = None
    dram_ratio: Ratio | None = None
    fp64_ratio: Ratio | None = None  # non-tensor FP64 pipes
    fp32_ratio: Ratio | None = None
    fp16_ratio: Ratio | None = None
    pcie_tx_bytes_per_second: BytesPerSecond | None = None
    pcie_rx_bytes_per_second: BytesPerSecond | None = None


# A GPU whose UUID NVML would not give, and that the agent never read before (a GPU lost
# or hung since the agent started), is named this followed by its index.
UNKNOWN_GPU_UUID_PREFIX = "GPU-unknown-"


class MigInstance(_Strict):
    """A MIG GPU instance carved out of a physical GPU."""

    index: Annotated[int, Field(ge=0, le=2**31 - 1), JSON_INTEGER]
    uuid: ShortStr
    name: ShortStr | None = None
    # NVML's GPU instance id (nvmlDeviceGetGpuInstanceId; dcgm-exporter's GPU_I_ID) and
    # profile ("3g.40gb", from the instance's name; dcgm-exporter's GPU_I_PROFILE).
    gpu_instance_id: Annotated[int, Field(ge=0, le=2**32), JSON_INTEGER] | None = None
    profile: ShortStr | None = None
    memory_total_bytes: Bytes | None = None
    memory_used_bytes: Bytes | None = None
    # Share of the time since the previous poll the instance's engines were busy (GPM's
    # GRAPHICS_UTIL, Hopper and later); None where GPM cannot say (A100, older drivers).
    # Rounded to a whole percent; ``profiling.graphics_ratio`` is the same, unrounded.
    activity_ratio: Ratio | None = None
    # The instance's GPM figures since the previous poll; None: no GPM, or the first poll.
    profiling: Profiling | None = None


class Gpu(_Strict):
    """One physical GPU, as ``nvidia-smi -q`` would describe it, plus its processes."""

    index: Annotated[int, Field(ge=0, lt=MAX_GPUS), JSON_INTEGER]
    uuid: ShortStr
    name: ShortStr | None = None
    pci_bus_id: ShortStr | None = None
    # True when NVML reported GPU_IS_LOST ("fallen off the bus"); other fields are None.
    lost: StrictBool = False
    # Set when this poll could not read the GPU at all, e.g. "timeout" when an NVML call
    # hung past the poll deadline. Fields are then None (unknown), not zero.
    read_error: ShortStr | None = None
    memory_total_bytes: Bytes | None = None
    memory_used_bytes: Bytes | None = None
    memory_free_bytes: Bytes | None = None
    memory_reserved_bytes: Bytes | None = None
    utilization_ratio: Ratio | None = None
    memory_busy_ratio: Ratio | None = None
    temperature_celsius: Celsius | None = None
    power_watts: Annotated[float, Strict(), Field(ge=0, le=100_000)] | None = None
    power_limit_watts: Annotated[float, Strict(), Field(ge=0, le=100_000)] | None = None
    # Health, each None where the board or driver does not report it (docs/metrics.md).
    # HBM temperature (nvidia-smi "Memory Current Temp").
    memory_temperature_celsius: Celsius | None = None
    # Energy since the driver loaded (nvmlDeviceGetTotalEnergyConsumption, Volta+).
    energy_joules: Annotated[float, Strict(), Field(ge=0, le=2**63 / 1000)] | None = None
    clock_sm_hertz: Hertz | None = None
    clock_memory_hertz: Hertz | None = None
    # Fan speed as a fraction of its maximum (first fan); None on passively cooled boards.
    fan_ratio: Ratio | None = None
    encoder_ratio: Ratio | None = None
    decoder_ratio: Ratio | None = None
    # Why the clocks are below their maximum now (nvidia-smi -q "Clocks Event Reasons").
    throttle_reasons: Annotated[list[ThrottleReason], Field(max_length=16)] | None = None
    # ECC error counts: volatile since the driver loaded, aggregate over the board's life.
    ecc_uncorrected_volatile: Count | None = None
    ecc_uncorrected_aggregate: Count | None = None
    ecc_corrected_volatile: Count | None = None
    ecc_corrected_aggregate: Count | None = None
    # Page retirement (before Ampere) and row remapping (Ampere and later).
    retired_pages_single_bit: Count | None = None
    retired_pages_double_bit: Count | None = None
    retired_pages_pending: StrictBool | None = None
    remapped_rows_correctable: Count | None = None
    remapped_rows_uncorrectable: Count | None = None
    remapped_rows_pending: StrictBool | None = None
    remapped_rows_failure: StrictBool | None = None
    # Xid (critical error) events since the agent started watching, and the last code.
    xid_errors: Count | None = None
    xid_last_code: Annotated[int, Field(ge=0, le=2**32), JSON_INTEGER] | None = None
    pcie_replay_errors: Count | None = None
    # The GPU's GPM figures since the previous poll; None: no GPM (before Hopper, older
    # drivers) or the first poll.
    profiling: Profiling | None = None
    # Coherent-memory GPUs (Grace Hopper) and MIG parents: "used" is not the sum of
    # processes, so the unattributed figure is masked (None).
    coherent_memory: StrictBool = False
    processes_visible: StrictBool = True
    unattributed_bytes: Bytes | None = None
    processes: Annotated[list[GpuProcess], Field(max_length=MAX_PROCESSES_PER_GPU)] = Field(
        default_factory=list
    )
    mig_instances: Annotated[list[MigInstance], Field(max_length=MAX_MIG_INSTANCES)] = Field(
        default_factory=list
    )

    @model_validator(mode="after")
    def _each_process_once(self) -> Gpu:
        # One process listed twice on one GPU (same pid, start time and kind) is one
        # stored lifetime with two contradicting readings, and its memory would be
        # counted once: refused, as a GPU listed twice is. The agent keys NVML's rows by
        # (pid, kind), so it never sends this. A pid under two kinds (a compute and a
        # graphics context) is allowed: NVML reports the same memory for both, counted
        # once, as the agent's own unattributed figure does.
        keys = {(p.pid, p.start_time, p.kind) for p in self.processes}
        if len(keys) < len(self.processes):
            raise ValueError("a process (pid, start time and kind) appears twice on one GPU")
        return self


class HostSnapshot(_Strict):
    """Everything one poll of one host saw. ``(agent_id, boot_id, sequence)`` is unique."""

    schema_version: Literal[1] = 1
    agent_id: ShortStr
    hostname: ShortStr
    boot_id: ShortStr
    sequence: Annotated[int, Field(ge=0, le=MAX_SEQUENCE), JSON_INTEGER]
    collected_at: Epoch
    poll_duration_seconds: Annotated[float, Strict(), Field(ge=0, le=3600)] = 0.0
    driver_version: ShortStr | None = None
    nvml_version: ShortStr | None = None
    cuda_driver_version: ShortStr | None = None
    # True when the agent runs in a PID namespace that hides host PIDs NVML reports.
    pid_namespace_isolated: StrictBool = False
    fake: StrictBool = False
    gpus: Annotated[list[Gpu], Field(max_length=MAX_GPUS)] = Field(default_factory=list)

    @model_validator(mode="after")
    def _each_gpu_once(self) -> HostSnapshot:
        # Two entries for one GPU would be two contradicting states of one stored row.
        if len({g.uuid for g in self.gpus}) < len(self.gpus):
            raise ValueError("a GPU uuid appears twice in one snapshot")
        if len({g.index for g in self.gpus}) < len(self.gpus):
            raise ValueError("a GPU index appears twice in one snapshot")
        return self

    @property
    def idempotency_key(self) -> tuple[str, str, int]:
        return (self.agent_id, self.boot_id, self.sequence)

    def gpu(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)
