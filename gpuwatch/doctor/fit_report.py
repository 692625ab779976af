"""``gpuwatch fit`` end to end: options in, a breakdown and verdict per GPU out.

:attr:`FitReport.verdict` is the answer a script wants (docs/doctor.md): ``fits`` when
the model fits with room on at least one of the GPUs asked about, ``tight`` when it
fits only tightly (on the best of them), ``does_not_fit`` when it fits on none, ``unknown`` when it fits on none for sure and on
some only for some model shapes. The CLI maps it to an exit code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from gpuwatch.doctor.architecture import Architecture, load_hf_config, parse_param_count
from gpuwatch.doctor.fit import (
    FITS_HEADROOM,
    Breakdown,
    Dtype,
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
    options,
    validate,
)
from gpuwatch.doctor.gpus import GpuTarget, catalogue_target, local_targets, smallest_fitting
from gpuwatch.doctor.live import fetch_local_snapshot
from gpuwatch.doctor.units import format_size
from gpuwatch.errors import ConfigError
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
                    "options": [
                        {
                            "change": o.change,
                            "total_bytes": o.total_bytes,
                            "total_high_bytes": o.high_bytes,
                        }
                        for o in g.options
                    ],
                    "bigger_gpu": g.bigger_gpu,
                }
                for g in self.gpus
            ],
        }

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
        lines = [f"{title}, context {w.context} x batch {w.batch}"]
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
            lines.append(_verdict_line(gpu, b))
            lines.extend(f"  makes it fit: {_option_text(o)}" for o in gpu.options)
            if gpu.verdict == "fits":
                continue
            if gpu.bigger_gpu:
                lines.append(f"  makes it fit: a bigger GPU ({gpu.bigger_gpu})")
            elif not gpu.options:
                lines.append(f"  no single GPU or setting here fits it: {_sharding(w)}")
        if self.unknown_because:
            lines.append("")
            lines.append(f"cannot tell: {self.unknown_because}")
        lines.extend(f"note: {note}" for note in b.notes)
        # A model's name is its folder's, a GPU's the agent's: text from outside, shown
        # with any control character escaped (as explain's report is).
        return "\n".join(printable(line) for line in lines) + "\n"


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


def _verdict_line(gpu: GpuFit, breakdown: Breakdown) -> str:
    card, total = gpu.target.total_bytes, breakdown.total
    name = f"{gpu.target.name} ({format_size(card)})"
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
    if gpu.fits_free_now is not None:
        line += "; fits in what is free now" if gpu.fits_free_now else "; NOT in what is free now"
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
) -> FitReport:
    """Build the report; raises ``ConfigError`` for bad option values or no local GPUs."""
    arch = _architecture(params, config)
    chosen = dtype or _default_dtype(arch, mode)
    workload = validate(Workload(arch, cast(Dtype, chosen), cast(Mode, mode), context, batch))
    breakdown = estimate(workload)
    from_config = dtype is None and chosen == arch.stored_dtype and mode != "qlora"
    return FitReport(
        workload,
        breakdown,
        [_fit_on(workload, breakdown, t) for t in _targets(gpu, agent)],
        dtype_source=arch.stored_as if from_config else None,
    )


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


def _targets(gpus: list[str], agent: str) -> list[GpuTarget]:
    """Every GPU asked about, in order: each ``--gpu`` value, commas splitting a value."""
    names = [name.strip() for value in gpus for name in value.split(",")]
    if not names or "" in names:
        raise ConfigError("--gpu: empty GPU name; use a size like 24GiB, 'local' or a card name")
    targets: list[GpuTarget] = []
    for name in dict.fromkeys(names):  # the same card twice is asked about once
        targets += _local_targets(agent) if name.lower() == "local" else [catalogue_target(name)]
    return targets


def _local_targets(agent: str) -> list[GpuTarget]:
    snapshot = fetch_local_snapshot(agent)
    if snapshot is None:
        raise ConfigError(f"--gpu local: no gpuwatch agent answered at {agent}; name a GPU instead")
    targets = local_targets(snapshot)
    if not targets:
        raise ConfigError("--gpu local: the agent reports no GPU with a known memory size")
    return targets


def _fit_on(workload: Workload, breakdown: Breakdown, target: GpuTarget) -> GpuFit:
    total = breakdown.total
    result = breakdown_verdict(breakdown, target.total_bytes)
    free_now = None if target.free_bytes is None else total <= target.free_bytes
    return GpuFit(
        target=target,
        verdict=result,
        headroom_ratio=1 - total / target.total_bytes,
        fits_free_now=free_now,
        options=[] if result == "fits" else options(workload, target.total_bytes),
        bigger_gpu=None if result == "fits" else _bigger_gpu(workload, breakdown, target),
    )


def _bigger_gpu(workload: Workload, breakdown: Breakdown, target: GpuTarget) -> str | None:
    """A catalogue card larger than ``target`` that fits even the top of the range, and
    computes in the workload's dtype (no V100 or T4 for bf16).

    For an estimated shape the central total may fit a card the high end does not; a
    suggestion that can still be "cannot tell" does not make it fit.
    """
    return smallest_fitting(
        breakdown.worst_total,
        headroom=FITS_HEADROOM,
        larger_than=target.total_bytes,
        dtype=workload.dtype,
    )
