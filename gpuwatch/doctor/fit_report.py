"""``gpuwatch fit`` end to end: options in, a breakdown and verdict per GPU out.

:attr:`FitReport.verdict` is the answer a script wants (docs/doctor.md): ``fits`` when
the model fits with room on at least one of the GPUs asked about, ``tight`` when it
fits only tightly (on the best of them), ``does_not_fit`` when it fits on none, ``unknown`` when it fits on none for sure and on
some only for some model shapes. The CLI maps it to an exit code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, get_args

from gpuwatch.doctor.architecture import Architecture, load_hf_config, parse_param_count
from gpuwatch.doctor.fit import (
    DEFAULT_LORA_RANK,
    FITS_HEADROOM,
    Breakdown,
    Dtype,
    KvDtype,
    KvSplit,
    Mode,
    Option,
    Verdict,
    Workload,
    as_stored,
    breakdown_verdict,
    component_name,
    deciding_part,
    estimate,
    fits,
    normalise_dtype,
    options,
    parallel_option,
    validate,
    verdict,
)
from gpuwatch.doctor.gpus import (
    GpuTarget,
    catalogue_target,
    larger_mig_profile,
    local_targets,
    smallest_fitting,
)
from gpuwatch.doctor.live import agent_url_problem, fetch_local_snapshot
from gpuwatch.doctor.units import format_size
from gpuwatch.errors import ConfigError, RemoteError
from gpuwatch.terminal_text import printable


@dataclass(frozen=True)
class GpuFit:
    """The verdict on one GPU, and the changes that would make it fit."""

    target: GpuTarget
    verdict: Verdict
    headroom_ratio: float
    fits_free_now: bool | None
    options: list[Option]
    bigger_gpu: str | None
    # Splitting over more GPUs (this host's identical cards, or up to a node's 8 when
    # the request already splits): the fewest that fit, or the most and still too big.
    parallel: Option | None = None
    # "fits" or "tight" in what is free now, with the verdict's headroom; None off-host.
    free_now: Verdict | None = None


@dataclass(frozen=True)
class FitReport:
    """What ``gpuwatch fit`` prints."""

    workload: Workload
    breakdown: Breakdown
    gpus: list[GpuFit]
    # Where the dtype came from when no --dtype was given and the config's
    # quantization_config chose it (e.g. "gptq, 4-bit"); None otherwise.
    dtype_source: str | None = None

    @property
    def verdict(self) -> Verdict:
        """The best GPU's verdict: ``fits``, then ``tight``, then ``unknown`` (it may fit
        on one), else ``does_not_fit``."""
        results = {gpu.verdict for gpu in self.gpus}
        for best in ("fits", "tight", "unknown"):
            if best in results:
                return cast(Verdict, best)
        return "does_not_fit"

    @property
    def unknown_because(self) -> str | None:
        """The missing input and the part it decides, when the verdict is ``unknown``."""
        if self.verdict != "unknown":
            return None
        part = deciding_part(self.breakdown) or "activations"
        low, high = self.breakdown.spread.get(part, (0, 0))
        return (
            f"it depends on the model's shape, which --params does not give: the "
            f"{component_name(part)} alone is {format_size(low)} to {format_size(high)} over "
            "typical shapes; pass --config config.json"
        )

    def to_json(self) -> dict[str, Any]:
        arch = self.workload.arch
        return {
            "verdict": self.verdict,
            "unknown_because": self.unknown_because,
            "model": {
                "name": arch.name,
                "params": arch.params,
                "encoder_params": arch.encoder_params,
            },
            "dtype": self.workload.dtype,
            "dtype_source": self.dtype_source,
            "mode": self.workload.mode,
            "context": self.workload.context,
            "batch": self.workload.batch,
            "gpus_per_model": self.workload.gpus,
            "gradient_checkpointing": (
                None if self.workload.mode == "inference" else self.workload.checkpointing
            ),
            "lora_rank": (
                self.workload.lora_rank if self.workload.mode in ("lora", "qlora") else None
            ),
            "kv_cache_dtype": self._kv_cache_dtype_json(),
            "kv_cache_bytes_per_token": self.breakdown.kv_per_token,
            "kv_cache": self._kv_cache_json(),
            "unquantised": self._unquantised_json(),
            "breakdown": self.breakdown.as_dict(),
            "estimated": self.breakdown.estimated,
            "spread": {part: list(ends) for part, ends in self.breakdown.spread.items()},
            "notes": self.breakdown.notes,
            "gpus": [
                {
                    "name": g.target.name,
                    "total_bytes": g.target.total_bytes,
                    "free_bytes": g.target.free_bytes,
                    "verdict": g.verdict,
                    "headroom_ratio": round(g.headroom_ratio, 4),
                    "fits_free_now": g.fits_free_now,
                    "free_now_verdict": g.free_now,
                    "options": [
                        {
                            "change": o.change,
                            "total_bytes": o.total_bytes,
                            "total_high_bytes": o.high_bytes,
                        }
                        for o in g.options
                    ],
                    "bigger_gpu": g.bigger_gpu,
                    "parallel": _parallel_json(g.parallel),
                }
                for g in self.gpus
            ],
        }

    def _kv_cache_dtype_json(self) -> str | None:
        """The KV cache's element type as counted (``None`` when training: no cache)."""
        w = self.workload
        if w.mode != "inference":
            return None
        return w.kv_cache_dtype or ("fp32" if w.dtype == "fp32" else "16-bit")

    def _kv_cache_json(self) -> dict[str, Any] | None:
        """The KV cache by kind of layer (inference with a shape; else ``None``), and
        why a window the config names was not applied, if one was not."""
        split = self.breakdown.kv_split
        if split is None or self.workload.mode != "inference":
            return None
        return {**split.as_dict(), "window_not_applied": self.workload.arch.window_unread}

    def _unquantised_json(self) -> dict[str, Any] | None:
        """What a checkpoint quantised in part keeps unquantised, when weighed as stored."""
        arch, dtype = self.workload.arch, self.workload.dtype
        if not as_stored(arch, dtype) or not (
            arch.kept_unquantised or arch.unplaced_unquantised or arch.stored_bits
        ):
            return None
        return {
            "groups": list(arch.kept_unquantised),
            "params": arch.kept_params + arch.embedding_params,
            "unplaced": list(arch.unplaced_unquantised),
            "quantised_bits": arch.stored_bits,
        }

    def render(self) -> str:
        w, b = self.workload, self.breakdown
        encoders = w.arch.encoder_params
        # A vision or audio tower loads with the language model: say it is counted.
        counted = f" ({encoders / 1e9:.2f}B of them its encoders)" if encoders else ""
        stored = f" (as the config stores it: {self.dtype_source})" if self.dtype_source else ""
        title = (
            f"{w.arch.name or 'model'}: {w.arch.params / 1e9:.2f}B parameters{counted},"
            f" {w.dtype}{stored}, {w.mode}"
        )
        lines = [f"{title}, context {w.context} x batch {w.batch}{_setup(w)}"]
        rows = [
            ("weights", "weights", b.weights),
            ("KV cache", "kv_cache", b.kv_cache),
            ("gradients", "gradients", b.gradients),
            ("optimizer state", "optimizer", b.optimizer),
            ("activations (estimate)", "activations", b.activations),
            ("CUDA context + framework", "overhead", b.overhead),
        ]
        for label, part, value in rows:
            if (value == 0 and part in ("gradients", "optimizer")) or (
                part == "kv_cache" and w.mode != "inference"
            ):
                continue
            lines.append(_row(label, value, b.spread.get(part)))
            if part == "kv_cache" and b.kv_split is not None and b.kv_split.sliding_layers:
                lines.extend(_kv_rows(b.kv_split, w.context))
            if part == "kv_cache" and b.kv_split is not None and b.kv_split.state_bytes:
                # Linear-attention layers keep a fixed state instead of a cache.
                stateful = (w.arch.layers or 0) - b.kv_split.full_layers - b.kv_split.sliding_layers
                label = f"  {stateful} linear-attention state"
                lines.append(_row(label, b.kv_split.state_bytes, None))
        total_range = None
        if b.low_total is not None and b.high_total is not None:
            total_range = (b.low_total, b.high_total)
        lines.append(_row("total", b.total, total_range))
        for gpu in self.gpus:
            lines.append("")
            lines.append(_verdict_line(gpu, b, w))
            if gpu.parallel is not None and gpu.parallel.fits:
                lines.append(f"  makes it fit: {_option_text(gpu.parallel)}")
            lines.extend(f"  makes it fit: {_option_text(o)}" for o in gpu.options)
            if gpu.verdict == "fits":
                continue
            if gpu.bigger_gpu and gpu.bigger_gpu.startswith("a larger MIG"):
                lines.append(f"  makes it fit: {gpu.bigger_gpu}")
            elif gpu.bigger_gpu:
                lines.append(f"  makes it fit: a bigger GPU ({gpu.bigger_gpu})")
            elif not gpu.options and (gpu.parallel is None or not gpu.parallel.fits):
                lines.append(f"  no single GPU or setting here fits it: {_sharding(w)}")
            if gpu.parallel is not None and not gpu.parallel.fits:
                lines.append(f"  still does NOT fit: {_option_text(gpu.parallel)}")
        if self.unknown_because:
            lines.append("")
            lines.append(f"cannot tell: {self.unknown_because}")
        lines.extend(f"note: {note}" for note in b.notes)
        # A model's name is its folder's, a GPU's the agent's: text from outside, shown
        # with any control character escaped (as explain's report is).
        return "\n".join(printable(line) for line in lines) + "\n"


