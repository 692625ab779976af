"""VRAM arithmetic: what a model needs for inference or training, and whether it fits.

The formulas and their sources are in docs/doctor.md. In short, in bytes:

* weights: params x bytes per parameter (fp32 4, bf16/fp16 2, int8 1, int4 4.125
  bits with an fp16 scale per 128 weights, nf4 4.127 bits with QLoRA's double
  quantisation). Quantised formats quantise the linear layers only; the embeddings
  and lm_head stay 16-bit, as bitsandbytes and GPTQ/AWQ loaders leave them. A
  checkpoint quantised in part, weighed as it stores itself, keeps at 16 bits too the
  groups its quantization_config leaves unquantised (gpt-oss: attention and routers
  beside MXFP4 experts, at MXFP4's 4.25 bits).
* KV cache (inference): 2 x layers x kv_heads x head_dim x 2 bytes per token, times
  context x batch (Llama-3.1-8B: 131,072 bytes = 128 KiB per token); a layer with
  sliding-window attention holds min(context, window) tokens instead of the context.
* full fine-tuning with Adam in mixed precision: 2 (weights) + 2 (gradients) + 12
  (fp32 master weights and two moments) = 16 bytes per parameter (ZeRO, Rajbhandari
  et al. 2020); in fp32: 4 + 4 + 8 = 16 as well.
* LoRA/QLoRA: the frozen base at its dtype plus 16 bytes per trainable adapter
  parameter (fp32 adapter weights, gradients, two Adam moments); QLoRA's embeddings and
  lm_head at fp32, as peft.prepare_model_for_kbit_training casts them.
* activations, training: what a Hugging Face layer saves for its backward, per token
  at 16-bit 12h (norms) + 4 x (q + kv) (attention) + 8i (a gated MLP; 4i two-matrix),
  45h for Llama-3.1-8B, every layer; with gradient checkpointing each layer's input
  (2h, 4h for QLoRA's fp32 stream) plus one layer's set; the layer's backward adds 4i
  (2i); all doubled in fp32. Plus per logit the 16-bit logits and three fp32 tensors
  of their size for the loss (14 bytes; 12 in fp32). The longest QLoRA context this
  gives comes within 2-7 % of Unsloth's published HF+FA2 limits on 16-80 GB cards (the
  derivation is above :data:`NORM_BYTES`). Inference: one layer's
  working set during prefill, (4h + 2i) x seq x batch x 2 bytes, plus the last
  token's fp32 logits.
* overhead: 1 GiB for the CUDA context, cuBLAS/cuDNN workspaces and allocator slack.
* over N GPUs (``Workload.gpus``), one GPU's share (:func:`_per_gpu`): tensor parallel
  for inference (weights and KV heads split; activations and overhead on each), FSDP /
  ZeRO-3 for training (weights, gradients and optimizer state split, plus one layer
  gathered whole; each GPU's own batch of activations).

Activations are estimates (kernels and frameworks differ); everything else is exact
arithmetic on the architecture.

With only a parameter count (``--params 8B``) nothing is left out: the shape comes from
:func:`~gpuwatch.doctor.architecture.typical_shape` (for 8B, Llama-3.1-8B's own 32 x
4096), and the whole estimate is repeated over the shapes published models span
(:func:`~gpuwatch.doctor.architecture.shape_variants`: hidden/layers 80-160, 1-8 query
heads per KV head, 32k-256k vocabulary). The breakdown then carries that range
(``low_total``/``high_total``) and names the estimated parts; a verdict that differs
across the range is ``unknown``, with the part that decides it named, and a change is
offered as making it fit only when the whole range fits after it (:func:`options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Literal, get_args

from gpuwatch.doctor.architecture import Architecture, shape_variants, typical_shape
from gpuwatch.doctor.units import GIB
from gpuwatch.errors import ConfigError

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4", "nf4"]
Mode = Literal["inference", "full", "lora", "qlora"]
# What an engine may keep its KV cache in, whatever the weights are (vLLM's
# --kv-cache-dtype fp8 halves a 16-bit cache).
KvDtype = Literal["fp32", "bf16", "fp16", "fp8"]
KV_ELEMENT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
Verdict = Literal["fits", "tight", "does_not_fit", "unknown"]

BITS_PER_PARAM: dict[str, float] = {
    "fp32": 32,
    "bf16": 16,
    "fp16": 16,
    "fp8": 8,  # E4M3/E5M2: a byte a weight, as int8 (vLLM --quantization fp8)
    "int8": 8,
    # An fp16 scale per group of 128 (GPTQ/AWQ default); a config's own group_size and
    # zeros are read into Architecture.stored_bits (architecture._group_bits).
    "int4": 4 + 16 / 128,
    "nf4": 4 + 0.127,  # QLoRA double quantisation: 0.127 bits of constants per parameter
}
QUANTISED = ("fp8", "int8", "int4", "nf4")
# How people spell a dtype: torch's and config.json's torch_dtype names, any case.
DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "e4m3": "fp8",
}
FOUR_BIT = ("int4", "nf4")
ADAM_BYTES_PER_TRAINABLE = 16
# Training activations, in bytes a token at 16-bit, as a Hugging Face decoder layer
# (RMSNorm, RoPE, FlashAttention-2, no dropout) saves them for its backward:
# * each of its two norms keeps its fp32 upcast input (4h) and its output (2h): 12h;
# * attention keeps q and k after RoPE, v, and its output: 2 x (2*q + 2*kv), with q the
#   query width (heads x head dim) and kv the key/value width (KV heads x head dim);
# * a gated MLP (SwiGLU, GeGLU) keeps gate, up, act(gate) and their product: 4 x 2i; a
#   two-matrix one keeps up and act(up): 2 x 2i.
# Llama-3.1-8B (q = h, kv = h/4, i = 3.5h): 12h + 4h + h + 28h = 45h, where Korthikanti
# et al.'s 34h is a GPT layer with a 4h two-matrix MLP. The layer's backward holds two
# more MLP-wide gradients at once (gated: of act(gate) and up; else one).
# Checked against Unsloth's published HF+FA2 QLoRA limits (rank 32, batch 1, gradient
# checkpointing; unsloth.ai/blog/llama3-3): Llama-3.3-70B 6,916 tokens on 80 GB (this
# gives 7,042), Llama-3.1-8B 28,454 on 80 GB (29,544) and 2,551 on 16 GB (2,717).
NORM_BYTES = 12
ATTENTION_BYTES = 4  # x (q + kv): each of q, k, v and the output at 2 bytes
MLP_BYTES = {True: 8, False: 4}  # x i, gated or not
MLP_BACKWARD_BYTES = {True: 4, False: 2}  # x i
# With gradient checkpointing each layer keeps only its input, the residual stream: 2h,
# but 4h for QLoRA, whose embeddings peft.prepare_model_for_kbit_training (which TRL's
# SFTTrainer calls) casts to fp32, so the stream they start is fp32 throughout.
CHECKPOINT_BYTES = 2
# The loss: transformers' ForCausalLMLoss upcasts the logits (logits.float()) and
# cross-entropy keeps log-softmax's fp32 output; at most three fp32 tensors of the
# logits' size live at once (forward, transformers 4.46-4.49: the upcast, the shifted
# .contiguous() copy and log-softmax's output; backward: that output, the gradient
# nll_loss hands it and the gradient it returns), beside the 16-bit logits: 14 bytes a
# logit at 16-bit, 12 in fp32, where the logits are the upcast.
LOSS_FP32_COPIES = 3
OVERHEAD_BYTES = 1 * GIB
FITS_HEADROOM = 0.15  # leave 15 %: the longest batch peaks above the first steps
TIGHT_HEADROOM = 0.10
DEFAULT_LORA_RANK = 16
# Components named in Breakdown.estimated, in the order they are listed, and their names.
COMPONENTS = ("weights", "kv_cache", "gradients", "optimizer", "activations")
COMPONENT_NAMES = {"kv_cache": "KV cache", "optimizer": "optimizer state"}


@dataclass(frozen=True)
class KvSplit:
    """The KV cache by kind of layer: ``full_layers`` hold the whole context,
    ``sliding_layers`` at most ``window`` tokens; ``full_context_bytes`` is what it
    would be if every layer held the whole context."""

    full_layers: int
    sliding_layers: int
    window: int | None
    full_layers_bytes: int
    sliding_layers_bytes: int
    full_context_bytes: int
    # Linear-attention layers' fixed state, whatever the context (MiniMax).
    state_bytes: int = 0
    # The windowed layers are chunked (Llama 4), not sliding: the same arithmetic.
    chunked: bool = False

    @property
    def total(self) -> int:
        return self.full_layers_bytes + self.sliding_layers_bytes + self.state_bytes

    def as_dict(self) -> dict[str, int | None]:
        return {
            "full_layers": self.full_layers,
            "sliding_layers": self.sliding_layers,
            "window": self.window,
            "full_layers_bytes": self.full_layers_bytes,
            "sliding_layers_bytes": self.sliding_layers_bytes,
            "full_context_bytes": self.full_context_bytes,
            "state_bytes": self.state_bytes,
            "chunked": self.chunked,
        }


def component_name(part: str) -> str:
    """``"kv_cache"`` -> ``"KV cache"``: a part as the report names it."""
    return COMPONENT_NAMES.get(part, part)


@dataclass(frozen=True)
class Workload:
    """One model, precision, mode, context and batch."""

    arch: Architecture
    dtype: Dtype = "bf16"
    mode: Mode = "inference"
    context: int = 4096
    batch: int = 1
    lora_rank: int = DEFAULT_LORA_RANK
    checkpointing: bool = False
    # GPUs the model is split over: tensor parallel for inference, fully sharded data
    # parallel (FSDP, ZeRO-3) for training; every figure is then one GPU's.
    gpus: int = 1
    # The KV cache's element type; ``None``: the engine's default, 16-bit (fp32 for an
    # fp32 model), whatever the weights' quantisation.
    kv_cache_dtype: KvDtype | None = None


@dataclass
class Breakdown:
    """Bytes per component (``kv_cache`` is ``None`` when training: no cache).

    When the shape was estimated, ``estimated`` names the parts that depend on it and
    ``low_total``/``high_total`` bound :attr:`total` over typical shapes; ``spread``
    holds each estimated part's (low, high). ``kv_per_token`` is the KV cache's bytes
    per token (for the typical shape when estimated; ``None`` without a shape).
    """

    weights: int
    kv_cache: int | None
    gradients: int
    optimizer: int
    activations: int | None
    overhead: int = OVERHEAD_BYTES
    notes: list[str] = field(default_factory=list)
    estimated: list[str] = field(default_factory=list)
    low_total: int | None = None
    high_total: int | None = None
    spread: dict[str, tuple[int, int]] = field(default_factory=dict)
    kv_per_token: int | None = None
    kv_split: KvSplit | None = None

    @property
    def total(self) -> int:
        """Sum of the parts (every part is known or estimated; none is left out)."""
        parts = (self.weights, self.kv_cache, self.gradients, self.optimizer, self.activations)
        return sum(p for p in parts if p is not None) + self.overhead

    @property
    def worst_total(self) -> int:
        """The total at the top of the range (:attr:`total` when nothing is estimated)."""
        return max(self.total, self.high_total or 0)

    def worst_part(self, name: str) -> int:
        """A part at the top of its range (0 for a part that is ``None``)."""
        if name in self.spread:
            return self.spread[name][1]
        return self.part(name) or 0

    def part(self, name: str) -> int | None:
        value: int | None = getattr(self, name)
        return value

    def as_dict(self) -> dict[str, int | None]:
        return {
            "weights_bytes": self.weights,
            "kv_cache_bytes": self.kv_cache,
            "gradients_bytes": self.gradients,
            "optimizer_bytes": self.optimizer,
            "activations_bytes": self.activations,
            "overhead_bytes": self.overhead,
            "total_bytes": self.total,
            "total_low_bytes": self.low_total,
            "total_high_bytes": self.high_total,
        }


# Tokens in flight past any workload (the longest contexts are a few million tokens): a
# count past it is a typo, and the float arithmetic after it would overflow.
MAX_TOKENS = 10**12
# More GPUs than one tensor- or data-parallel group spans (a few thousand): a typo.
MAX_GPUS = 4096


def normalise_dtype(text: str) -> str:
    """``"bfloat16"``, ``"BF16"`` -> ``"bf16"``: a dtype as fit names it, whatever its
    spelling (torch's names, config.json's ``torch_dtype``, any case). Raises
    ``ConfigError`` for an empty or unknown one."""
    name = text.strip().lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in get_args(Dtype):
        raise ConfigError(
            f"--dtype must be one of {', '.join(get_args(Dtype))} (or bfloat16, float16,"
            f" float32), not {text!r}"
        )
    return name


def validate(workload: Workload) -> Workload:
    """Check the combination; raises ``ConfigError`` for one that cannot be trained."""
    if workload.context * workload.batch > MAX_TOKENS:
        raise ConfigError(
            f"--context x --batch: {Decimal(workload.context * workload.batch):.3g} tokens is"
            f" beyond any workload (at most {MAX_TOKENS:.0e})"
        )
    if not 1 <= workload.gpus <= MAX_GPUS:
        raise ConfigError(f"--gpus must be 1 to {MAX_GPUS}")
    if workload.dtype not in get_args(Dtype):
        raise ConfigError(f"--dtype must be one of {', '.join(get_args(Dtype))}")
    if workload.mode not in get_args(Mode):
        raise ConfigError(
            f"--mode must be one of {', '.join(get_args(Mode))}, not {workload.mode!r}"
        )
    if workload.mode == "full" and workload.dtype in QUANTISED:
        raise ConfigError("full fine-tuning needs fp32, bf16 or fp16 weights; use --mode qlora")
    if workload.mode == "qlora" and workload.dtype not in FOUR_BIT:
        raise ConfigError("--mode qlora means a 4-bit base: use --dtype nf4 or int4")
    if workload.mode == "lora" and workload.dtype in FOUR_BIT:
        raise ConfigError("LoRA on a 4-bit base is QLoRA: use --mode qlora")
    if workload.kv_cache_dtype is not None:
        if workload.kv_cache_dtype not in get_args(KvDtype):
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(get_args(KvDtype))}")
        if workload.mode != "inference":
            raise ConfigError(
                "--kv-cache-dtype applies to --mode inference (training keeps no cache)"
            )
    return workload


def kv_element_bytes(dtype: Dtype, kv_dtype: KvDtype | None = None) -> int:
    """Bytes of one KV cache element: ``kv_dtype``'s, else 16-bit (4 for an fp32 model)."""
    if kv_dtype is not None:
        return KV_ELEMENT_BYTES[kv_dtype]
    return 4 if dtype == "fp32" else 2


