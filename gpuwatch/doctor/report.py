"""Plain-text rendering of an :class:`~gpuwatch.doctor.explain.Explanation` for people.

Concise on purpose: what failed and the figures, then each diagnosis with its evidence
and the exact commands, then who is on that GPU right now. No colour codes, so it reads
the same in a terminal, a log file and a notebook's stderr.

Every line goes through :func:`~gpuwatch.terminal_text.printable`: the live section
quotes other users' command lines and names (through :mod:`~gpuwatch.doctor.remedies`'
descriptions too), and a control character in them must neither reach the terminal
nor start a line of advice of its own. It shows as an escape (``\\n``, ``\\x1b``).
"""

from __future__ import annotations

from gpuwatch.doctor import remedies
from gpuwatch.doctor.explain import Explanation
from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families import accelerate
from gpuwatch.doctor.figures import read_figures
from gpuwatch.doctor.units import format_size
from gpuwatch.terminal_text import printable

_TITLES = {
    "pytorch_allocator": "PyTorch CUDA allocator",
    "hip": "PyTorch ROCm (HIP) allocator",
    "xpu": "PyTorch XPU allocator",
    "mps": "PyTorch MPS (Apple)",
    "metal": "Apple Metal",
    "driver": "CUDA runtime/driver",
    "cublas": "cuBLAS",
    "cudnn": "cuDNN",
    "nccl": "NCCL",
    "bitsandbytes": "bitsandbytes",
    "cupy": "CuPy memory pool",
    "ggml": "llama.cpp (ggml)",
    "xla": "XLA",
    "tensorflow": "TensorFlow",
    "paddle": "PaddlePaddle allocator",
    "onnxruntime": "ONNX Runtime memory arena",
    "tensorrt": "TensorRT",
    "cuda_library": "CUDA library",
    "tgi": "TGI warm-up",
    "hami": "HAMi pod GPU share",
    "vulkan": "Vulkan driver",
    "directml": "DirectML",
    "opencl": "OpenCL runtime",
    "hpu": "Intel Gaudi runtime",
    "cann": "Ascend CANN runtime",
    "catboost": "CatBoost GPU memory pool",
    "exllama": "ExLlamaV2 loader",
    "mindspore": "MindSpore device memory pool",
    "device": "device memory (a wording gpuwatch has no family for)",
    "host": "host memory (not the GPU)",
    "vllm_kv_cache": "vLLM start-up",
    "nvenc": "NVENC video encoder",
}
# Kind ``device`` is also what families of their own report for accelerators, APIs and
# servers that have no kind of theirs: their category's prefix names them.
_DEVICE_TITLES = {
    "poplar_": "Graphcore Poplar",
    "tt_metal_": "Tenstorrent tt-metal",
    "neuron_": "AWS Neuron runtime",
    "sycl_": "SYCL / Level Zero runtime",
    "nvidia_opengl_": "OpenGL (NVIDIA driver)",
    "opengl_": "OpenGL",
    "wgpu_": "wgpu",
    "sglang_": "SGLang",
}


def render(explanation: Explanation) -> str:
    """The human report; ends with a newline. Each of its lines is one line of text
    from the explanation, with any control or invisible format character in it
    escaped."""
    lines = [_headline(explanation), *_figures(explanation)]
    for number, diagnosis in enumerate(explanation.diagnoses, start=1):
        lines.append("")
        lines.append(f"{number}. [{diagnosis.fix}] {diagnosis.summary}")
        lines.append(f"   evidence: {diagnosis.evidence}")
        lines.extend(_command_line(command) for command in diagnosis.commands)
    lines.extend(_later_messages(explanation))
    lines.extend(_live(explanation))
    lines.extend(_history(explanation))
    if explanation.notes:
        lines.append("")
        lines.extend(f"note: {note}" for note in explanation.notes)
    return "\n".join(printable(line) for line in lines) + "\n"


# Remedies that are shell commands get a "$ " prompt; code and advice do not.
_SHELL_PROGRAMS = (
    "export ",
    "gpuwatch ",
    "kill ",
    "nvidia-smi",
    "vllm ",
    "CUDA_LAUNCH_BLOCKING",
    "docker ",
    "df ",
    "sudo ",
    "free ",
    "ps ",
    "rocm-smi",
    "npu-smi",
    "hl-smi",
    "trtexec ",
    "text-generation-launcher ",
    "kubectl ",
)


def _command_line(command: str) -> str:
    return f"   $ {command}" if command.startswith(_SHELL_PROGRAMS) else f"   {command}"


def _headline(explanation: Explanation) -> str:
    where = f" on {explanation.device}" if explanation.device else ""
    what = _TITLES.get(explanation.kind or "", explanation.kind or "unknown")
    device_type = explanation.device_type
    if explanation.kind == "pytorch_allocator" and device_type not in (None, "cuda"):
        # An out-of-tree device's copy of the allocator (Ascend NPU, MUSA, ...).
        what = f"PyTorch {device_type.upper()} allocator"
    elif explanation.kind == "driver" and device_type == "hip":
        what = "HIP runtime (ROCm)"
    elif explanation.category == accelerate.CATEGORY:
        what = "Hugging Face Accelerate's batch-size search"
    elif explanation.kind == "device":
        category = explanation.category or ""
        what = next((t for p, t in _DEVICE_TITLES.items() if category.startswith(p)), what)
    raised = f" ({explanation.exception})" if explanation.exception else ""
    return f"Out of memory{where}: {what}{raised}"