def _parallel_json(option: Option | None) -> dict[str, Any] | None:
    if option is None:
        return None
    return {
        "change": option.change,
        "total_bytes": option.total_bytes,
        "total_high_bytes": option.high_bytes,
        "fits": option.fits,
    }


def _kv_rows(split: KvSplit, context: int) -> list[str]:
    """The KV cache's full-attention and sliding-window layers, and what it would be if
    every layer held the whole context."""
    window = split.window or 0
    held = min(context, window)
    rows = []
    if split.full_layers:
        label = f"  {split.full_layers} full-attention layers"
        rows.append(_row(label, split.full_layers_bytes, None))
    kind, span = ("chunked", "chunk") if split.chunked else ("sliding", "window")
    label = f"  {split.sliding_layers} {kind} ({span} {window})"
    rows.append(_row(label, split.sliding_layers_bytes, None))
    if held < context:
        rows.append(
            f"    ({kind} layers hold {held:,} of {context:,} tokens; every layer at the full"
            f" context would be {format_size(split.full_context_bytes)})"
        )
    else:
        rows.append(f"    (context {context:,} is within the {window:,}-token {span}: no saving)")
    return rows


def _option_text(option: Option) -> str:
    text = f"{option.change} -> {format_size(option.total_bytes)}"
    if option.high_bytes is not None and option.high_bytes != option.total_bytes:
        text += f" (up to {format_size(option.high_bytes)} over typical shapes)"
    return text


