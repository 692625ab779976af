"""Out-of-memory from other accelerators' runtimes, below any framework's allocator.

* Intel Gaudi (HPU), through the PyTorch bridge: ``RuntimeError: [Rank:0] FATAL ERROR ::
  MODULE:PT_DEVMEM Allocation failed for size::3288334336 (3136)MB``.
* Huawei Ascend (NPU), CANN's runtime: ``EL0004: Failed to allocate memory.`` (also
  ``Memory_Allocation_Failure(EL0004)``), often with ``Failed to allocate
  resource[DeviceMemory] with info [size:N]``, and torch_npu's ``... failed, error code is
  207001`` (ACL_ERROR_RT_MEMORY_ALLOCATION). torch_npu's own allocator message is PyTorch's
  wording with ``NPU``, read by :mod:`~gpuwatch.doctor.families.pytorch`.
* Graphcore (IPU), Poplar's graph compiler, which places all memory when it compiles: the
  exception types ``graph_memory_allocation_error`` and ``stream_memory_allocation_error``
  (PopART: ``'poplar_stream_memory_allocation_error': ... Out of memory. Single stream of
  length N``), and their texts ``Out of memory on tile 0: 876476 bytes used but tiles only
  have 638976 bytes of memory`` and ``Out of memory: Cannot fit all variable data onto one
  or more tiles``.
* Tenstorrent (tt-metal, under TT-NN, tt-xla or vLLM): the allocator's ``Out of Memory: Not
  enough space to allocate 117440512 B DRAM buffer across 12 banks`` (also ``L1``,
  ``L1_SMALL`` buffers: a core's SRAM), and a program's circular buffers that grow into the
  L1 buffers (``Statically allocated circular buffers ... clash with L1 buffers``, ``... grow
  to X B which is beyond max L1 size of Y B``).

* AWS Neuron (Inferentia, Trainium), the Neuron runtime (NRT) and its driver layer (TDRV):
  ``[TDRV:dmem_alloc] Failed to alloc DEVICE memory: 4194304`` (``dmem_alloc_internal`` in
  later releases), ``TDRV:log_dev_mem Failed to allocate 172.000MB (usage: tensors) on ND
  0:NC 0, current utilization: ...`` (the Neuron device's index), ``Failed to allocate
  aligned (0) buffer in MLA DRAM for W145-b of size 4194304 bytes``, ``Failed to allocate N
  bytes on DEVICE for tensor``, and the status the runtime returns for them: NRT_RESOURCE
  (4), as ``nrt_tensor_allocate status=4 message="Allocation Failure"`` (torch-neuronx,
  transformers-neuronx), ``Failure: NRT_RESOURCE in nrt_load()`` and the older neuron-rtd's
  ``NRTD response code 'NERR_RESOURCE' (4)`` (not ``NERR_RESOURCE_NC``, too few
  NeuronCores). ``Failed to alloc HOST memory`` is system RAM (kind ``host``).

None of these has a kind of its own (except Gaudi's and CANN's): they are kind ``device``,
with categories that say which.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans
from gpuwatch.doctor.units import parse_size

_HPU = re.compile(r"PT_DEVMEM\s+Allocation\s+failed\s+for\s+size::(?P<bytes>\d+)")
_CANN = re.compile(
    r"EL0004\)?:\s*(?:\[PID:[^\]]*\]\s*[\d:.\-]*\s*)?Failed\s+to\s+allocate\s+memory"
    r"|error\s+code\s+is\s+207001\b"
)
_CANN_SIZE = re.compile(r"resource\[DeviceMemory\]\s+with\s+info\s+\[size:(?P<bytes>\d+)\]")
_CANN_DEVICE = re.compile(r"Device:(?P<index>\d+)")
CANN_CONTEXT_CHARS = 1500
_POPLAR = re.compile(
    r"(?:\b|_)(?P<type>graph|stream)_memory_allocation_error\b"
    r"|Out\s+of\s+memory\s+on\s+tile\s+\d+:\s*\d+\s+bytes\s+used\s+but\s+tiles\s+only\s+have"
    r"|Out\s+of\s+memory:\s+Cannot\s+fit\s+all\s+variable\s+data\s+onto\s+one\s+or\s+more\s+tiles"
)
# The graph's memory (on the tiles' SRAM) or a host stream's buffer: which ran out.
_POPLAR_TILES = re.compile(r"on\s+tile|onto\s+one\s+or\s+more\s+tiles|graph_memory")
_POPLAR_STREAM = re.compile(r"Single\s+stream\s+of\s+length\s+(?P<bytes>\d+)")
_TT_METAL = re.compile(
    r"Out\s+of\s+Memory:\s+Not\s+enough\s+space\s+to\s+allocate\s+(?P<bytes>\d+)\s+B\s+"
    r"(?P<buffer>\w+)\s+buffer"
    r"|Statically\s+allocated\s+circular\s+buffers\s+(?:in\s+program\s+\d+\s+clash\s+with\s+L1"
    r"|on\s+core\s+range\s+\S{1,200}?\s+grow\s+to\s+\d+\s+B\s+which\s+is\s+beyond\s+max\s+L1)"
)
POPLAR_CONTEXT_CHARS = 600
# AWS Neuron: the driver layer's allocation failures (with the size), and the runtime's
# status for them, NRT_RESOURCE (4), by name or by number after an nrt_ call.
_NEURON = re.compile(
    r"Failed\s+to\s+alloc\s+(?P<where>DEVICE|HOST)\s+memory:\s*(?P<bytes>\d+)"
    r"|Failed\s+to\s+allocate\s+(?P<size>[\d.]+\s?[KMGT]i?B)\s+\(usage:\s*[\w\s]{1,40}\)\s+on\s+ND\s+(?P<nd>\d+)"
    r"|Failed\s+to\s+allocate\s+(?P<tensor>\d+)\s+bytes\s+on\s+DEVICE\b"
    r"|Failed\s+to\s+allocate\s+[^\n]{0,100}?\bin\s+MLA\s+DRAM\b[^\n]{0,120}?of\s+size\s+(?P<mla>\d+)\s+bytes"
    r"|\bnrt_\w{1,40}\s+status=4\b"
    r"|\bNRT_RESOURCE\b|'NERR_RESOURCE'"
)
# A word of each of _NEURON's branches (clauses.mentions).
_NEURON_WORDS = ("memory:", "usage:", "bytes", "mla", "nrt_", "nerr_")
# "on ND 0:NC 1": which Neuron device, anywhere in the failure's lines.
_NEURON_DEVICE = re.compile(r"\bon\s+ND\s+(?P<nd>\d+)")
NEURON_CONTEXT_CHARS = 1500


def find(window: str) -> list[Found]:
    """Every HPU and Tenstorrent allocation failure, and the first CANN, Graphcore and
    Neuron one (their lines are one failure)."""
    return _hpu_and_cann(window) + _poplar(window) + _tt_metal(window) + _neuron(window)


def _poplar(window: str) -> list[Found]:
    for span in spans(
        window, _POPLAR, limit=POPLAR_CONTEXT_CHARS, needs=("memory_allocation_error", "tile")
    )[:1]:
        begins = span.line_start
        around = window[begins : span.start + POPLAR_CONTEXT_CHARS]
        stream = _POPLAR_STREAM.search(around)
        tiles = _POPLAR_TILES.search(around) is not None and stream is None
        facts = OomFacts(
            kind="device",
            category="poplar_tile_memory_exhausted" if tiles else "poplar_memory_allocation_error",
            exception=exception_before(window, begins),
            device_type="ipu",
            requested_bytes=int(stream["bytes"]) if stream else None,
            message=window[begins : span.end].strip()[:4000],
        )
        return [Found(begins, facts)]
    return []


def _neuron(window: str) -> list[Found]:
    for span in spans(window, _NEURON, limit=NEURON_CONTEXT_CHARS, needs=_NEURON_WORDS)[:1]:
        match = _NEURON.match(window, span.start)
        assert match is not None
        begins = span.line_start
        host = match["where"] == "HOST"
        # The first size the failure's lines print (the runtime's status has none).
        sizes = _NEURON.finditer(window, span.start, span.start + NEURON_CONTEXT_CHARS)
        requested = next((size for m in sizes if (size := _neuron_size(m)) is not None), None)
        device = _NEURON_DEVICE.search(window, span.start, span.start + NEURON_CONTEXT_CHARS)
        facts = OomFacts(
            kind="host" if host else "device",
            category="neuron_host_alloc_failed" if host else "neuron_device_alloc_failed",
            exception=exception_before(window, begins),
            device_type="host" if host else "neuron",
            device_index=int(device["nd"]) if device and not host else None,
            requested_bytes=requested,
            cuda_error="NRT_RESOURCE",
            cuda_error_code=4,
            message=window[begins : span.end].strip()[:4000],
        )
        return [Found(begins, facts)]
    return []


def _neuron_size(match: re.Match[str]) -> int | None:
    """Bytes a Neuron allocation failure asked for, where its line prints them."""
    exact = match["bytes"] or match["tensor"] or match["mla"]
    if exact:
        return int(exact)
    return parse_size(match["size"]) if match["size"] else None


def _tt_metal(window: str) -> list[Found]:
    found = []
    for span in spans(window, _TT_METAL, limit=400, needs=("space", "circular")):
        match = _TT_METAL.match(window, span.start)
        assert match is not None
        buffer = (match["buffer"] or "L1").upper()
        facts = OomFacts(
            kind="device",
            category="tt_metal_dram_buffer_oom" if buffer == "DRAM" else "tt_metal_l1_oom",
            exception=exception_before(window, span.start),
            device_type="tenstorrent",
            requested_bytes=int(match["bytes"]) if match["bytes"] else None,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


def _hpu_and_cann(window: str) -> list[Found]:
    found = []
    for span in spans(window, _HPU, limit=300):
        match = _HPU.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="hpu",
            category="hpu_devmem_allocation_failed",
            exception=exception_before(window, span.start),
            device_type="hpu",
            requested_bytes=int(match["bytes"]),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    for span in spans(window, _CANN, limit=CANN_CONTEXT_CHARS)[:1]:
        around = (max(0, span.start - CANN_CONTEXT_CHARS), span.start + CANN_CONTEXT_CHARS)
        size = _CANN_SIZE.search(window, *around)
        device = _CANN_DEVICE.search(window, *around)
        facts = OomFacts(
            kind="cann",
            category="cann_memory_allocation_failure",
            device_type="npu",
            device_index=int(device["index"]) if device else None,
            requested_bytes=int(size["bytes"]) if size else None,
            cuda_error="ACL_ERROR_RT_MEMORY_ALLOCATION",
            cuda_error_code=207001,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