def kv_bytes_per_token(
    arch: Architecture, dtype: Dtype, kv_dtype: KvDtype | None = None
) -> int | None:
    """2 (K and V) x layers x kv_heads x head_dim x element bytes; ``None`` without a shape.

    Only the layers that keep a cache count (``kv_layers``), and where the config gives
    another layout its elements a token (``kv_elements``: multi-head latent attention's
    latent, per-layer head counts). The cache stays 16-bit for quantised weights (fp32
    only for an fp32 model) unless ``kv_dtype`` says otherwise.
    """
    if not arch.has_shape:
        return None
    element = kv_element_bytes(dtype, kv_dtype)
    layers = _kv_layers(arch)
    if arch.kv_elements is not None:
        return arch.kv_elements * element
    return 2 * layers * (arch.kv_heads or 0) * (arch.head_dim or 0) * element


def _kv_layers(arch: Architecture) -> int:
    return arch.layers or 0 if arch.kv_layers is None else arch.kv_layers


def kv_split(
    arch: Architecture,
    dtype: Dtype,
    context: int,
    batch: int,
    kv_dtype: KvDtype | None = None,
) -> KvSplit | None:
    """The KV cache at ``context`` x ``batch``: full-attention layers hold the context,
    sliding-window layers ``min(context, window)`` tokens; ``None`` without a shape."""
    per_token = kv_bytes_per_token(arch, dtype, kv_dtype)
    if per_token is None:
        return None
    layers = _kv_layers(arch)
    sliding = min(arch.sliding_layers, layers) if arch.window else 0
    per_layer = per_token // layers if layers else 0
    held = min(context, arch.window) if arch.window else context
    state = arch.state_bytes * batch
    return KvSplit(
        full_layers=layers - sliding,
        sliding_layers=sliding,
        window=arch.window if sliding else None,
        full_layers_bytes=per_layer * (layers - sliding) * context * batch,
        sliding_layers_bytes=per_layer * sliding * held * batch,
        full_context_bytes=per_token * context * batch + state,
        state_bytes=state,
        chunked=arch.window_chunked and sliding > 0,
    )