def _sharding(workload: Workload) -> str:
    """Split the model over several GPUs: tensor parallelism to serve it, sharded data
    parallelism (weights, gradients and optimizer state) to train it."""
    if workload.mode == "inference":
        return "split it across GPUs with tensor parallelism (e.g. vLLM --tensor-parallel-size)"
    return "shard across GPUs (FSDP, ZeRO-3)"


def _row(label: str, value: int | None, spread: tuple[int, int] | None) -> str:
    shown = format_size(value) if value is not None else "-"
    line = f"  {label:<26}{shown:>14}"
    if spread is not None:
        line += f"   (range {format_size(spread[0])} - {format_size(spread[1])})"
    return line


def _setup(workload: Workload) -> str:
    """What the title says of the setup beyond the workload: the split over GPUs, and for
    LoRA its rank."""
    parts = []
    if workload.mode in ("lora", "qlora"):
        parts.append(f"LoRA rank {workload.lora_rank}")
    if workload.kv_cache_dtype is not None:
        parts.append(f"{workload.kv_cache_dtype} KV cache")
    if workload.gpus > 1:
        how = "tensor parallel" if workload.mode == "inference" else "FSDP/ZeRO-3"
        parts.append(f"{how} over {workload.gpus} GPUs: figures per GPU")
    return "".join(f", {part}" for part in parts)


def _verdict_line(gpu: GpuFit, breakdown: Breakdown, workload: Workload) -> str:
    card, total = gpu.target.total_bytes, breakdown.total
    name = f"{gpu.target.name} ({format_size(card)})"
    if workload.gpus > 1:
        name = f"{workload.gpus} x {gpu.target.name} ({format_size(card)} each)"
    if gpu.verdict == "does_not_fit" and total > card:
        # A negative "headroom" reads as nonsense: say how far over the card it is.
        line = (
            f"{name}: does NOT fit: needs {format_size(total)}, {total / card:.1f}x the card "
            f"({format_size(total - card)} over)"
        )
    elif gpu.verdict == "unknown":
        low, high = breakdown.low_total or total, breakdown.high_total or total
        line = (
            f"{name}: cannot tell: needs {format_size(low)} to {format_size(high)} "
            f"depending on the model's shape (want >= {FITS_HEADROOM:.0%} headroom)"
        )
    else:
        word = {"fits": "fits", "tight": "fits, but tight", "does_not_fit": "does NOT fit"}[
            gpu.verdict
        ]
        line = f"{name}: {word} ({gpu.headroom_ratio:.0%} headroom; want >= {FITS_HEADROOM:.0%})"
    if gpu.free_now is not None:
        line += {
            "fits": "; fits in what is free now",
            "tight": "; fits, but tight, in what is free now",
        }.get(gpu.free_now, "; NOT in what is free now (with the same headroom)")
    if workload.mode != "inference":
        # The exit code rests on it: say which way activations were counted.
        line += (
            "; with gradient checkpointing"
            if workload.checkpointing
            else "; without gradient checkpointing"
        )
    return line


