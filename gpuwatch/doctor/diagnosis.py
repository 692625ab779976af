"""From figures to fixes: which remedy the numbers point at, and in what order.

Each rule looks at :class:`~gpuwatch.doctor.figures.Figures` (and, when given, the live
view of the GPU and the process's own growth history) and either stays silent or
returns a :class:`Diagnosis` with the evidence in words. Diagnoses are ordered by how
much of the card each explains; a cause that alone would have let the failed request
succeed (other processes holding more than the shortfall, or enough
reserved-but-unallocated memory to serve it) goes first. The thresholds are in
docs/doctor.md.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuwatch.doctor import remedies
from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families import accelerate, host, tensorrt
from gpuwatch.doctor.figures import ASYNC_CATEGORY, Figures
from gpuwatch.doctor.live import LiveGpu
from gpuwatch.doctor.units import GIB, MIB, format_size

Fix = Literal[
    "other_processes",
    "fragmentation",
    "reduce_activations",
    "memory_held_across_steps",
    "model_too_large",
    "kv_cache",
    "memory_limit",
    "unknown",
]

OTHERS_MIN_SHARE = 0.10  # neighbours below a tenth of the card are not the story
DECISIVE_OTHERS_SHARE = 0.25
FRAGMENTATION_MIN_SHARE = 0.25  # of PyTorch's reserve sitting unallocated
FRAGMENTATION_MIN_BYTES = 256 * MIB
DOMINANT_SHARE = 0.5  # this process's tensors hold at least half the card
LARGE_REQUEST_SHARE = 0.25  # one allocation of a quarter of the card is an activation
# ... or, for llama.cpp, its weights: on a card of unknown size, one buffer this large is.
GGML_WEIGHTS_SIZED_BYTES = 16 * GIB
GROWTH_MIN_RATIO = 0.10  # allocated grew by a tenth across the history ...
GROWTH_MIN_BYTES = 256 * MIB  # ... and by at least this much
DECISIVE = 1.0  # score bonus: this cause alone would have let the request succeed
# Free memory covers a request when it exceeds it by this much: a card with just the
# request free is full (the driver rounds allocations up and keeps some for itself).
FREE_COVER_MARGIN_BYTES = 64 * MIB
ROOMY_FREE_RATIO = 2  # free this many times the request: the card did not run out
LIMIT_MIN_SCORE = 0.05
PADDING_MIN_SHARE = 0.25  # a TPU program's padding worth reshaping for, of what it needs
POOL_MIN_SHARE = 0.5  # CuPy's pool holding half the card is the story, not one request
# Just below or above other_processes' score for the same bytes: which of the two the
# async backend's unreported memory more likely is (see _async_pool).
ASYNC_POOL_TIE = 0.01


class Diagnosis(BaseModel):
    """One likely cause, the numbers behind it, and what to run or change."""

    model_config = ConfigDict(extra="forbid")

    fix: Fix
    summary: str
    evidence: str
    commands: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class Context:
    """Everything a rule may look at."""

    facts: OomFacts
    figures: Figures
    live: LiveGpu | None
    growth: Sequence[int] | None  # PyTorch allocated bytes per report, oldest first

    @property
    def capacity(self) -> int | None:
        """What this process could have: the card, or a smaller per-process cap."""
        caps = [c for c in (self.figures.total, self.figures.limit) if c]
        if not caps and self.live is not None and self.live.memory_total_bytes:
            caps = [self.live.memory_total_bytes]  # messages without sizes: the card seen live
        return min(caps) if caps else None

    @property
    def capacity_name(self) -> str:
        """How to call :attr:`capacity` in evidence: the card, or the cap."""
        total, capacity = self.figures.total, self.capacity
        if capacity is not None and (total is None or capacity < total):
            return f"the {format_size(capacity)} limit"
        return "the card"


Rule = Callable[[Context], tuple[float, Diagnosis] | None]


def diagnose(
    facts: OomFacts,
    figures: Figures,
    *,
    live: LiveGpu | None = None,
    growth: Sequence[int] | None = None,
) -> list[Diagnosis]:
    """Likely causes of ``facts``, most explanatory first; never empty."""
    context = Context(facts, figures, live, growth)
    scored = [result for rule in _RULES if (result := rule(context)) is not None]
    scored.sort(key=lambda item: item[0], reverse=True)
    diagnoses = [diagnosis for _, diagnosis in scored]
    if _wants_unknown(facts, diagnoses):
        diagnoses.append(_unknown(context))
    return diagnoses


def _wants_unknown(facts: OomFacts, diagnoses: list[Diagnosis]) -> bool:
    """Whether the general "look at ..." diagnosis joins ``diagnoses``: where nothing else
    was found, or where the message has no sizes and only says where memory ran out (not
    where it named what did not fit, with the card's figures)."""
    if any(d.fix == "unknown" for d in diagnoses):
        return False  # a rule already said what to look at
    if not diagnoses:
        return True
    # A program that did not compile had no memory yet: nobody else held any of it.
    if facts.category == tensorrt.EXECUTOR_CATEGORY or facts.phase == "compile":
        return False
    return (
        facts.kind in remedies.UNKNOWN_BY_KIND
        or facts.category in remedies.UNKNOWN_BY_CATEGORY
        or facts.category == "conv_workspace_insufficient"
    )


def _share(part: int | None, whole: int | None) -> float:
    return part / whole if part is not None and whole else 0.0


def _pct(part: int, whole: int) -> str:
    return f"{part / whole:.0%}"


def _other_processes(ctx: Context) -> tuple[float, Diagnosis] | None:
    fig, capacity = ctx.figures, ctx.capacity
    live_others = _live_others_bytes(ctx)
    held = fig.others_bytes if fig.others_bytes is not None else live_others
    if held is None or not capacity or held < OTHERS_MIN_SHARE * capacity:
        return None
    if fig.others_bytes is not None and not fig.starved:
        return None
    # Decisive: freeing them alone would have served the request, and they hold a
    # real share of the card (not just a desktop's few hundred MiB).
    decisive = (
        bool(fig.shortfall)
        and held >= (fig.shortfall or 0)
        and held >= DECISIVE_OTHERS_SHARE * capacity
    )
    summary = "Other processes hold the memory: stop the ones you own, or use another GPU"
    if fig.others_bytes is not None and ctx.facts.category == ASYNC_CATEGORY:
        # cudaMallocAsync prints only this process's tensors: the rest may be its own pool.
        summary = (
            "Other processes, or this process's own cudaMallocAsync pool, hold the memory: "
            "check who holds the GPU before anything else"
        )
        evidence = (
            f"{format_size(held)} ({_pct(held, capacity)}) of the {format_size(capacity)} card "
            f"is neither free nor held by this process's tensors "
            f"({format_size(fig.allocated or 0)}): other processes hold it, or the async "
            "pool's cached and fragmented memory, which its message does not report"
        )
        if fig.free is not None and fig.requested is not None:
            evidence += (
                f"; {format_size(fig.free)} was free for a {format_size(fig.requested)} request"
            )
    elif fig.others_bytes is None:
        evidence = (
            f"right now other processes hold {format_size(held)} of this GPU's "
            f"{format_size(capacity)} (live view from the local agent)"
        )
    else:
        how = "about " if fig.others_estimated else ""
        ours = f"this process: {format_size(fig.this_process)}" if fig.this_process else ""
        if not ours and fig.reserved is not None:
            ours = f"PyTorch here reserved {format_size(fig.reserved)}"
        evidence = (
            f"other processes hold {how}{format_size(held)} ({_pct(held, capacity)}) of the "
            f"{format_size(capacity)} card" + (f" ({ours})" if ours else "")
        )
        if fig.free is not None and fig.requested is not None:
            evidence += (
                f"; {format_size(fig.free)} was free for a {format_size(fig.requested)} request"
            )
    return (
        _share(held, capacity) + (DECISIVE if decisive else 0.0),
        Diagnosis(
            fix="other_processes",
            summary=summary,
            evidence=evidence,
            commands=_holder_commands(ctx),
        ),
    )


def _live_others_bytes(ctx: Context) -> int | None:
    if ctx.live is None:
        return None
    held = [p.used_bytes or 0 for p in ctx.live.processes if not p.probably_this_process]
    return sum(held) if held else None


def _holder_commands(ctx: Context) -> list[str]:
    capacity = ctx.capacity or GIB
    live, fig = ctx.live, ctx.figures
    if live is not None and (live.processes or fig.others):
        # The view now, not the message's list: its PIDs may have exited since.
        commands = remedies.reap_commands(live, min_bytes=int(0.01 * capacity))
        commands += _absent_holders(ctx)
        return commands if live.processes else commands + remedies.holders_of(ctx.facts.device_type)
    listed = [
        f"kill {p.pid}   # {format_size(p.used_bytes)} per the message; check first, "
        "the PID may be from another PID namespace"
        for p in fig.others
        if p.used_bytes >= 0.01 * capacity and p.pid not in fig.self_candidates
    ]
    return listed + remedies.holders_of(ctx.facts.device_type)


def _absent_holders(ctx: Context) -> list[str]:
    """A line for each process the message blames that the live view no longer has."""
    assert ctx.live is not None
    sizes = {p.pid: p.used_bytes for p in ctx.figures.others}
    return [
        f"# pid {pid} ({format_size(sizes[pid])} per the message) is not on this GPU now: it "
        "has exited since (or runs in a PID namespace the agent does not see)"
        for pid in ctx.live.absent_message_pids
        if pid in sizes
    ]


def _fragmentation(ctx: Context) -> tuple[float, Diagnosis] | None:
    fig = ctx.figures
    unallocated, requested = fig.reserved_unallocated, fig.requested
    if (
        unallocated is None
        or requested is None
        or ctx.facts.kind not in ("pytorch_allocator", "hip")
    ):
        return None
    if _free_covered(fig):
        # cudaMalloc would have served the request from free memory without touching the
        # cache: whatever failed, splitting the cached blocks was not it.
        return None
    pool = (fig.allocated or 0) + unallocated
    large = unallocated >= requested or (
        unallocated >= FRAGMENTATION_MIN_BYTES and unallocated >= FRAGMENTATION_MIN_SHARE * pool
    )
    if not large:
        return None
    usable = unallocated + (fig.free or 0)
    decisive = usable >= requested and unallocated >= OTHERS_MIN_SHARE * (ctx.capacity or math.inf)
    evidence = (
        f"PyTorch holds {format_size(unallocated)} reserved but unallocated "
        f"({_pct(unallocated, pool) if pool else '-'} of its cache) and could not find "
        f"{format_size(requested)} in one piece"
    )
    summary = "Fragmentation: let the allocator grow segments instead of splitting them"
    if usable >= requested:
        evidence += f"; that plus free memory ({format_size(usable)}) would have served it"
    else:
        # Even a cache with no holes would not have served this request.
        evidence += (
            f"; but that plus free memory ({format_size(usable)}) is less than the "
            f"{format_size(requested)} request, so defragmenting alone would not have served it"
        )
        summary = (
            "Fragmentation helps, but is not enough alone: also make the working set smaller "
            "(or free the card)"
        )
    # The parenthesised wording dates a PyTorch build before 2.1; out-of-tree devices
    # (torch_npu) still print it with expandable segments available.
    legacy = ctx.facts.category.startswith("pytorch_caching_allocator_oom_v1") and (
        ctx.facts.device_type in ("cuda", "hip")
    )
    return (
        _share(unallocated, ctx.capacity) + (DECISIVE if decisive else 0.0),
        Diagnosis(
            fix="fragmentation",
            summary=summary,
            evidence=evidence,
            commands=remedies.fragmentation(
                ctx.facts.alloc_conf_var,
                legacy=legacy,
                # A message that names expandable_segments is from PyTorch >= 2.1.
                modern=ctx.facts.advice == "expandable_segments",
            ),
        ),
    )


# PyTorch allocators whose "allowed" is set_per_process_memory_fraction's cap, checked
# against the whole reserve before the card is asked for anything.
_FRACTION_KINDS = {"pytorch_allocator": "cuda", "hip": "cuda", "xpu": "xpu"}


def _memory_fraction(ctx: Context) -> tuple[float, Diagnosis] | None:
    """PyTorch refused the request against its per-process cap: what it had reserved plus
    the request is over the ``allowed`` figure, whatever the card had free."""
    facts, fig = ctx.facts, ctx.figures
    limit, reserved, requested = fig.limit, fig.reserved, fig.requested
    module = _FRACTION_KINDS.get(facts.kind)
    if module is None or limit is None or reserved is None or requested is None:
        return None
    if fig.total is not None and limit >= fig.total:
        return None  # no cap below the card
    needed = reserved + requested
    if needed <= limit:
        return None
    evidence = (
        f"PyTorch's per-process limit is {format_size(limit)}; it had reserved "
        f"{format_size(reserved)}, and that plus the {format_size(requested)} request is "
        f"{format_size(needed)}, over the limit: the allocator refused before asking the card"
    )
    if fig.free is not None:
        evidence += f", which had {format_size(fig.free)} free"
    return (
        2.0 + _share(needed, ctx.capacity),
        Diagnosis(
            fix="memory_limit",
            summary="A per-process memory limit (set_per_process_memory_fraction) refused it: "
            "raise or remove the limit",
            evidence=evidence,
            commands=remedies.memory_fraction(module, needed, fig.total, fig.free),
        ),
    )


def _per_allocation_limit(ctx: Context) -> tuple[float, Diagnosis] | None:
    """One allocation over a cap on a single block (IPEX's 4 GiB on Intel GPUs without
    large-allocation support, Metal's maximum buffer): refused whatever was free, so no
    amount of freeing memory helps; the block must be smaller, or the cap lifted."""
    facts, fig = ctx.facts, ctx.figures
    cap, requested = facts.per_allocation_limit_bytes, fig.requested
    if cap is None or requested is None or requested <= cap:
        return None
    evidence = (
        f"one allocation of {format_size(requested)}, over the {format_size(cap)} this "
        "platform allows in one block: it is refused whatever is free"
    )
    held = fig.reserved if fig.reserved is not None else fig.allocated
    if fig.total and held is not None and held + requested <= fig.total:
        evidence += (
            f"; PyTorch held {format_size(held)} of the {format_size(fig.total)} card, so "
            "the card had room: it did not run out"
        )
    summary = {
        "xpu": "One allocation is over the Intel GPU's 4 GiB single-block limit: split the "
        "tensor, or enable large allocations",
        "metal": "One buffer is larger than Metal allows on this GPU: split it",
    }.get(facts.kind, "One allocation is over a cap on a single block: split it")
    return (
        2.0 + _share(requested, ctx.capacity),
        Diagnosis(
            fix="memory_limit",
            summary=summary,
            evidence=evidence,
            commands=remedies.PER_ALLOCATION_LIMIT_BY_KIND.get(
                facts.kind, remedies.PER_ALLOCATION_LIMIT_DEFAULT
            ),
        ),
    )


def _async_pool(ctx: Context) -> tuple[float, Diagnosis] | None:
    """cudaMallocAsync's message says what this process's tensors hold, not what its pool
    holds: memory neither free nor in tensors is other processes' or the pool's cached and
    fragmented memory. Offered beside other_processes; the live view, where it shows
    who else is on the GPU, says which is likelier."""
    fig = ctx.figures
    unaccounted, capacity = fig.others_bytes, ctx.capacity
    if ctx.facts.category != ASYNC_CATEGORY or unaccounted is None or not capacity:
        return None
    if unaccounted < OTHERS_MIN_SHARE * capacity or not fig.starved:
        return None
    decisive = bool(fig.shortfall) and unaccounted >= (fig.shortfall or 0)
    live_others = _live_others_bytes(ctx)
    # The live view shows others holding less than half of it: the pool is likelier.
    pool_likelier = ctx.live is not None and (live_others or 0) < unaccounted / 2
    evidence = (
        f"{format_size(unaccounted)} ({_pct(unaccounted, capacity)}) of the card is neither "
        f"free nor in this process's tensors ({format_size(fig.allocated or 0)}); "
        "cudaMallocAsync keeps freed blocks in its pool, and its message does not count them"
    )
    if ctx.live is not None:
        evidence += f"; right now other processes hold {format_size(live_others or 0)} (live view)"
    if decisive:
        evidence += (
            f": that alone is more than the {format_size(fig.shortfall or 0)} the request lacked"
        )
    score = _share(unaccounted, capacity) + (DECISIVE if decisive else 0.0)
    return (
        score + (ASYNC_POOL_TIE if pool_likelier else -ASYNC_POOL_TIE),
        Diagnosis(
            fix="fragmentation",
            summary="cudaMallocAsync's pool may hold the rest: trim it, or use the native "
            "allocator with expandable segments",
            evidence=evidence,
            commands=remedies.ASYNC_POOL,
        ),
    )


def _cupy_pool(ctx: Context) -> tuple[float, Diagnosis] | None:
    """CuPy's message says what its pool already holds: when that is most of the card (or
    many times the request, the card's size unknown), the pool is the story, not the one
    allocation: cached blocks to free, or arrays kept alive."""
    facts, fig, capacity = ctx.facts, ctx.figures, ctx.capacity
    pool = fig.reserved if fig.reserved is not None else fig.allocated
    if facts.kind != "cupy" or pool is None or fig.requested is None or pool < fig.requested:
        return None
    if capacity and pool < POOL_MIN_SHARE * capacity:
        return None
    share = f" ({_pct(pool, capacity)} of {ctx.capacity_name})" if capacity else ""
    evidence = (
        f"CuPy's memory pool already holds {format_size(pool)}{share}, in use and cached, "
        f"and could not add {format_size(fig.requested)}: what the pool holds, not the one "
        + (
            "allocation, is what filled the card"
            if capacity
            else "allocation, is the likelier story"
        )
    )
    return (
        max(_share(pool, capacity), DOMINANT_SHARE),
        Diagnosis(
            fix="memory_held_across_steps",
            summary="CuPy's memory pool holds most of the memory: free its cached blocks, cap "
            "it, and look for arrays kept alive",
            evidence=evidence,
            commands=remedies.CUPY_POOL,
        ),
    )


def _mps_other_allocations(ctx: Context) -> tuple[float, Diagnosis] | None:
    """MPS's "other allocations" is Metal memory this process holds outside PyTorch's MPS
    allocator; when it holds more of the limit than PyTorch's tensors do, shrinking the
    batch is not the fix."""
    facts, fig, capacity = ctx.facts, ctx.figures, ctx.capacity
    other = facts.other_allocations_bytes
    if facts.kind != "mps" or other is None or not capacity:
        return None
    if other < (fig.allocated or 0) or other < LARGE_REQUEST_SHARE * capacity:
        return None
    evidence = (
        f"other allocations (Metal memory this process holds outside PyTorch's MPS "
        f"allocator: MPSGraph's and other libraries' buffers) take {format_size(other)} "
        f"({_pct(other, capacity)} of {ctx.capacity_name}); PyTorch's tensors "
        f"{format_size(fig.allocated or 0)}"
    )
    return (
        _share(other, capacity),
        Diagnosis(
            fix="memory_limit",
            summary="Memory outside PyTorch's tensors fills the MPS limit: free or offload "
            "it before cutting the batch",
            evidence=evidence,
            commands=remedies.MPS_OTHER_ALLOCATIONS,
        ),
    )


def _cap_refused(fig: Figures) -> bool:
    """Whether a printed per-process cap explains the failure (see _memory_fraction)."""
    if fig.limit is None or fig.reserved is None or fig.requested is None:
        return False
    return fig.reserved + fig.requested > fig.limit and (fig.total is None or fig.limit < fig.total)


# Kinds whose messages name the limit that ran out, apart from the card's free memory.
_OWN_LIMITS = {"hami", "catboost", "mindspore", "vllm_kv_cache", "tgi", "tensorrt"}


def _limit_not_card(ctx: Context) -> tuple[float, Diagnosis] | None:
    """Free memory covered the request and the allocation still failed: a limit other
    than the card's free memory refused it, whatever else the figures say."""
    facts, fig = ctx.facts, ctx.figures
    if not _free_covered(fig) or facts.device_type in ("host", "cpu"):
        return None
    if facts.category in remedies.UNKNOWN_BY_CATEGORY or facts.kind in _OWN_LIMITS:
        return None  # the wording names the limit itself (a pool's cap, a pod's share)
    if facts.kind in _FRACTION_KINDS and _cap_refused(fig):
        return None  # the printed cap is the cause (_memory_fraction)
    evidence = (
        f"{format_size(fig.free or 0)} was free for a {format_size(fig.requested or 0)} "
        f"request and it still failed, so {remedies.FREE_COVERED_CAUSES}"
    )
    # Free many times the request leaves nothing else to blame; a request nearly as large
    # as what was free is itself the likelier story (one allocation over a per-allocation
    # cap, the weights of a model), so the rules for it go first.
    roomy = (fig.free or 0) >= ROOMY_FREE_RATIO * (fig.requested or 0)
    return (
        DECISIVE if roomy else LIMIT_MIN_SCORE,
        Diagnosis(
            fix="unknown",
            summary="Free memory covered the request: look at what limits this process, not "
            "at the card's free memory",
            evidence=evidence,
            commands=[
                *remedies.free_covered(facts.device_type),
                *remedies.find_holders(facts.device_type, facts.category, facts.kind),
            ],
        ),
    )


def _free_covered(fig: Figures) -> bool:
    """Whether the card's free memory alone, as printed, covered the request with room to
    spare (and the free figure is a share of the total, not an APU's whole pool)."""
    free, requested = fig.free, fig.requested
    if free is None or requested is None or free < requested + FREE_COVER_MARGIN_BYTES:
        return False
    return fig.total is None or free <= fig.total


_LOADING = ("model load", "model weights")
_ACTIVATION_CATEGORIES = {
    "tensorflow_oom_allocating_tensor",
    "tensorflow_stream_executor_alloc_failed",
    "xla_resource_exhausted",
    "ggml_cuda_alloc_failed",
    "ggml_metal_alloc_failed",
    "cudnn_no_algorithm_oom",
    "pytorch_mps_oom",
    "cupy_oom",
    "paddle_out_of_memory",
    "paddle_enforce_allocating",
    "onnxruntime_arena_alloc_failed",
    "tgi_warmup_prefill_tokens",
    "tgi_warmup_total_tokens",
}


def _reduce_activations(ctx: Context) -> tuple[float, Diagnosis] | None:
    fig, facts, capacity = ctx.figures, ctx.facts, ctx.capacity
    if facts.kind == "vllm_kv_cache" or facts.phase in _LOADING:
        return None
    tensor = tensor_bytes(facts.tensor_shape, facts.dtype)
    requested = fig.requested if fig.requested is not None else tensor
    held = fig.allocated if fig.allocated is not None else fig.this_process
    if facts.device_type == "host":
        held = None  # system RAM a process held (the OOM killer's anon-rss), not the GPU's
    dominant = bool(held is not None and capacity and held >= DOMINANT_SHARE * capacity)
    big_request = bool(
        requested is not None and capacity and requested >= LARGE_REQUEST_SHARE * capacity
    )
    # These report an activation (a tensor, a compute buffer) that did not fit.
    activation = facts.category in _ACTIVATION_CATEGORIES
    if not (dominant or big_request or activation):
        return None
    parts = []
    if held and capacity:
        parts.append(
            f"this process's tensors hold {format_size(held)} "
            f"({_pct(held, capacity)} of {ctx.capacity_name})"
        )
    if requested is not None:
        what = f"one allocation of {format_size(requested)}"
        if facts.category == "xla_tpu_memory_space_exhausted":
            # XLA's "Used X of Y hbm" at compile time: the program's whole footprint.
            what = f"the compiled program needs {format_size(requested)} in all"
        elif tensor is not None and fig.requested is None:
            what = f"one tensor {facts.tensor_shape} {facts.dtype} = {format_size(tensor)}"
        if capacity and requested > capacity:
            what += f", larger than the whole {format_size(capacity)}: no setting fits it, the shape must shrink"
        elif capacity:
            what += f" ({_pct(requested, capacity)} of {ctx.capacity_name})"
        parts.append(what)
    if facts.kind == "tgi" and facts.kv_cache_tokens is not None:
        parts.append(
            f"the start-up warm-up could not fit a batch of {facts.kv_cache_tokens} total tokens "
            f"(with a {facts.prefill_tokens}-token prefill) beside the weights"
        )
    elif facts.prefill_tokens is not None:
        parts.append(f"the start-up warm-up could not run a {facts.prefill_tokens}-token prefill")
    if facts.kind == "mps" and facts.other_allocations_bytes:
        share = f" ({_pct(facts.other_allocations_bytes, capacity)})" if capacity else ""
        parts.append(
            f"other allocations (outside PyTorch's tensors) {format_size(facts.other_allocations_bytes)}{share}"
        )
    score = max(_share(held, capacity), _share(requested, capacity), 0.05)
    if facts.kind == "ggml" and facts.phase is None and _weights_sized(requested, capacity):
        return score, _ggml_weights_sized(facts, parts)
    return (
        score,
        Diagnosis(
            fix="reduce_activations",
            summary=_HOST_SUMMARY
            if _on_the_host(facts)
            else _ACTIVATION_SUMMARIES.get(facts.kind, _ACTIVATION_SUMMARY),
            evidence="; ".join(parts) or "the allocation that failed was an activation",
            commands=_activation_commands(facts),
        ),
    )


def _ggml_weights_sized(facts: OomFacts, parts: list[str]) -> Diagnosis:
    """A llama.cpp buffer the size of weights, where the log does not say what it held."""
    evidence = "; ".join(
        [
            *parts,
            "a buffer that size holds the model's weights (or a long context's KV cache), "
            "not one batch's compute buffers",
        ]
    )
    return Diagnosis(
        fix="model_too_large",
        summary="llama.cpp's buffer is the size of a model's weights: offload fewer layers "
        "(-ngl), or a smaller quantisation or context",
        evidence=evidence,
        commands=_GGML_WEIGHTS + _activation_commands(facts),
    )


def _weights_sized(requested: int | None, capacity: int | None) -> bool:
    """Whether one llama.cpp buffer is as large as weights are: a quarter of the card, or
    (the card not known) more than any batch's compute buffers take."""
    if requested is None:
        return False
    if capacity:
        return requested >= LARGE_REQUEST_SHARE * capacity
    return requested >= GGML_WEIGHTS_SIZED_BYTES


_ACTIVATION_SUMMARY = (
    "This process's own working set is too big: smaller batch or sequence, bf16, gradient "
    "checkpointing"
)
# Where the framework has its own words for it: llama.cpp only runs inference, on weights
# already quantised, so bf16 and gradient checkpointing mean nothing there.
_ACTIVATION_SUMMARIES = {
    "cupy": "CuPy's working set is too big: a smaller batch, the arrays in chunks, or a "
    "smaller dtype",
    "ggml": "llama.cpp's buffers do not fit on the GPU: offload fewer layers (-ngl), or a "
    "smaller context, batch or quantisation",
}
_GGML_WEIGHTS = ["llama.cpp: offload fewer layers (-ngl N), or a smaller quantisation (Q4_K_M)"]
# A framework's CPU device (TensorFlow's device:CPU:0, Paddle's CPU place): system RAM.
_HOST_SUMMARY = (
    "This process's working set is too big for system RAM (the tensor was on the CPU, not a "
    "GPU): smaller batch, or check it ran where you meant"
)


def _on_the_host(facts: OomFacts) -> bool:
    return facts.device_type in ("cpu", "host")


# What makes the working set smaller, where the framework has its own way to say it.
_ACTIVATION_COMMANDS: dict[str, list[str]] = {
    "ggml": [
        "llama.cpp: lower the context (-c) and batch (-b / -ub), or offload fewer layers (-ngl)"
    ],
    "xla": [
        "export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX preallocates 75% of the GPU",
        "reduce the batch, or shard it (jax.sharding) across devices",
    ],
    "mps": remedies.reduce_activations("mps"),  # PyTorch on Apple silicon
    "tensorflow": [
        "tf.config.experimental.set_memory_growth(gpu, True)   # TF grabs the whole GPU otherwise",
        "reduce the batch size",
    ],
    "paddle": remedies.PADDLE,
    "cupy": remedies.CUPY_WORKING_SET,
    "metal": remedies.METAL_WORKING_SET,  # MLX, llama.cpp's Metal backend: not torch
    "mindspore": remedies.MINDSPORE,
    "catboost": remedies.CATBOOST,
    "onnxruntime": remedies.ONNXRUNTIME_ARENA,
}


def _activation_commands(facts: OomFacts) -> list[str]:
    if facts.kind == "tgi":  # the only one whose commands carry the message's figure
        return remedies.tgi_warmup(facts.prefill_tokens, facts.kv_cache_tokens)
    if facts.kind == "xla" and facts.device_type == "tpu":  # no GPU preallocation there
        return remedies.UNKNOWN_COMMANDS_BY_CATEGORY["xla_tpu_memory_space_exhausted"]
    if _on_the_host(facts):
        # Every framework that names a CPU device: its GPU switches (memory growth,
        # preallocation, empty_cache) do nothing for system RAM.
        return remedies.HOST_WORKING_SET
    if facts.kind in _ACTIVATION_COMMANDS:
        return _ACTIVATION_COMMANDS[facts.kind]
    # PyTorch's own advice names the device the tensors are on (autocast's device_type).
    return remedies.reduce_activations(remedies.autocast_device(facts.device_type))


_TENSOR_ITEM_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
    "bfloat16": 2, "int32": 4, "int64": 8, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


def tensor_bytes(shape: str | None, dtype: str | None) -> int | None:
    """Bytes of a TensorFlow tensor ``[500,17,17,4032]`` of ``float``, or ``None``."""
    if shape is None or dtype is None or dtype not in _TENSOR_ITEM_BYTES:
        return None
    dims = [int(d) for d in re.findall(r"\d+", shape)]
    return math.prod(dims) * _TENSOR_ITEM_BYTES[dtype] if dims else None


def _held_across_steps(ctx: Context) -> tuple[float, Diagnosis] | None:
    growth = list(ctx.growth or [])
    if len(growth) < 3:
        return None
    first, last = growth[0], growth[-1]
    rising = sum(1 for a, b in itertools.pairwise(growth) if b >= a)
    if last - first < max(GROWTH_MIN_BYTES, GROWTH_MIN_RATIO * max(first, 1)):
        return None
    if rising < 0.8 * (len(growth) - 1):
        return None  # a sawtooth peaking higher is not a steady climb
    evidence = (
        f"PyTorch's allocated memory climbed from {format_size(first)} to {format_size(last)} "
        f"over the last {len(growth)} reports, rising in {rising} of {len(growth) - 1} intervals"
    )
    return (
        _share(last - first, ctx.capacity) + 0.5,
        Diagnosis(
            fix="memory_held_across_steps",
            summary="Memory grows step after step: something keeps tensors (and their graphs) alive",
            evidence=evidence,
            commands=remedies.held_across_steps(remedies.autocast_device(ctx.facts.device_type)),
        ),
    )


def _model_too_large(ctx: Context) -> tuple[float, Diagnosis] | None:
    fig, facts, capacity = ctx.figures, ctx.facts, ctx.capacity
    if facts.category == accelerate.CATEGORY:
        return _no_batch_fits()
    if facts.phase not in _LOADING:
        return None
    loaded = (fig.allocated or 0) + (fig.requested or 0)
    if loaded == 0:
        evidence = "the failure happened while the model was being loaded onto the GPU"
    else:
        evidence = (
            f"while loading the model: {format_size(loaded)} needed so far (loaded + requested)"
        )
        if capacity:
            evidence += f" on a {format_size(capacity)} card"
    return (
        _share(loaded, capacity) + 0.2,
        Diagnosis(
            fix="model_too_large",
            summary="The weights do not fit: quantise, offload, or use a bigger GPU",
            evidence=evidence,
            commands=_weights_commands(facts, loaded, capacity),
        ),
    )


def _no_batch_fits() -> tuple[float, Diagnosis]:
    """Accelerate halved the batch down to zero: not even one sample fits."""
    return (
        2.0,
        Diagnosis(
            fix="model_too_large",
            summary="Not even a batch of 1 fits: the model and its training state are too "
            "large for this GPU (or others hold it)",
            evidence="Accelerate's find_executable_batch_size halved the batch after every "
            "out-of-memory error down to zero: every batch size ran out, so the batch is not "
            "what is too large",
            commands=[
                "gpuwatch fit --params N --mode full   # weights, gradients and optimizer state "
                "against this GPU (--mode lora / qlora for adapters)",
                *remedies.WEIGHTS_UNSIZED,
                "model.gradient_checkpointing_enable(); bf16; an 8-bit optimizer (bitsandbytes "
                "AdamW8bit); LoRA instead of full fine-tuning",
                *remedies.FIND_HOLDERS,
            ],
        ),
    )


def _weights_commands(facts: OomFacts, loaded: int, capacity: int | None) -> list[str]:
    if facts.kind == "ggml" and facts.device_type == "host":
        return [
            "llama.cpp: keep mmap on (drop --no-mmap), offload more layers to the GPU (-ngl N), "
            "or a smaller quantisation (Q4_K_M)"
        ]
    if facts.kind == "ggml":
        return _GGML_WEIGHTS
    if not loaded:
        # No sizes to do the arithmetic with: the ways to smaller weights, and who else
        # holds the device (any vendor's tool where the message names none).
        holders = remedies.UNKNOWN_COMMANDS_BY_CATEGORY.get(facts.category)
        return [*remedies.WEIGHTS_UNSIZED, *(holders or remedies.holders_of(facts.device_type))]
    return remedies.model_too_large(loaded, capacity)


def _kv_cache(ctx: Context) -> tuple[float, Diagnosis] | None:
    facts = ctx.facts
    if facts.kind != "vllm_kv_cache":
        return None
    commands: list[str]
    if facts.category == "vllm_startup_free_memory_low":
        return _vllm_startup(ctx)
    if facts.category == "vllm_sampler_warmup_oom":
        fewer = max(1, (facts.dummy_requests or 256) // 4)
        evidence = (
            f"the sampler warm-up with {facts.dummy_requests} dummy requests ran out of memory"
        )
        commands = [
            f"vllm serve MODEL --max-num-seqs {fewer}",
            "vllm serve MODEL --gpu-memory-utilization 0.85",
        ]
    else:
        fits = facts.estimated_max_model_len or facts.kv_cache_tokens
        evidence = _kv_evidence(facts)
        commands = []
        if fits:
            commands.append(f"vllm serve MODEL --max-model-len {fits}   # what the cache holds now")
        commands += [
            "vllm serve MODEL --gpu-memory-utilization 0.95   # only if nothing else shares the GPU",
            "vllm serve MODEL --tensor-parallel-size 2   # or a quantised / smaller model",
        ]
    return (
        2.0,
        Diagnosis(
            fix="kv_cache",
            summary="vLLM's KV cache does not fit: shorter max_model_len or more memory for vLLM",
            evidence=evidence,
            commands=commands,
        ),
    )


def _vllm_startup(ctx: Context) -> tuple[float, Diagnosis]:
    fig = ctx.figures
    free, total, wanted = fig.free, fig.total, fig.limit
    commands = list(remedies.FIND_HOLDERS)
    evidence = "vLLM found less free memory at start-up than gpu_memory_utilization asks for"
    if free is not None and total and wanted is not None:
        evidence = (
            f"{format_size(free)} of {format_size(total)} was free at start-up; "
            f"gpu_memory_utilization asks for {format_size(wanted)}: something else holds "
            f"{format_size(max(0, total - free))}"
        )
        # Two points below what is free, floored: the profile run needs a little slack.
        fits = math.floor(free / total * 100 - 2) / 100
        if fits > 0:
            commands.append(f"vllm serve MODEL --gpu-memory-utilization {fits:.2f}")
    return (
        2.0,
        Diagnosis(
            fix="other_processes",
            summary="Another process holds part of the GPU vLLM wants: free it, or ask vLLM for less",
            evidence=evidence,
            commands=commands,
        ),
    )


def _kv_evidence(facts: OomFacts) -> str:
    """What the message's figures say about the KV cache; never more than they say."""
    needed, available = facts.kv_cache_needed_bytes, facts.kv_cache_available_bytes
    sequence = (
        f"one {facts.max_model_len}-token sequence" if facts.max_model_len else "one sequence"
    )
    if needed is not None and available is not None:
        evidence = f"{sequence} needs {format_size(needed)} of KV cache; {format_size(available)} is available"
    elif available:
        # The needed size was not read: say only what was.
        evidence = f"{sequence} needs more KV cache than the {format_size(available)} available"
    elif facts.max_model_len is not None and facts.kv_cache_tokens is not None:
        evidence = f"max_model_len is {facts.max_model_len} tokens; the KV cache holds {facts.kv_cache_tokens}"
    elif facts.category == "vllm_v1_kv_cache_insufficient":
        evidence = f"the KV cache cannot hold {sequence}"
    else:
        return "after loading the weights and profiling, no memory was left for KV-cache blocks"
    if facts.estimated_max_model_len:
        evidence += f"; vLLM estimates that {facts.estimated_max_model_len} tokens fit"
    return evidence


# What the TensorRT-LLM executor's component that did not fit (lower case) makes the fix;
# its temporary buffers and the rest of it are a working set.
_EXECUTOR_FIXES: dict[str, tuple[Fix, str]] = {
    "kv cache": (
        "kv_cache",
        "TensorRT-LLM's KV cache did not fit: give it a smaller share of the free memory, "
        "or shard the model",
    ),
    "model": ("model_too_large", "The weights do not fit: shard them over more GPUs, or quantise"),
    "draft model for speculative decoding": (
        "model_too_large",
        "The draft model's weights do not fit beside the model: shard, or quantise",
    ),
}
_EXECUTOR_WORKING_SET: tuple[Fix, str] = (
    "reduce_activations",
    "TensorRT-LLM's working buffers did not fit: fewer tokens per batch (max_num_tokens) "
    "or a shorter max_seq_len",
)


# The message cut before the line that names the component.
_EXECUTOR_UNNAMED: tuple[Fix, str] = (
    "unknown",
    "TensorRT-LLM's executor did not fit: the line after its message names the component "
    "that failed, and so the setting to lower",
)


def _tensorrt_llm_executor(ctx: Context) -> tuple[float, Diagnosis] | None:
    """TensorRT-LLM's executor names the component it could not create and what was free."""
    facts, fig = ctx.facts, ctx.figures
    if facts.category != tensorrt.EXECUTOR_CATEGORY:
        return None
    if facts.phase is None:
        fix, summary = _EXECUTOR_UNNAMED
    else:
        fix, summary = _EXECUTOR_FIXES.get(facts.phase, _EXECUTOR_WORKING_SET)
    what = f"its executor's {facts.phase}" if facts.phase else "one of its executor's components"
    evidence = f"TensorRT-LLM could not create {what}"
    if fig.free is not None and fig.total:
        evidence += (
            f" with {format_size(fig.free)} of the {format_size(fig.total)} card free before "
            f"it; the model and the components created before it hold "
            f"{format_size(max(0, fig.total - fig.free))}, other processes included"
        )
    return (
        2.0,
        Diagnosis(
            fix=fix,
            summary=summary,
            evidence=evidence,
            commands=remedies.tensorrt_llm_executor(facts.phase),
        ),
    )


def _tile_padding(ctx: Context) -> tuple[float, Diagnosis] | None:
    """XLA on a TPU pads a tensor's two minor dimensions to the chip's tiles (8 x 128): a
    small minor dimension multiplies its size, and reshaping it, not the batch, is the fix."""
    facts, fig = ctx.facts, ctx.figures
    padding, needed = facts.padding_bytes, fig.requested
    if padding is None or needed is None:
        return None
    over = needed - fig.total if fig.total is not None else None
    if padding < PADDING_MIN_SHARE * needed and (over is None or padding < over):
        return None
    evidence = (
        f"of the {format_size(needed)} the compiled program needs, its largest allocation "
        f"alone has {format_size(padding)} of padding: the TPU lays a tensor's two minor "
        "dimensions out in tiles of 8 x 128, so a small minor dimension is padded up to them"
    )
    if over is not None and over > 0 and padding >= over:
        evidence += f"; without it the program would fit ({format_size(over)} over)"
    return (
        _share(padding, ctx.capacity) + (DECISIVE if over is not None and padding >= over else 0.0),
        Diagnosis(
            fix="reduce_activations",
            summary="XLA pads a tensor to the TPU's tiles: reshape it so its small dimensions "
            "are not the last two, before cutting the batch",
            evidence=evidence,
            commands=remedies.TPU_TILE_PADDING,
        ),
    )


def _nvenc(ctx: Context) -> tuple[float, Diagnosis] | None:
    """NVENC's NV_ENC_ERR_OUT_OF_MEMORY: first the session cap, which returns the same
    status on GeForce cards, then video memory."""
    if ctx.facts.kind != "nvenc":
        return None
    call = f" ({ctx.facts.api_call})" if ctx.facts.api_call else ""
    evidence = (
        f"NVENC returned NV_ENC_ERR_OUT_OF_MEMORY (10){call}. On GeForce cards the driver caps "
        "how many encode sessions may be open at once and returns this same status for one "
        "more, with video memory to spare; only with fewer sessions open than that is video "
        "memory the likely cause"
    )
    return (
        2.0,
        Diagnosis(
            fix="other_processes",
            summary="Count the open NVENC sessions before freeing video memory: other encoders "
            "may hold the sessions the driver allows",
            evidence=evidence,
            commands=remedies.NVENC_SESSIONS,
        ),
    )


def _unknown(ctx: Context) -> Diagnosis:
    facts, fig = ctx.facts, ctx.figures
    evidence = remedies.UNKNOWN_BY_KIND.get(
        facts.kind, "the message has too few numbers to tell the cause"
    )
    # The card's own figures, where the message printed them, say more than the kind's
    # general text (which, for a raw CUDA error, is written for a message without them).
    if fig.free is not None and fig.total and fig.starved:
        evidence = (
            f"the card was full ({format_size(fig.free)} free of {format_size(fig.total)}) but the "
            "message does not say who holds the rest"
        )
    look_at = remedies.UNKNOWN_LOOK_AT_BY_CATEGORY.get(
        facts.category,
        "what holds system RAM" if facts.device_type in ("host", "cpu") else "who holds the GPU",
    )
    commands = remedies.UNKNOWN_COMMANDS_BY_CATEGORY.get(facts.category) or remedies.find_holders(
        facts.device_type, facts.category, facts.kind
    )
    if facts.category in remedies.UNKNOWN_BY_CATEGORY:
        evidence = remedies.UNKNOWN_BY_CATEGORY[facts.category]
    if (
        facts.category == "ollama_system_memory"
        and facts.requested_bytes is not None
        and facts.free_bytes is not None
    ):
        evidence = (
            f"Ollama needs {format_size(facts.requested_bytes)} of system RAM for this model "
            f"(the layers not offloaded to a GPU, and its context) and "
            f"{format_size(facts.free_bytes)} was free: other programs, or models Ollama keeps "
            "loaded, hold the rest"
        )
    elif facts.category in ("linux_oom_killer", "cgroup_oom_killer"):
        evidence = _oom_killer_evidence(facts, evidence)
    elif facts.category == "hami_pod_limit" and facts.would_use_bytes and facts.allowed_bytes:
        evidence = (
            f"HAMi limits this pod to {format_size(facts.allowed_bytes)} of the GPU "
            f"(nvidia.com/gpumem); this allocation would have taken it to "
            f"{format_size(facts.would_use_bytes)}: the pod's share ran out, not the card"
        )
    elif facts.category == "conv_workspace_insufficient":
        evidence = (
            f"the convolution needs a {format_size(facts.workspace_required_bytes or 0)} workspace, "
            f"{format_size(facts.workspace_given_bytes or 0)} was allowed: raise the op's workspace"
        )
    return Diagnosis(
        fix="unknown",
        summary=f"Not enough numbers to pick a fix: look at {look_at}",
        evidence=evidence,
        commands=commands,
    )


def _oom_killer_evidence(facts: OomFacts, general: str) -> str:
    """Who the kernel killed and what it held in RAM, then the general text."""
    name = host.killed_process(facts.message)
    who = " ".join(
        part for part in (name, f"(pid {facts.pid})" if facts.pid is not None else None) if part
    )
    if not who:
        return general
    held = (
        f", which held {format_size(facts.process_in_use_bytes)} of RAM (anon-rss)"
        if facts.process_in_use_bytes is not None
        else ""
    )
    return f"the kernel killed {who}{held}; {general}"


_RULES: tuple[Rule, ...] = (
    _per_allocation_limit,
    _memory_fraction,
    _async_pool,
    _cupy_pool,
    _mps_other_allocations,
    _limit_not_card,
    _other_processes,
    _fragmentation,
    _reduce_activations,
    _held_across_steps,
    _model_too_large,
    _kv_cache,
    _tensorrt_llm_executor,
    _tile_padding,
    _nvenc,
)