def as_stored(arch: Architecture, dtype: Dtype) -> bool:
    """Whether ``dtype`` is the one the checkpoint stores its weights in (its
    quantization_config's layout then applies)."""
    return arch.stored_dtype is not None and dtype == arch.stored_dtype


def weight_bytes(arch: Architecture, dtype: Dtype) -> int:
    """Bytes of the weights at ``dtype`` (embeddings and lm_head 16-bit if quantised).

    At the dtype a quantised checkpoint stores, the groups its quantization_config
    leaves unquantised (attention, routers, encoders) are 16-bit too, and the quantised
    weights take the format's own bits where it fixes them (MXFP4's 4.25).
    """
    bits = BITS_PER_PARAM[dtype]
    if dtype in QUANTISED and arch.embedding_params:
        kept = arch.embedding_params
        if as_stored(arch, dtype):
            bits = arch.stored_bits or bits
            kept += arch.kept_params
        linear = max(0, arch.params - kept)
        return round(linear * bits / 8) + (arch.params - linear) * 2
    return round(arch.params * bits / 8)


def estimate(workload: Workload) -> Breakdown:
    """The memory ``workload`` needs, part by part.

    Without a shape, the parts are computed for a typical shape of that size and the
    totals repeated over :func:`shape_variants` for the range (module docstring).
    """
    if workload.arch.has_shape:
        return _estimate_shaped(workload)
    params = workload.arch.params
    central = _estimate_shaped(replace(workload, arch=_named(typical_shape(params), workload)))
    variants = [_estimate_shaped(replace(workload, arch=shape)) for shape in shape_variants(params)]
    totals = [b.total for b in variants] + [central.total]
    central.low_total, central.high_total = min(totals), max(totals)
    for name in COMPONENTS:
        values = [v for b in [*variants, central] if (v := b.part(name)) is not None]
        if values and min(values) != max(values):
            central.spread[name] = (min(values), max(values))
    central.estimated = [name for name in COMPONENTS if name in central.spread]
    shape = typical_shape(params)
    central.notes.append(
        f"no config: {', '.join(component_name(n) for n in central.estimated)} estimated for a "
        f"typical {params / 1e9:.3g}B decoder ({shape.layers} layers x {shape.hidden} hidden, "
        f"{shape.kv_heads} KV heads, {shape.vocab:,} vocab); over typical shapes the total is "
        f"{_gib(central.low_total)}-{_gib(central.high_total)}: pass --config config.json "
        "for exact figures"
    )
    return central