def run_fit(
    *,
    params: str | None,
    config: Path | None,
    dtype: str | None,
    mode: str,
    context: int,
    batch: int,
    gpu: list[str],
    agent: str,
    gpus: int = 1,
    checkpointing: bool | None = None,
    lora_rank: int | None = None,
    kv_cache_dtype: str | None = None,
) -> FitReport:
    """Build the report; raises ``ConfigError`` for bad option values, ``RemoteError``
    when ``--gpu local`` finds no agent.

    ``checkpointing`` ``None`` is the mode's usual setting: on for QLoRA, as
    peft.prepare_model_for_kbit_training turns it on, off otherwise.
    """
    if dtype is not None:
        dtype = normalise_dtype(dtype)
    if kv_cache_dtype is not None:
        kv_cache_dtype = _kv_cache_dtype(kv_cache_dtype)
    arch = _architecture(params, config)
    chosen = dtype or _default_dtype(arch, mode)
    training = mode in ("full", "lora", "qlora")
    if checkpointing is not None and not training:
        raise ConfigError("--gradient-checkpointing applies to training (--mode full, lora, qlora)")
    if lora_rank is not None and mode not in ("lora", "qlora"):
        raise ConfigError("--lora-rank applies to --mode lora or qlora")
    workload = validate(
        Workload(
            arch,
            cast(Dtype, chosen),
            cast(Mode, mode),
            context,
            batch,
            lora_rank=lora_rank or DEFAULT_LORA_RANK,
            checkpointing=mode == "qlora" if checkpointing is None else checkpointing,
            gpus=gpus,
            kv_cache_dtype=cast(KvDtype | None, kv_cache_dtype),
        )
    )
    breakdown = estimate(workload)
    from_config = dtype is None and chosen == arch.stored_dtype and mode != "qlora"
    targets = _targets(gpu, agent, gpus)
    return FitReport(
        workload,
        breakdown,
        [_fit_on(workload, breakdown, t) for t in targets],
        dtype_source=arch.stored_as if from_config else None,
    )


def _kv_cache_dtype(text: str) -> str | None:
    """``--kv-cache-dtype``: ``auto`` is the engine's default (``None``); vLLM's
    ``fp8_e4m3``/``fp8_e5m2`` are a byte an element, as ``fp8``."""
    name = text.strip().lower()
    if name == "auto":
        return None
    if name in ("fp8_e4m3", "fp8_e5m2"):
        return "fp8"
    try:
        kind = normalise_dtype(name)
    except ConfigError:
        kind = name
    if kind not in get_args(KvDtype):
        raise ConfigError(
            f"--kv-cache-dtype must be auto or one of {', '.join(get_args(KvDtype))}"
            " (fp8_e4m3 and fp8_e5m2 count as fp8)"
        )
    return kind


def _default_dtype(arch: Architecture, mode: str) -> str:
    """QLoRA's nf4; else, for inference and LoRA, the size a quantised checkpoint stores
    its weights in (a GPTQ config weighed at bf16 was four times too heavy, and said
    "does not fit"); else bf16. Full fine-tuning trains in bf16 whatever was stored.

    A checkpoint whose quantization_config gives no size fit reads (HQQ, EETQ, a bits
    that is not a number) is refused without --dtype: weighed at bf16 it came out
    several times too heavy, and the advice was to quantise it.
    """
    if mode == "qlora":
        return "nf4"
    if mode in ("inference", "lora") and arch.stored_dtype is not None:
        return arch.stored_dtype
    if mode in ("inference", "lora") and arch.quantization_unread:
        raise ConfigError(
            f"model config's quantization_config ({arch.quantization_unread}) gives no weight"
            " size fit reads: pass --dtype with the size its weights are stored in"
            " (e.g. --dtype int4 for 4-bit)"
        )
    return "bf16"


