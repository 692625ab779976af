"""The exact commands and code changes each fix recommends (docs/doctor.md explains them).

Kept apart from the rules in :mod:`gpuwatch.doctor.diagnosis` so the wording can be
reviewed in one place, and so the rules read as arithmetic.
"""

from __future__ import annotations

from gpuwatch.doctor.live import LiveGpu, LiveProcess
from gpuwatch.doctor.units import format_size

FIND_HOLDERS = [
    "gpuwatch status",
    "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv",
]


def fragmentation(alloc_conf_var: str | None, *, legacy: bool) -> list[str]:
    """Allocator settings; ``legacy``: a pre-2.1 PyTorch without expandable segments."""
    var = alloc_conf_var or "PYTORCH_CUDA_ALLOC_CONF"
    if legacy:
        return [
            f"export {var}=max_split_size_mb:128   # before python starts",
            "# or upgrade to PyTorch >= 2.1 and use expandable_segments:True",
        ]
    return [
        f"export {var}=expandable_segments:True   # before python starts",
        f"# PyTorch < 2.1: export {var}=max_split_size_mb:128",
    ]


REDUCE_ACTIVATIONS = [
    "halve the batch and keep the effective batch: loss = loss / accum_steps; "
    "optimizer.step() every accum_steps batches",
    "cap sequence length (tokenizer max_length / truncation): attention activations grow with it",
    'train in bf16: with torch.autocast(device_type="cuda", dtype=torch.bfloat16): ...',
    "model.gradient_checkpointing_enable()   # or torch.utils.checkpoint(block, x, use_reentrant=False)",
    "for evaluation: model.eval(); with torch.inference_mode(): ...",
]

HELD_ACROSS_STEPS = [
    "total_loss += loss.item()   # not `+= loss`: that keeps every step's graph alive",
    "outputs.append(logits.detach().cpu())   # not the GPU tensor with its graph",
    "with torch.inference_mode(): ...   # around every evaluation loop",
    "del outputs, loss; gc.collect(); torch.cuda.empty_cache()   # in notebooks: restart the kernel",
]


def model_too_large(needed_bytes: int, capacity_bytes: int | None) -> list[str]:
    """Options when the weights alone do not fit, with the arithmetic for 16-bit weights."""
    params_billions = needed_bytes / 2 / 1e9  # 2 bytes per parameter in bf16/fp16
    commands = [
        f"# ~{format_size(needed_bytes)} at 16-bit is ~{params_billions:.1f}B parameters: "
        f"int8 needs ~{format_size(needed_bytes // 2)}, 4-bit ~{format_size(needed_bytes // 4)}",
        "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)   # quantise",
        'from_pretrained(..., device_map="auto", max_memory={0: "20GiB", "cpu": "64GiB"})   # offload',
    ]
    gpu = f" --gpu {format_size(capacity_bytes).replace(' ', '')}" if capacity_bytes else ""
    commands.append(
        f"gpuwatch fit --params {params_billions:.1f}B --dtype bf16{gpu}   # full breakdown"
    )
    return commands


def describe(process: LiveProcess) -> str:
    """``pid 4242 alice python train.py: 12.00 GiB, SM 0% now, running 3h05m``."""
    parts = [f"pid {process.pid}"]
    if process.user:
        parts.append(process.user)
    what = process.command or process.name
    if what:
        parts.append(what if len(what) <= 60 else what[:57] + "...")
    figures = []
    if process.used_bytes is not None:
        figures.append(format_size(process.used_bytes))
    if process.sm_ratio is not None:
        figures.append(f"SM {process.sm_ratio:.0%} now")
    if process.running_seconds is not None:
        figures.append(f"running {_duration(process.running_seconds)}")
    if process.jupyter_kernel:
        figures.append("Jupyter kernel")
    if process.orphaned:
        figures.append("orphaned")
    return " ".join(parts) + (": " + ", ".join(figures) if figures else "")


def reap_commands(live: LiveGpu, *, min_bytes: int, skip_pid: int | None = None) -> list[str]:
    """``gpuwatch reap`` / ``kill`` lines for each live holder of at least ``min_bytes``."""
    commands = []
    for process in live.processes:
        if process.pid == skip_pid or (process.used_bytes or 0) < min_bytes:
            continue
        commands.append(f"# {describe(process)}")
        commands.append(f"gpuwatch reap --pid {process.pid}   # or: kill {process.pid}")
    return commands


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"