def _named(arch: Architecture, workload: Workload) -> Architecture:
    return replace(arch, name=workload.arch.name)


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def _estimate_shaped(workload: Workload) -> Breakdown:
    arch, dtype, mode = workload.arch, workload.dtype, workload.mode
    weights = weight_bytes(arch, dtype)
    gradients = optimizer = 0
    if mode == "full":
        element = 4 if dtype == "fp32" else 2
        gradients = arch.params * element
        # Adam: two fp32 moments, plus fp32 master weights when training in 16-bit.
        optimizer = arch.params * (8 if dtype == "fp32" else 12)
    elif mode in ("lora", "qlora"):
        trainable = arch.lora_params(workload.lora_rank) or 0
        weights += trainable * 4
        if mode == "qlora":
            # peft.prepare_model_for_kbit_training casts what stays 16-bit beside the
            # 4-bit layers (embeddings, lm_head) to fp32: 2 more bytes a parameter.
            weights += arch.embedding_params * 2
        gradients = trainable * 4
        optimizer = trainable * (ADAM_BYTES_PER_TRAINABLE - 8)
    per_token = kv_bytes_per_token(arch, dtype, workload.kv_cache_dtype)
    kv_cache = None
    split = None
    notes: list[str] = list(arch.notes)
    if mode == "inference" and per_token is not None:
        split = kv_split(arch, dtype, workload.context, workload.batch, workload.kv_cache_dtype)
        if split is not None:
            kv_cache = split.total
        unread = arch.window_unread
        if unread and (
            arch.window_unread_size is None or workload.context > arch.window_unread_size
        ):
            notes.append(f"KV cache: {unread}")
    if dtype in QUANTISED and as_stored(arch, dtype):
        notes.extend(_layout_notes(arch))
    if arch.max_positions is not None and workload.context > arch.max_positions:
        notes.append(
            f"context {workload.context:,} is past the model's {arch.max_positions:,} positions"
            " (max_position_embeddings): it was not trained for it, and transformers or vLLM"
            " refuse it without RoPE scaling"
        )
    whole = Breakdown(
        weights,
        kv_cache,
        gradients,
        optimizer,
        _activations(workload),
        notes=notes,
        kv_per_token=per_token,
        kv_split=split,
    )
    return _per_gpu(whole, workload) if workload.gpus > 1 else whole