# Categories whose "requested" is a compiled program's whole footprint, not one request.
_PROGRAM_TOTALS = {"xla_tpu_memory_space_exhausted", "xla_compile_aborted_not_enough_memory"}


def _figures(explanation: Explanation) -> list[str]:
    def size(value: int | None) -> str | None:
        return None if value is None else format_size(value)

    first = []
    if explanation.requested_bytes is not None:
        label = "program needs" if explanation.category in _PROGRAM_TOTALS else "requested"
        first.append(f"{label} {size(explanation.requested_bytes)}")
    if explanation.free_bytes is not None:
        of_total = (
            f" of {size(explanation.total_bytes)}" if explanation.total_bytes is not None else ""
        )
        first.append(f"free {size(explanation.free_bytes)}{of_total}")
    elif explanation.total_bytes is not None:
        first.append(f"total {size(explanation.total_bytes)}")
    if explanation.allowed_bytes is not None:
        first.append(f"limit {size(explanation.allowed_bytes)}")
    second = []
    if explanation.process_in_use_bytes is not None:
        second.append(f"this process {size(explanation.process_in_use_bytes)}")
    if explanation.allocated_bytes is not None:
        second.append(f"allocated {size(explanation.allocated_bytes)}")
    if explanation.reserved_unallocated_bytes is not None:
        second.append(f"reserved but unallocated {size(explanation.reserved_unallocated_bytes)}")
    elif explanation.reserved_bytes is not None:
        # A pool's whole size without its split (CuPy's "total"): what it holds all told.
        label = "pool holds" if explanation.kind == "cupy" else "reserved"
        second.append(f"{label} {size(explanation.reserved_bytes)}")
    printed = explanation.printed
    if printed is not None and printed.other_allocations_bytes is not None:
        # MPS: Metal memory this process holds outside PyTorch's allocator.
        second.append(f"other allocations {size(printed.other_allocations_bytes)}")
    if printed is not None and printed.per_allocation_limit_bytes is not None:
        first.append(f"one-allocation cap {size(printed.per_allocation_limit_bytes)}")
    lines = [f"  {'   '.join(part)}" for part in (first, second) if part]
    if explanation.other_processes:
        listed = ", ".join(
            f"{p.pid} {format_size(p.used_bytes)}{' (this process?)' if p.probably_this_process else ''}"
            for p in explanation.other_processes
        )
        lines.append(f"  processes in the message: {listed}")
    return lines


# Later messages listed one per line; past this, only how many more.
MAX_LATER_LINES = 5


def _later_messages(explanation: Explanation) -> list[str]:
    """The OOM messages after the one explained: a caught OOM (a batch-size probe) often
    comes first, and the one that ended the run last."""
    later = explanation.printed.additional_messages if explanation.printed else []
    if not later:
        return []
    count = f"{len(later)} more OOM message{'s' if len(later) > 1 else ''}"
    lines = [
        "",
        f"{count} later in the text (the last is usually the one that ended the run: "
        "explain it alone, or see printed.additional_messages in --json):",
    ]
    lines.extend(f"  - {_one_line(facts)}" for facts in later[:MAX_LATER_LINES])
    if len(later) > MAX_LATER_LINES:
        lines.append(f"  - and {len(later) - MAX_LATER_LINES} more")
    return lines


def _one_line(facts: OomFacts) -> str:
    """One later message in a line: where, what, and the figures that tell it apart."""
    figures = read_figures(facts)
    parts = [f"{facts.device or 'no device named'}: {_TITLES.get(facts.kind, facts.kind)}"]
    if figures.requested is not None:
        parts.append(f"{format_size(figures.requested)} request")
    if figures.free is not None:
        of = f" of {format_size(figures.total)}" if figures.total is not None else ""
        parts.append(f"{format_size(figures.free)} free{of}")
    if figures.others_bytes:
        parts.append(f"other processes {format_size(figures.others_bytes)}")
    return ", ".join(parts)


def _live(explanation: Explanation) -> list[str]:
    live = explanation.live
    if live is None:
        return []
    name = f" ({live.name})" if live.name else ""
    where = f"GPU {live.index}{name}"
    if live.mig_profile:
        where += f", MIG instance {live.mig_profile}"
    lines = ["", f"Right now on {live.hostname}, {where}:"]
    if not live.processes:
        lines.append("  no processes")
    lines.extend(
        f"  {remedies.describe(p)}{'  <- probably the process that printed this' if p.probably_this_process else ''}"
        for p in live.processes
    )
    if live.absent_message_pids:
        gone = ", ".join(str(pid) for pid in live.absent_message_pids)
        lines.append(f"  gone since the message: pid {gone} (exited, or in another PID namespace)")
    lines.append("  (idle time needs the agent's history: SM share is for this instant)")
    return lines


def _history(explanation: Explanation) -> list[str]:
    if explanation.history is None:
        return []
    if not explanation.history:
        return ["", "In the last hour the gpuwatch server recorded nothing on this GPU."]
    lines = ["", "In the last hour on this GPU (gpuwatch server):"]
    for event in explanation.history:
        state = "still open" if event.ended_at is None else "ended"
        lines.append(f"  - {event.kind}/{event.reason}: {event.summary} ({state})")
    return lines