def _architecture(params: str | None, config: Path | None) -> Architecture:
    if params is not None and config is not None:
        # Either would be silently dropped: the count and the config may disagree.
        raise ConfigError("give one of --params or --config")
    if config is not None:
        return load_hf_config(config)
    if params is None:
        raise ConfigError("give --params (e.g. 8B) or --config config.json")
    return Architecture(params=parse_param_count(params), name=f"{params} model")


def _targets(gpus: list[str], agent: str, split: int = 1) -> list[GpuTarget]:
    """Every GPU asked about, in order: each ``--gpu`` value, commas splitting a value;
    the same card twice (however spelt) once. With ``split`` > 1 GPUs, only this host's
    GPUs of which it has that many alike."""
    names = [name.strip() for value in gpus for name in value.split(",")]
    if not names or "" in names:
        raise ConfigError("--gpu: empty GPU name; use a size like 24GiB, 'local' or a card name")
    targets: list[GpuTarget] = []
    for name in names:
        found = (
            _local_targets(agent, split) if name.lower() == "local" else [catalogue_target(name)]
        )
        targets += [t for t in found if t not in targets]
    return targets


def _local_targets(agent: str, split: int = 1) -> list[GpuTarget]:
    # A URL that cannot be an agent's is a bad option (3); one that does not answer is
    # an unreachable agent (RemoteError, 5), as docs/exit-codes.md has it.
    problem = agent_url_problem(agent)
    if problem is not None:
        raise ConfigError(f"--agent {agent!r}: {problem}")
    snapshot = fetch_local_snapshot(agent)
    if snapshot is None:
        raise RemoteError(f"--gpu local: no gpuwatch agent answered at {agent}; name a GPU instead")
    targets = local_targets(snapshot)
    if not targets:
        raise ConfigError("--gpu local: the agent reports no GPU with a known memory size")
    if split > 1:
        targets = [t for t in targets if t.peers >= split]
        if not targets:
            most = max(t.peers for t in local_targets(snapshot))
            raise ConfigError(
                f"--gpus {split}: this host has at most {most} alike GPU(s) to split over"
                " (MIG instances are never split over)"
            )
    return targets


def _fit_on(workload: Workload, breakdown: Breakdown, target: GpuTarget) -> GpuFit:
    total = breakdown.total
    result = breakdown_verdict(breakdown, target.total_bytes)
    free_now = _free_now(breakdown, target)
    parallel = None
    if result != "fits":
        parallel = parallel_option(workload, target.total_bytes, _most_gpus(workload, target))
    return GpuFit(
        target=target,
        verdict=result,
        headroom_ratio=1 - total / target.total_bytes,
        fits_free_now=None if free_now is None else fits(free_now),
        options=[] if result == "fits" else options(workload, target.total_bytes),
        bigger_gpu=None if result == "fits" else _bigger_gpu(workload, breakdown, target),
        parallel=parallel,
        free_now=free_now,
    )


# A node's GPUs: how far a split is offered for a catalogue card once the request splits.
NODE_GPUS = 8


def _most_gpus(workload: Workload, target: GpuTarget) -> int:
    """The most GPUs a split may use: this host's alike cards for a local GPU; a node's
    for a catalogue card when the request already splits, else none beyond the one."""
    if target.local:
        return target.peers
    return max(NODE_GPUS, workload.gpus) if workload.gpus > 1 else 1


def _free_now(breakdown: Breakdown, target: GpuTarget) -> Verdict | None:
    """The verdict on what is free now, with the verdict's own headroom and at the top of
    an estimated range: "fits in what is free" with no room to spare OOMs at the first
    long batch. ``None`` when the free memory is unknown."""
    if target.free_bytes is None:
        return None
    if target.free_bytes <= 0:
        return "does_not_fit"
    return verdict(breakdown.worst_total, target.free_bytes)


def _bigger_gpu(workload: Workload, breakdown: Breakdown, target: GpuTarget) -> str | None:
    """A catalogue card larger than ``target`` that fits even the top of the range, and
    computes in the workload's dtype (no V100 or T4 for bf16).

    For an estimated shape the central total may fit a card the high end does not; a
    suggestion that can still be "cannot tell" does not make it fit.
    """
    if target.mig_profile is not None:
        # A MIG instance: a larger slice of the card it is on comes before another card.
        profile = larger_mig_profile(
            breakdown.worst_total, headroom=FITS_HEADROOM, profile=target.mig_profile
        )
        if profile is not None:
            return f"a larger MIG profile: {profile}"
    return smallest_fitting(
        breakdown.worst_total,
        headroom=FITS_HEADROOM,
        larger_than=target.total_bytes,
        dtype=workload.dtype,
    )