def _per_gpu(whole: Breakdown, workload: Workload) -> Breakdown:
    """One GPU's share when the model is split over ``workload.gpus``.

    Inference, tensor parallel (vLLM, TGI): each GPU holds 1/N of the weights and its
    KV heads' share of the cache; where N exceeds the KV heads they are replicated
    (vLLM), and a latent or per-block cache layout is counted whole. One layer's
    activations and the overhead are on every GPU. Training, fully sharded (FSDP
    FULL_SHARD, ZeRO-3): weights, gradients and optimizer state are 1/N each, plus the one
    layer FSDP gathers whole for its forward and backward; activations are each GPU's own
    --batch (data parallel).
    """
    gpus, arch = workload.gpus, workload.arch
    notes = list(whole.notes)
    if workload.mode == "inference":
        keep, of = _kv_share(arch, gpus)
        split = whole.kv_split
        if split is not None:
            split = replace(
                split,
                full_layers_bytes=-(-split.full_layers_bytes * keep // of),
                sliding_layers_bytes=-(-split.sliding_layers_bytes * keep // of),
                full_context_bytes=-(-split.full_context_bytes * keep // of),
            )
        kv = None if whole.kv_cache is None or split is None else split.total
        if arch.heads and not arch.estimated and arch.heads % gpus:
            notes.append(
                f"tensor parallel over {gpus} GPUs needs the {arch.heads} attention heads to"
                " divide by it (vLLM refuses otherwise); pipeline parallelism does not"
            )
        notes.append(
            f"per GPU, tensor parallel over {gpus} GPUs: weights split {gpus} ways, KV cache"
            f" {_kv_share_text(arch, gpus)}; activations (one layer's) and the"
            f" {_gib(whole.overhead)} CUDA context counted on every GPU; NCCL buffers and CUDA"
            " graphs not counted"
        )
        return replace(
            whole, weights=-(-whole.weights // gpus), kv_cache=kv, kv_split=split, notes=notes
        )
    layers = arch.layers or 1
    gathered = max(0, weight_bytes(arch, workload.dtype) - 2 * arch.embedding_params) // layers
    notes.append(
        f"per GPU, fully sharded over {gpus} GPUs (FSDP FULL_SHARD / ZeRO-3): weights,"
        f" gradients and optimizer state split {gpus} ways, plus one layer gathered whole"
        f" ({_gib(gathered)}); activations for --batch {workload.batch} on every GPU (data"
        f" parallel) and the {_gib(whole.overhead)} CUDA context on each; NCCL buffers not"
        " counted"
    )
    return replace(
        whole,
        weights=-(-whole.weights // gpus) + gathered,
        gradients=-(-whole.gradients // gpus),
        optimizer=-(-whole.optimizer // gpus),
        notes=notes,
    )


def _kv_share(arch: Architecture, gpus: int) -> tuple[int, int]:
    """The fraction (``keep`` / ``of``) of the KV cache one GPU holds under tensor
    parallelism: ceil(KV heads / N) of the KV heads (at least one, replicated past N =
    KV heads, as vLLM does); all of it for a latent (MLA) or per-block layout."""
    kv_heads = arch.kv_heads or 0
    if arch.kv_elements is not None or kv_heads == 0:
        return 1, 1
    return -(-kv_heads // gpus), kv_heads


def _kv_share_text(arch: Architecture, gpus: int) -> str:
    keep, of = _kv_share(arch, gpus)
    if keep == of:
        return "whole on every GPU (its layout is not split by KV head)"
    replicated = " (replicated: fewer KV heads than GPUs)" if gpus > of else ""
    return f"{keep} of its {of} KV heads on each{replicated}"


def _layout_notes(arch: Architecture) -> list[str]:
    """What a checkpoint quantised in part keeps at 16 bits, and what fit could not place."""
    notes = []
    if arch.kept_unquantised:
        kept = ", ".join(arch.kept_unquantised)
        bits = f"; quantised weights at {arch.stored_bits:g} bits" if arch.stored_bits else ""
        notes.append(
            f"weights: {kept} {'stays' if len(arch.kept_unquantised) == 1 else 'stay'} 16-bit,"
            " as the config's quantization_config leaves them"
            f" ({_gib(2 * (arch.kept_params + arch.embedding_params))}){bits}"
        )
    if arch.unplaced_unquantised:
        names = ", ".join(arch.unplaced_unquantised)
        notes.append(
            f"weights: quantization_config also leaves {names} unquantised, which fit cannot"
            " size: weighed as quantised (an under-count)"
        )
    return notes


def _activations(workload: Workload) -> int | None:
    arch = workload.arch
    if not arch.has_shape:
        return None
    tokens = workload.context * workload.batch
    hidden, layers, vocab = arch.hidden or 0, arch.layers or 0, arch.vocab or 0
    if workload.mode == "inference":
        intermediate = arch.intermediate or 4 * hidden
        one_layer = tokens * (4 * hidden + 2 * intermediate) * 2
        return one_layer + workload.batch * vocab * 4
    # fp32 doubles every element (the norms' upcasts then copy nothing: a small over-count).
    fp32 = workload.dtype == "fp32"
    scale = 2 if fp32 else 1
    saved, backward = _layer_activations(arch)
    if workload.checkpointing:
        # Every layer's input, plus the one layer recomputed in the backward.
        stream = CHECKPOINT_BYTES * (2 if fp32 or workload.mode == "qlora" else 1)
        per_token = stream * hidden * layers + (saved + backward) * scale
    else:
        per_token = (saved * layers + backward) * scale
    per_logit = LOSS_FP32_COPIES * 4 + (0 if fp32 else 2)
    return tokens * (per_token + vocab * per_logit)


def _layer_activations(arch: Architecture) -> tuple[int, int]:
    """Bytes a token one layer saves for its backward at 16-bit, and what its backward
    holds beside them (the module's table above): the norms, q/k/v and the attention
    output at the model's widths, and the MLP at the width a token passes through (a
    mixture of experts': its routed and shared experts)."""
    hidden = arch.hidden or 0
    width = arch.active_intermediate or arch.intermediate or 4 * hidden
    query = (arch.heads or 0) * (arch.head_dim or 0) or hidden
    kv = (arch.kv_heads or 0) * (arch.head_dim or 0)
    saved = NORM_BYTES * hidden + ATTENTION_BYTES * (query + kv) + MLP_BYTES[arch.gated_mlp] * width
    return saved, MLP_BACKWARD_BYTES[arch.gated_mlp] * width


def verdict(needed: int, capacity: int) -> Verdict:
    """``fits`` with >= 15 % headroom, ``tight`` with 10-15 %, else ``does_not_fit``."""
    headroom = 1 - needed / capacity
    if headroom >= FITS_HEADROOM:
        return "fits"
    if headroom >= TIGHT_HEADROOM:
        return "tight"
    return "does_not_fit"


def fits(result: Verdict) -> bool:
    return result in ("fits", "tight")


def breakdown_verdict(breakdown: Breakdown, capacity: int) -> Verdict:
    """:func:`verdict` of the total; ``unknown`` when an estimate's range straddles it.

    Fits at one end of the range and not at the other means the answer depends on
    the shape the parameter count does not give.
    """
    central = verdict(breakdown.total, capacity)
    if breakdown.low_total is None or breakdown.high_total is None:
        return central
    low = verdict(breakdown.low_total, capacity)
    high = verdict(breakdown.high_total, capacity)
    return central if fits(low) == fits(high) else "unknown"


def range_fits(breakdown: Breakdown, capacity: int) -> bool:
    """``fits`` (with 15 % headroom) at every shape the range covers, not just the
    central one: what a change must achieve to be offered as making it fit."""
    return verdict(breakdown.worst_total, capacity) == "fits"


def deciding_part(breakdown: Breakdown) -> str | None:
    """The estimated part whose range is widest (what an ``unknown`` verdict hinges on)."""
    if not breakdown.spread:
        return None
    return max(
        breakdown.spread, key=lambda name: breakdown.spread[name][1] - breakdown.spread[name][0]
    )


@dataclass(frozen=True)
class Option:
    """One change and what the workload needs after it (``high_bytes``: the top of the
    range when the shape is estimated, else ``None``)."""

    change: str
    total_bytes: int
    fits: bool
    high_bytes: int | None = None


def _option(change: str, breakdown: Breakdown) -> Option:
    high = breakdown.high_total
    return Option(change, breakdown.total, True, None if high is None else breakdown.worst_total)


def options(workload: Workload, capacity: int) -> list[Option]:
    """Changes that make ``workload`` fit on ``capacity`` bytes (with 15 % headroom).

    With an estimated shape a change counts only when the whole range fits after it
    (:func:`range_fits`): one that still "cannot tell" does not make it fit.
    """
    found: list[Option] = []

    def consider(change: str, changed: Workload) -> None:
        try:
            breakdown = estimate(validate(changed))
        except ConfigError:
            return
        if range_fits(breakdown, capacity):
            found.append(_option(change, breakdown))

    if workload.mode == "inference":
        for dtype in ("int8", "nf4"):
            if BITS_PER_PARAM[dtype] < BITS_PER_PARAM[workload.dtype]:
                consider(f"quantise to {dtype} (--dtype {dtype})", replace(workload, dtype=dtype))
        if kv_element_bytes(workload.dtype, workload.kv_cache_dtype) > 1:
            consider(
                "fp8 KV cache (--kv-cache-dtype fp8; vLLM --kv-cache-dtype fp8)",
                replace(workload, kv_cache_dtype="fp8"),
            )
    elif workload.mode == "full":
        consider("LoRA instead of full fine-tuning (--mode lora)", replace(workload, mode="lora"))
        consider(
            "QLoRA: 4-bit base + LoRA (--mode qlora --dtype nf4)",
            replace(workload, mode="qlora", dtype="nf4"),
        )
    elif workload.mode == "lora":
        consider(
            "QLoRA: 4-bit base (--mode qlora --dtype nf4)",
            replace(workload, mode="qlora", dtype="nf4"),
        )
    if workload.mode != "inference" and not workload.checkpointing:
        consider(
            "gradient checkpointing (--gradient-checkpointing;"
            " model.gradient_checkpointing_enable())",
            replace(workload, checkpointing=True),
        )
    if workload.batch > 1:
        # Accumulation keeps a training step's effective batch; inference has no step.
        how = "batch 1" if workload.mode == "inference" else "batch 1 with gradient accumulation"
        consider(f"{how} (--batch 1)", replace(workload, batch=1))
    shorter = max_context(workload, capacity)
    if shorter is not None and shorter < workload.context:
        consider(f"shorter context (--context {shorter})", replace(workload, context=shorter))
    # Offloading to one GPU's CPU share is no advice for a model already split over GPUs.
    offload = _offload(workload, capacity) if workload.gpus == 1 else None
    if offload is not None:
        found.append(offload)
    if not found:
        combined = _combined(workload, capacity)
        if combined is not None:
            found.append(combined)
    return found


def parallel_option(workload: Workload, capacity: int, max_gpus: int) -> Option | None:
    """Split over more GPUs, up to ``max_gpus``: the fewest that fit with headroom
    (``fits`` True), else the per-GPU figure at ``max_gpus`` (``fits`` False); ``None``
    when no more GPUs are at hand.

    Tensor parallelism needs the attention heads to divide by the GPU count (vLLM refuses
    otherwise); without a config, powers of two. FSDP shards any count.
    """
    counts = [n for n in range(workload.gpus + 1, max_gpus + 1) if _can_split(workload, n)]
    last: Option | None = None
    for gpus in counts:
        try:
            breakdown = estimate(validate(replace(workload, gpus=gpus)))
        except ConfigError:
            return last
        option = _option(_parallel_change(workload, gpus), breakdown)
        if range_fits(breakdown, capacity):
            return option
        last = replace(option, fits=False)
    return last


def _can_split(workload: Workload, gpus: int) -> bool:
    if workload.mode != "inference":
        return True
    heads = workload.arch.heads
    if heads is None or workload.arch.estimated:
        return gpus & (gpus - 1) == 0
    return heads % gpus == 0


def _parallel_change(workload: Workload, gpus: int) -> str:
    if workload.mode == "inference":
        return (
            f"tensor parallel over {gpus} GPUs, per GPU (--gpus {gpus};"
            f" vLLM --tensor-parallel-size {gpus})"
        )
    return f"shard over {gpus} GPUs with FSDP/ZeRO-3, per GPU (--gpus {gpus})"


def _combined(workload: Workload, capacity: int) -> Option | None:
    """No single change is enough: stack the cheap ones until it fits, if it ever does."""
    steps: list[tuple[str, Workload]] = []
    if workload.mode == "inference" and workload.dtype not in FOUR_BIT:
        steps.append(("4-bit weights", replace(workload, dtype="nf4")))
    elif workload.mode in ("full", "lora"):
        steps.append(("QLoRA", replace(workload, mode="qlora", dtype="nf4")))
    current = steps[-1][1] if steps else workload
    if current.mode != "inference" and not current.checkpointing:
        current = replace(current, checkpointing=True)
        steps.append(("gradient checkpointing", current))
    if current.batch > 1:
        current = replace(current, batch=1)
        steps.append(("batch 1", current))
    applied = []
    for name, changed in steps:
        applied.append(name)
        breakdown = estimate(changed)
        if range_fits(breakdown, capacity):
            return _option(" + ".join(applied), breakdown)
    return None


def max_context(workload: Workload, capacity: int) -> int | None:
    """The longest context (a multiple of 256) that fits with headroom, or ``None``.

    With an estimated shape, the longest that fits the top of the range.
    """
    step = 256
    if not range_fits(estimate(replace(workload, context=step)), capacity):
        return None
    low, high = 1, max(1, workload.context // step)
    while low < high:  # memory grows with context, so bisect on multiples of 256
        mid = (low + high + 1) // 2
        if range_fits(estimate(replace(workload, context=mid * step)), capacity):
            low = mid
        else:
            high = mid - 1
    return low * step


def _offload(workload: Workload, capacity: int) -> Option | None:
    """Keep on the GPU what fits with headroom; the rest of the weights go to CPU RAM.

    The rest (KV cache, activations, ...) is budgeted at the top of its range, so the
    GPU's share holds whatever the model's shape turns out to be.
    """
    breakdown = estimate(workload)
    budget = int((1 - FITS_HEADROOM) * capacity)
    non_weights = breakdown.overhead + sum(
        breakdown.worst_part(name) for name in COMPONENTS if name != "weights"
    )
    on_gpu = budget - non_weights
    weights = breakdown.worst_part("weights")
    if on_gpu <= 0 or on_gpu >= weights:
        return None
    gib = on_gpu // GIB
    if gib < 1:
        return None
    off = weights - gib * GIB
    amount = f"up to {off / GIB:.1f}" if "weights" in breakdown.spread else f"{off / GIB:.1f}"
    change = (
        f"offload {amount} GiB of weights to CPU RAM "
        f'(device_map="auto", max_memory={{0: "{gib}GiB", "cpu": ...}}); several times slower'
    )
    # The GPU's share is capped at the budget, whatever the shape: that is the top too.
    return Option(change, budget, True, None if breakdown.high_total is None else budget)
