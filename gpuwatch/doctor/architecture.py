"""A transformer's shape, from a parameter count or a Hugging Face ``config.json``.

The parameter count of a decoder-only transformer follows from its config
(docs/doctor.md has the derivation)::

    embeddings   V*h            (and the same again for an untied lm_head)
    attention    h*(n*d) + 2*h*(k*d) + (n*d)*h      per layer (q, k, v, o)
    MLP          3*h*i (gated: gate, up, down) or 2*h*i (GPT-style)   per MLP
    norms        2*h per layer + h

with V vocab, h hidden size, n attention heads, k KV heads, d head dim, i intermediate
size. A mixture-of-experts layer has one MLP per expert (of ``moe_intermediate_size``
where the config gives one), a shared expert where there is one, and an h x experts
router. For Llama-3.1-8B (V=128256, h=4096, 32 layers, n=32, k=8, d=128, i=14336, untied)
that is 8,030,261,248, the published 8.03B. Biases and rotary tables are left out
(under 0.1 %).

With only a parameter count, :func:`typical_shape` inverts the same formula for a
typical dense decoder (the Llama family's proportions: head dim 128, hidden/layers about
128, gated MLP of 3.5 x hidden, 4 query heads per KV head, 128,256-token vocabulary,
untied); for 8B it gives Llama-3.1-8B's own 32 x 4096. :func:`shape_variants` spans the
shapes published models actually have, which is where an estimate's range comes from.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import stat
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from gpuwatch.errors import ConfigError

# Families whose MLP is up -> activation -> down (two matrices), not gated (three), by
# their modelling code: transformers decides it by model class, not by a config field
# (Gemma's gelu MLP is gated, Nemotron's relu2 one is not). GPT-2, GPT-Neo, GPT-BigCode
# and StarCoder2 (c_fc, c_proj), GPT-NeoX, Persimmon and BLOOM (dense_h_to_4h,
# dense_4h_to_h), GPT-J and CodeGen (fc_in, fc_out), OPT, Phi, BioGPT and XGLM (fc1,
# fc2), Falcon, MPT, CTRL, GPT-1, and Nemotron, Arcee and Apertus (up_proj, down_proj).
# RefinedWeb* are Falcon's model types from before transformers had FalconConfig.
_NON_GATED = {
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "gpt_neox_japanese",
    "gptj",
    "codegen",
    "opt",
    "bloom",
    "falcon",
    "RefinedWeb",
    "RefinedWebModel",
    "phi",
    "gpt_bigcode",
    "starcoder2",
    "mpt",
    "persimmon",
    "nemotron",
    "arcee",
    "apertus",
    "biogpt",
    "xglm",
    "ctrl",
    "openai-gpt",
}
# Qwen (v1, remote code): QWenMLP's w1 and w2 are intermediate_size // 2 wide each.
_HALVED_INTERMEDIATE = {"qwen"}
# A config without ``tie_word_embeddings`` gets its config class's default. That is
# PretrainedConfig's True (GPT-2, Gemma, Falcon, OPT, BLOOM, ...) except for the classes
# below, whose __init__ defaults it to False.
_UNTIED_BY_DEFAULT = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi",
    "phi3",
    "gpt_neox",
    "gptj",
    "stablelm",
    "olmo",
    "olmo2",
    "granite",
    "granitemoe",
    "dbrx",
    "jamba",
    "nemotron",
    "persimmon",
    "deepseek",
    "deepseek_v2",
    "deepseek_v3",
    "llama4",
    "llama4_text",
    "gpt_oss",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen",
    # ChatGLM's output_layer is its own Linear, never tied to the embedding.
    "chatglm",
}
# Expert counts under the names fit reads (Mixtral, Qwen-MoE, DeepSeek-MoE, Llama 4).
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
# Every other mixture-of-experts field fit knows: read for the layout, or about routing
# and parallelism only (no weights). A field past these that holds a count or a list
# could change the count, so a config with one is refused rather than miscounted.
_MOE_FIELDS_KNOWN = {
    *_EXPERT_COUNTS,
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "moe_layer_freq",
    "moe_layers",
    "interleave_moe_layer_step",
    "num_experts_per_tok",
    "experts_per_token",
    "ep_size",
}
# Where multimodal configs nest the language model's own config (Llava, Gemma 3 and
# Llama 4: text_config; InternVL: llm_config; DeepSeek-VL2: language_config).
_LANGUAGE_CONFIGS = ("text_config", "llm_config", "language_config")
# What a config class fills in where its published config.json leaves a field out
# (transformers' __init__ defaults). A nested text_config is saved without the values
# equal to its class's defaults (transformers' recursive_diff_dict): google/gemma-3-4b-it's
# names only its width, depth and window, llava-hf/llava-1.5-7b-hf's Llama one only its
# vocabulary. Llama and Mistral leave num_key_value_heads and head_dim to be derived.
_LLAMA_7B = {
    "vocab_size": 32_000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
_CLASS_DEFAULTS: dict[str, dict[str, int]] = {
    "llama": {**_LLAMA_7B, "intermediate_size": 11_008},
    "mistral": {
        **_LLAMA_7B,
        "intermediate_size": 14_336,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
    "mixtral": {
        **_LLAMA_7B,
        "intermediate_size": 14_336,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
    },
    "qwen2": {
        **_LLAMA_7B,
        "vocab_size": 151_936,
        "intermediate_size": 22_016,
        "num_key_value_heads": 32,
    },
    "gemma": {
        "vocab_size": 256_000,
        "hidden_size": 3072,
        "intermediate_size": 24_576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
    },
    "gemma2": {
        "vocab_size": 256_000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
    },
    # Llama4TextConfig: chunked attention over 8,192-token chunks (:func:`_chunked_layout`).
    "llama4_text": {"attention_chunk_size": 8192},
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
    },
}
# Nested configs of encoders whose weights load with the language model and count in
# its memory: a vision tower (SigLIP, CLIP, Qwen2-VL's ViT), an audio encoder.
_ENCODER_CONFIG = re.compile(r"(vision|visual|image|audio|speech)\w*config$", re.IGNORECASE)
# Any key that names such a part, whatever its suffix (Phi-3.5-vision's img_processor,
# Phi-4-multimodal's embd_layer, audio_processor, vision_lora, speech_lora): counted when
# it can be sized, refused when not (:func:`_encoder_configs`).
_ENCODER_PART = re.compile(r"vision|visual|image|img|audio|speech|embd_layer", re.IGNORECASE)
# Encoder-only families: bidirectional, no KV cache, two-matrix MLPs (ModernBERT's gated),
# position and token-type tables, by model_type; a ``*ForMaskedLM`` architecture too.
_ENCODER_ONLY = {
    "bert",
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "distilbert",
    "modernbert",
    "camembert",
    "electra",
    "albert",
    "deberta",
    "deberta-v2",
    "mpnet",
    "ernie",
    "nomic_bert",
    "megatron-bert",
    "rembert",
    "roformer",
    "xlm",
    "flaubert",
    "mobilebert",
    "squeezebert",
    "esm",
    "data2vec-text",
    "jina_bert",
}
# Encoder-decoder families: two stacks and cross-attention, and a KV cache of another
# shape, none of which the decoder-only arithmetic models.
_ENCODER_DECODER = {
    "t5",
    "mt5",
    "umt5",
    "longt5",
    "switch_transformers",
    "bart",
    "mbart",
    "pegasus",
    "marian",
    "m2m_100",
    "nllb_moe",
    "led",
    "blenderbot",
    "whisper",
    "speech_to_text",
    "vision-encoder-decoder",
    "encoder-decoder",
}
_SCALE = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# Encoder activations whose MLPs are gated (three matrices): Qwen2.5-VL's ViT.
_GATED_ACTIVATIONS = {"silu", "swiglu"}
_COUNT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMBGT]?)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Architecture:
    """What the arithmetic needs; ``None`` where only a parameter count is known."""

    params: int
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    intermediate: int | None = None
    # The MLP width a token passes through, averaged over the layers, where it is not
    # ``intermediate``: a mixture of experts' routed experts and shared expert (Mixtral:
    # 2 x 14,336). ``None``: ``intermediate``. Sizes the training activations.
    active_intermediate: int | None = None
    tied_embeddings: bool = False
    gated_mlp: bool = True
    # (inner size, how many of them in the whole model) for every MLP, experts included;
    # empty means one MLP of ``intermediate`` per layer.
    mlps: tuple[tuple[int, int], ...] = ()
    name: str | None = None
    # True when the shape was guessed from the parameter count (typical_shape), not read.
    estimated: bool = False
    # Parameters of encoders loaded beside the language model (a vision tower), counted
    # in ``params``; estimated from their configs (:func:`encoder_params`).
    encoder_params: int = 0
    # The dtype the checkpoint stores its weights in, as fit names them, when its config
    # says it is quantised (:func:`stored_dtype`), and how it says so.
    stored_dtype: str | None = None
    stored_as: str | None = None
    # A checkpoint quantised in part (:func:`quantised_in_part`): the bits a quantised
    # weight takes as the format stores it where that is not the dtype's (MXFP4: 4.25),
    # the module groups its ``quantization_config`` leaves unquantised that fit can size
    # (``attention``, ``router``, ``embeddings``, ``lm_head``, ``encoders``), and the
    # names it leaves unquantised that fit cannot place (weighed as quantised: said so).
    stored_bits: float | None = None
    kept_unquantised: tuple[str, ...] = ()
    unplaced_unquantised: tuple[str, ...] = ()
    # Parameters of every layer's attention projections (q, k, v, o) and of the MoE
    # routers, so that a group left unquantised can be weighed at 16 bits.
    attention_params: int = 0
    router_params: int = 0
    # Sliding-window attention (:func:`sliding_layout`): how many layers keep only the
    # last ``window`` tokens of KV cache (0: every layer keeps the whole context).
    sliding_layers: int = 0
    window: int | None = None
    # True when those layers are chunked (Llama 4: each attends within its chunk of
    # ``window`` tokens), not sliding: the same cache, named as the config names it.
    window_chunked: bool = False
    # A window the config names but fit could not place with confidence, and why: the
    # KV cache then counts every layer at the full context (an over-count, said so).
    window_unread: str | None = None
    window_unread_size: int | None = None
    # Layers that keep a KV cache where not every layer does (linear-attention layers and
    # attention-free blocks keep none), and the cache's elements per token over them where
    # a layer's are not 2*kv_heads*head_dim (multi-head latent attention keeps one
    # compressed latent; per-layer head counts differ): ``None`` for the uniform formula.
    kv_layers: int | None = None
    kv_elements: int | None = None
    # Bytes of fixed recurrent state per sequence (linear-attention layers), whatever the
    # context: part of the cache at inference.
    state_bytes: int = 0
    # Sum over every attention projection of (inputs + outputs), where the layers' shapes
    # are not the uniform q/k/v/o (LoRA's adapter size): ``None`` for the formula.
    attention_adapter_width: int | None = None
    # What reading the config wants said in the report (a null read as its default).
    notes: tuple[str, ...] = ()
    # A quantization_config that says the checkpoint is quantised but gives no weight size
    # fit can read (its method): weighed at no dtype without --dtype (refused).
    quantization_unread: str | None = None
    # The longest context the model was built for (max_position_embeddings, n_positions).
    max_positions: int | None = None

    @property
    def kept_params(self) -> int:
        """Parameters the checkpoint leaves unquantised beyond the embeddings and lm_head
        (which :attr:`embedding_params` always weighs at 16 bits)."""
        sizes = {
            "attention": self.attention_params,
            "router": self.router_params,
            "encoders": self.encoder_params,
        }
        return sum(sizes.get(group, 0) for group in self.kept_unquantised)

    @property
    def has_shape(self) -> bool:
        """True when the layer shapes are known (KV cache and activations computable)."""
        return None not in (self.layers, self.hidden, self.kv_heads, self.head_dim, self.vocab)

    @property
    def embedding_params(self) -> int:
        """Input embeddings plus an untied lm_head (0 when the shape is unknown)."""
        if self.vocab is None or self.hidden is None:
            return 0
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def lora_params(self, rank: int) -> int | None:
        """Trainable LoRA parameters with ``rank`` on every attention and MLP projection."""
        if not self.has_shape or self.heads is None or self.intermediate is None:
            return None
        h, d, layers = self.hidden or 0, self.head_dim or 0, self.layers or 0
        q_out, kv_out = (self.heads) * d, (self.kv_heads or 0) * d
        width = self.attention_adapter_width
        if width is None:
            width = ((h + q_out) * 2 + (h + kv_out) * 2) * layers
        mlps = self.mlps or ((self.intermediate, layers),)
        per_mlp = rank * (3 if self.gated_mlp else 2)
        return rank * width + sum(per_mlp * (h + i) * count for i, count in mlps)


# The largest models have a few trillion parameters; a count past this is a typo, and
# the arithmetic after it (floats) would overflow.
MAX_PARAMS = 10**15
# ... and one under this a forgotten unit ("--params 7" for 7B): the smallest models
# anyone fits on a GPU (GPT-2 small, 124M) are a hundred times larger.
MIN_PARAMS = 10**6


def parse_param_count(text: str) -> int:
    """``"8B"`` -> 8_000_000_000; also ``"350M"``, ``"1.5T"``, ``"7000000000"``.

    Decimal multiples (a "7B model" means 7e9 parameters). Raises ``ConfigError``.
    """
    match = _COUNT.fullmatch(text)
    if match is None:
        raise ConfigError(f"--params: expected a count like 8B or 350M, got {text!r}")
    try:
        count = int(Decimal(match[1]) * _SCALE[match[2].upper()])
    except InvalidOperation as err:
        raise ConfigError(f"--params: cannot read {text!r}") from err
    if count <= 0:
        raise ConfigError("--params must be positive")
    if count > MAX_PARAMS:
        raise ConfigError(f"--params: {text!r} is beyond any model (at most 1000T)")
    if count < MIN_PARAMS:
        hint = f"; did you mean {text}B?" if not match[2] else ""
        raise ConfigError(f"--params: {count:,} parameters is not a model (at least 1M){hint}")
    return count


# A config.json is a few KiB (DeciLM's per-layer block_configs: about 50 KiB); reading
# stops past this, so /dev/zero or a log given by mistake fails at once.
MAX_CONFIG_BYTES = 16 * 1024 * 1024


def load_hf_config(path: Path) -> Architecture:
    """:func:`from_hf_config` of a ``config.json`` file. Raises ``ConfigError``."""
    try:
        data = json.loads(_read_config(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read model config {path}: {err}") from err
    except RecursionError:
        raise ConfigError(f"cannot read model config {path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return from_model_config(data, name=_model_name(path, data))


# A Hugging Face cache snapshot folder (a commit hash), or a hash-named checkpoint folder.
_HASH_NAME = re.compile(r"[0-9a-f]{12,64}")


def _model_name(path: Path, config: dict[str, Any] | None = None) -> str:
    """The model's folder for a ``config.json`` (``./config.json`` too: the working
    directory's name), else the file's own stem (``llama3-8b.json``). A folder named by
    a hash says nothing: in the Hugging Face cache
    (``models--ORG--NAME/snapshots/HASH/config.json``) the model is ``ORG/NAME``;
    elsewhere the config's own ``_name_or_path``, else its ``model_type``."""
    if path.name != "config.json":
        return path.stem
    folder = path.absolute().parent
    if not _HASH_NAME.fullmatch(folder.name):
        return folder.name
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    for key in ("_name_or_path", "model_type"):
        value = (config or {}).get(key)
        if isinstance(value, str) and value.strip("/ "):
            value = value.strip().rstrip("/")
            # A local path (where it was saved from) by its last folder; a hub id whole.
            return Path(value).name if value.startswith(("/", ".", "~")) else value
    return folder.name


def _read_config(path: Path) -> str:
    """The text of a regular file of at most :data:`MAX_CONFIG_BYTES` (a FIFO or a device
    would block or never end). Raises ``OSError``, ``UnicodeDecodeError``, ``ConfigError``."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise ConfigError(f"cannot read model config {path}: not a regular file")
    with path.open("rb") as stream:
        raw = stream.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"cannot read model config {path}: larger than {MAX_CONFIG_BYTES >> 20} MiB,"
            " which no config.json is"
        )
    return raw.decode("utf-8")


def from_model_config(config: dict[str, Any], *, name: str | None = None) -> Architecture:
    """The whole model a ``config.json`` describes: its language model (nested under
    ``text_config``, ``llm_config`` or ``language_config`` in multimodal configs, the
    config itself otherwise) plus every encoder whose config sits beside it (a vision
    tower, an audio encoder), whose weights load too. Raises ``ConfigError``."""
    model_type = config.get("model_type")
    if config.get("is_encoder_decoder") is True or model_type in _ENCODER_DECODER:
        raise ConfigError(
            f"model config describes an encoder-decoder model ({model_type or 'unnamed'}),"
            " which fit does not model; use --params with the published parameter count"
        )
    _refuse_encoder_only(config)
    nested = next(
        (config[key] for key in _LANGUAGE_CONFIGS if isinstance(config.get(key), dict)), config
    )
    # A nested language config without its own model_type is read by its model's.
    family = nested.get("model_type") or model_type
    language = nested
    defaulted: list[str] = []
    if isinstance(family, str) and family in _CLASS_DEFAULTS:
        defaults = _CLASS_DEFAULTS[family]
        if nested is config:
            defaulted = _top_level_defaults(config, family, defaults)
        language = {**defaults, **nested}
    arch = from_hf_config(language, name=name, family=family)
    if defaulted:
        note = f"{', '.join(defaulted)}: not in the config, taken from {family}'s class defaults"
        arch = dataclasses.replace(arch, notes=(*arch.notes, note))
    quantization = config.get("quantization_config") or language.get("quantization_config")
    arch = _with_quantization(arch, quantization)
    counted = _encoder_configs(config, nested)
    encoders = sum(
        encoder_params(sub, key=key, output_width=arch.hidden) for key, sub in counted.items()
    )
    # The config's own nested object, not the copy with class defaults filled in: the
    # language model counted is that object (compared by identity below).
    uncounted = _uncounted_model_configs(config, [nested, *counted.values()])
    if uncounted:
        arch = dataclasses.replace(
            arch,
            notes=(
                *arch.notes,
                f"config also describes {', '.join(uncounted)}, which fit does not count: if"
                " its weights load with the model, the count is under by them",
            ),
        )
    if not encoders:
        return arch
    _refuse_absurd(arch.params + encoders)
    return dataclasses.replace(arch, params=arch.params + encoders, encoder_params=encoders)


# The sizes every config.json a model saves at its top level carries (save_pretrained
# leaves out only what equals PretrainedConfig's own defaults, none of these).
_CORE_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _top_level_defaults(config: dict[str, Any], family: str, defaults: dict[str, int]) -> list[str]:
    """The class defaults a top-level config leans on (``num_key_value_heads=8``), for a
    note. A top-level config without a core size was cut short or written by hand
    (only a nested text_config is saved without its class's defaults): refused, as
    filling it in would size another model (Llama-2-7B's 32 layers for a bare llama)."""
    missing = [key for key in _CORE_SIZES if key in defaults and key not in config]
    if missing:
        raise ConfigError(
            f"model config ({family}) lacks {', '.join(missing)}, which every saved"
            " config.json has: it looks cut short; give the model's whole config.json,"
            " or --params with the published parameter count"
        )
    return [f"{key}={value}" for key, value in defaults.items() if key not in config]


def _refuse_encoder_only(config: dict[str, Any]) -> None:
    """Refuse BERT and its kin: an encoder keeps no KV cache, and its MLPs, position and
    token-type tables are not the decoder's (:data:`_ENCODER_ONLY`)."""
    model_type = config.get("model_type")
    names = config.get("architectures")
    masked = isinstance(names, list) and any(
        isinstance(name, str) and name.endswith("ForMaskedLM") for name in names
    )
    if model_type in _ENCODER_ONLY or masked:
        raise ConfigError(
            f"model config describes an encoder-only model ({model_type or 'unnamed'}:"
            " bidirectional, no KV cache), which fit's decoder arithmetic does not model;"
            f" {_USE_PARAMS}"
        )


def _encoder_configs(config: dict[str, Any], language: dict[str, Any]) -> dict[str, Any]:
    """The nested configs of encoders and adapters loaded beside the language model, by
    key. A key named for a vision, image, audio or speech part (:data:`_ENCODER_PART`)
    counts when its object is an encoder config (``vision_config``) or gives a width and
    a layer count; one fit cannot size (Phi-3.5-vision's ``img_processor``, whose CLIP
    tower is named, not described; Phi-4-multimodal's ``embd_layer``, ``audio_processor``
    and its ``vision_lora``/``speech_lora`` adapters) is refused, never left out: it was
    31 % of Phi-4-multimodal."""
    parts = {
        key: sub
        for key, sub in config.items()
        if isinstance(sub, dict) and sub is not language and _ENCODER_PART.search(key)
    }
    unsized = [
        key
        for key, sub in parts.items()
        if not _ENCODER_CONFIG.search(key) and _model_shape(sub) is None
    ]
    if unsized:
        raise ConfigError(
            f"model config's {', '.join(unsized)} describe encoders or adapters that load with"
            " the model but give no width and layer count fit can size; use --params with the"
            " published parameter count"
        )
    return parts


# Widths and layer counts by the names model configs give them: what makes a nested
# object look like a model's config (:func:`_model_shape`).
_WIDTH_NAMES = (
    "embed_dim",
    "hidden_size",
    "width",
    "d_model",
    "n_embd",
    "n_embed",
    "hidden_dim",
    "attention_dim",
)
_DEPTH_NAMES = (
    "num_hidden_layers",
    "depth",
    "num_layers",
    "encoder_layers",
    "n_layer",
    "n_layers",
    "num_blocks",
)


def _model_shape(config: dict[str, Any]) -> tuple[int, int] | None:
    """(width, layers) where a nested object gives both (it then looks like a model's
    config), else ``None``."""
    width = _key(config, *_WIDTH_NAMES, default=0, strict=False)
    layers = _key(config, *_DEPTH_NAMES, default=0, strict=False)
    return (width, layers) if width and layers else None


def _uncounted_model_configs(config: dict[str, Any], counted: list[dict[str, Any]]) -> list[str]:
    """Nested objects, two levels deep, that look like model configs and are neither the
    language model nor an encoder fit counts (DeepSeek-VL2's ``projector_config``, an
    encoder under a name fit does not know): named, with their shape, for a note."""
    found = []
    for key, sub in config.items():
        if not isinstance(sub, dict) or any(sub is c for c in counted):
            continue
        inner = [(f"{key}.{k}", v) for k, v in sub.items() if isinstance(v, dict)]
        for path, value in [(key, sub), *inner]:
            if any(value is c for c in counted) or (shape := _model_shape(value)) is None:
                continue
            found.append(f"{path} (width {shape[0]:,}, {shape[1]} layers)")
    return found


def _refuse_absurd(params: int) -> None:
    """Refuse a count past :data:`MAX_PARAMS` (the float arithmetic after it overflows)."""
    if params > MAX_PARAMS:
        shown = f"{Decimal(params):.3g}"  # a float cannot hold a 400-digit count
        raise ConfigError(f"model config describes {shown} parameters, beyond any model")


def _with_quantization(arch: Architecture, quantization: Any) -> Architecture:
    """``arch`` weighed as its ``quantization_config`` stores it, or marked unread when
    the config says it is quantised but gives no size fit can read."""
    quantized = stored_dtype(quantization)
    if quantized is None:
        unread = _unread_quantization(quantization)
        return dataclasses.replace(arch, quantization_unread=unread) if unread else arch
    bits, kept, unplaced = quantised_in_part(quantization)
    return dataclasses.replace(
        arch,
        stored_dtype=quantized[0],
        stored_as=quantized[1],
        stored_bits=bits or _stored_bits(quantization, arch) or _group_bits(quantization),
        kept_unquantised=kept,
        unplaced_unquantised=unplaced,
    )


# Weight bits by quantisation method where the config names no bits: bitsandbytes says
# load_in_4bit / load_in_8bit; FP8 checkpoints store a byte a weight; gpt-oss's MXFP4 is
# 4 bits and a shared scale per 32.
_METHOD_BITS = {"fp8": 8, "mxfp4": 4, "fbgemm_fp8": 8}


def stored_dtype(quantization: Any) -> tuple[str, str] | None:
    """The dtype fit weighs a quantised checkpoint's weights in (``int8``, ``int4``, or
    ``nf4`` for bitsandbytes' 4-bit), and a description of where it came from, from a
    ``quantization_config``; None when there is none or it names no weight size.

    Fewer than 4 bits (GPTQ's 2 and 3) are weighed as 4: an overestimate, never an
    under-count. int8 and int4 count a byte and half a byte a weight, plus group scales.
    """
    if not isinstance(quantization, dict):
        return None
    method = str(quantization.get("quant_method") or "").lower()
    bits = quantization.get("bits", quantization.get("w_bit"))
    fraction = _fractional_bits(quantization, method)
    if fraction is not None:
        # EXL2's average bits a weight (4.25), AQLM's code bits: weighed at exactly that
        # (:func:`_stored_bits`); named int4 or int8 for the advice.
        return ("int4" if fraction <= 5 else "int8"), f"{method}, {fraction:g} bits a weight"
    if method == "bitsandbytes" or "load_in_4bit" in quantization:
        if quantization.get("load_in_4bit"):
            return "nf4", "bitsandbytes 4-bit"
        if quantization.get("load_in_8bit"):
            return "int8", "bitsandbytes 8-bit"
        return None
    if not isinstance(bits, int) or isinstance(bits, bool):
        # llm-compressor: bits per config group's weights.
        groups = quantization.get("config_groups")
        found = [
            g["weights"].get("num_bits")
            for g in (groups.values() if isinstance(groups, dict) else [])
            if isinstance(g, dict) and isinstance(g.get("weights"), dict)
        ]
        sizes = [b for b in found if isinstance(b, int) and not isinstance(b, bool)]
        bits = max(sizes) if sizes else _METHOD_BITS.get(method)
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        return None
    if bits == 8 and _float_weights(quantization, method):
        return "fp8", f"{method}, 8-bit float"
    described = f"{method or 'quantised'}, {bits}-bit"
    return ("int8", described) if bits > 4 else ("int4", described)


def _float_weights(quantization: dict[str, Any], method: str) -> bool:
    """Whether 8-bit weights are floats (FP8: its method, or llm-compressor's
    ``type: float``), named fp8 rather than int8 (the same byte a weight)."""
    if "fp8" in method:
        return True
    groups = quantization.get("config_groups")
    return any(
        isinstance(g, dict)
        and isinstance(g.get("weights"), dict)
        and g["weights"].get("type") == "float"
        for g in (groups.values() if isinstance(groups, dict) else [])
    )


def _group_bits(quantization: Any) -> float | None:
    """Bits a weight of a GPTQ, AWQ or llm-compressor checkpoint quantised in groups: the
    weight's bits plus, per ``group_size`` weights, an fp16 scale and (GPTQ's qzeros,
    AWQ's zero point, an asymmetric llm-compressor scheme) a zero of the weight's bits.
    g32 4-bit GPTQ is 4.625 bits, g128 4.156; ``group_size: -1`` (one scale a row) is the
    bits alone. ``None`` where the config gives no group size (the dtype's default)."""
    if not isinstance(quantization, dict):
        return None
    method = str(quantization.get("quant_method") or "").lower()
    bits = quantization.get("bits", quantization.get("w_bit"))
    group = quantization.get("group_size", quantization.get("q_group_size"))
    zero = method == "gptq" or (method == "awq" and quantization.get("zero_point", True))
    if not _positive_int(bits):
        groups = quantization.get("config_groups")
        weights = [
            g["weights"]
            for g in (groups.values() if isinstance(groups, dict) else [])
            if isinstance(g, dict) and isinstance(g.get("weights"), dict)
        ]
        if len(weights) != 1:
            return None
        bits, group = weights[0].get("num_bits"), weights[0].get("group_size")
        zero = weights[0].get("symmetric") is False
        if weights[0].get("strategy") == "channel":
            group = -1
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        return None
    if isinstance(group, bool) or not isinstance(group, int):
        return None
    # Weighed at the dtype fit names it (3 bits as int4, 5-7 as int8): over, never under.
    width = 4 if bits <= 4 else 8
    if group == -1:
        return float(width)
    if group <= 0:
        return None
    return width + (16 + (width if zero else 0)) / group


def _fractional_bits(quantization: dict[str, Any], method: str) -> float | None:
    """Bits a weight where the format gives them as a fraction: EXL2's ``bits`` (an
    average such as 4.25), or AQLM's codes, ``num_codebooks * nbits_per_codebook`` bits
    for each ``in_group_size * out_group_size`` weights (1x16 over 8: 2 bits)."""
    if method == "aqlm":
        sizes = [_aqlm_field(quantization, name) for name in _AQLM_FIELDS]
        if None in sizes:
            return None
        codebooks, code_bits, group_in, group_out = (int(v or 0) for v in sizes)
        bits = codebooks * code_bits / (group_in * group_out)
    else:
        value = quantization.get("bits")
        if not isinstance(value, float) or value.is_integer():
            return None
        bits = value
    return bits if 1 <= bits <= 16 else None


_AQLM_FIELDS = ("num_codebooks", "nbits_per_codebook", "in_group_size", "out_group_size")


def _aqlm_field(quantization: dict[str, Any], name: str) -> int | None:
    value = quantization.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 64:
        return value
    return None


def _stored_bits(quantization: Any, arch: Architecture) -> float | None:
    """The bits a quantised weight takes for a format that gives them as a fraction
    (:func:`_fractional_bits`). AQLM adds its codebooks: ``num_codebooks`` tables of
    ``2**nbits_per_codebook`` fp16 groups for each linear layer (1 MiB each for 1x16),
    spread over the quantised weights."""
    if not isinstance(quantization, dict):
        return None
    method = str(quantization.get("quant_method") or "").lower()
    bits = _fractional_bits(quantization, method)
    if bits is None or method != "aqlm":
        return bits
    codebooks, code_bits, group_in, group_out = (
        _aqlm_field(quantization, name) or 0 for name in _AQLM_FIELDS
    )
    per_layer = codebooks * 2**code_bits * group_in * group_out * 16
    linears = (arch.layers or 0) * 4 + sum(
        count * (3 if arch.gated_mlp else 2) for _, count in arch.mlps
    )
    quantised = max(1, arch.params - arch.embedding_params)
    return bits + per_layer * linears / quantised


def _unread_quantization(quantization: Any) -> str | None:
    """The method of a ``quantization_config`` that says the weights are quantised but
    gives no size fit reads (HQQ, EETQ, torchao, a ``bits`` that is not a number); None
    without one, or for one that says they are not (16 bits, bitsandbytes without a
    load_in flag)."""
    if quantization is None or quantization in ({}, []):
        return None
    if not isinstance(quantization, dict):
        return "a quantization_config that is not an object"
    bits = quantization.get("bits")
    if isinstance(bits, int) and not isinstance(bits, bool) and bits >= 16:
        return None
    method = str(quantization.get("quant_method") or "").lower()
    if method == "bitsandbytes" or "load_in_4bit" in quantization:
        return None
    return method or "no quant_method"


# Bits a quantised weight takes where the format fixes them beyond the dtype fit names:
# MXFP4 is 4-bit values with an 8-bit (E8M0) scale shared by each block of 32.
_FORMAT_BITS = {"mxfp4": 4 + 8 / 32}
# Where quantization_config lists the modules it leaves unquantised: transformers'
# modules_to_not_convert (gpt-oss's MXFP4, AWQ, FP8, bitsandbytes as saved),
# bitsandbytes' llm_int8_skip_modules, llm-compressor's ignore, ModelOpt's
# exclude_modules, and ignored_layers.
_UNQUANTISED_LISTS = (
    "modules_to_not_convert",
    "llm_int8_skip_modules",
    "ignore",
    "exclude_modules",
    "ignored_layers",
)
# The module groups fit can size, by the names checkpoints give their modules.
_GROUPS = (
    ("lm_head", re.compile(r"(^|\.)(lm_head|output_layer|embed_out)$")),
    ("embeddings", re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings)$")),
    ("router", re.compile(r"(^|\.)(router|gate|shared_expert_gate)$")),
    ("attention", re.compile(r"(^|\.)(self_attn|attn|attention|[qkvo]_proj|qkv_proj)$")),
    (
        "encoders",
        re.compile(
            r"(^|\.)(vision_tower|vision_model|visual|vision|audio_tower|audio_model"
            r"|multi_modal_projector|mm_projector)$"
        ),
    ),
)
# What a listed name's regex syntax looks like, taken off before matching it
# (llm-compressor's "re:.*self_attn.*", ModelOpt's "model.layers.*.self_attn*").
_REGEX_TAIL = re.compile(r"(\.\*|\*|\$|\.\+)+$")
_REGEX_HEAD = re.compile(r"^(re:)?\^?(\.\*)?")


def quantised_in_part(quantization: Any) -> tuple[float | None, tuple[str, ...], tuple[str, ...]]:
    """How a quantised checkpoint lays its weights out, from its ``quantization_config``:
    the bits a quantised weight takes where the format fixes them (MXFP4: 4.25), the
    module groups it leaves unquantised that fit can size, and the names it leaves
    unquantised that fit cannot place.

    gpt-oss's config leaves ``model.layers.*.self_attn``, ``model.layers.*.mlp.router``,
    ``model.embed_tokens`` and ``lm_head`` in bf16: its MXFP4 covers the experts alone.
    A name is placed by its last component (``self_attn``, ``q_proj``, ``router``,
    ``gate``, ``embed_tokens``, ``lm_head``, a vision tower); one naming a single layer
    is weighed for every layer (over, never under).
    """
    if not isinstance(quantization, dict):
        return None, (), ()
    method = str(quantization.get("quant_method") or "").lower()
    names = [
        name
        for key in _UNQUANTISED_LISTS
        if isinstance(quantization.get(key), list)
        for name in quantization[key]
        if isinstance(name, str) and name
    ]
    kept: list[str] = []
    unplaced: list[str] = []
    for name in names:
        bare = _REGEX_TAIL.sub("", _REGEX_HEAD.sub("", name.strip()))
        bare = bare.replace("\\.", ".")
        group = next((g for g, pattern in _GROUPS if pattern.search(bare)), None)
        if group is None:
            unplaced.append(name)
        elif group not in kept:
            kept.append(group)
    return _FORMAT_BITS.get(method), tuple(kept), tuple(unplaced)


def encoder_params(config: dict[str, Any], *, key: str, output_width: int | None) -> int:
    """Parameters of a transformer encoder from its nested config (``key``): per layer
    ``4*w*w`` attention, ``2*w*i`` MLP (``3*w*i`` gated), ``4*w`` norms; its patch and
    position embeddings where the config gives patch and image sizes; and a projection
    from its width to the language model's. An estimate: projectors of two layers, and
    biases, are left out (under 1 % of a 2B model's count for the towers published).

    The width is ``embed_dim`` before ``hidden_size``: Qwen2-VL's vision config names
    its ViT's width ``embed_dim`` and the language model's ``hidden_size``.
    """
    width = _key(
        config, "embed_dim", "hidden_size", "width", "d_model", "n_embd", default=0, strict=False
    )
    layers = _key(
        config,
        *("num_hidden_layers", "depth", "num_layers", "encoder_layers", "n_layer"),
        default=0,
        strict=False,
    )
    if not width or not layers:
        raise ConfigError(
            f"model config's {key} describes an encoder fit cannot size (no width or layer"
            " count); use --params with the published parameter count"
        )
    ratio = config.get("mlp_ratio")
    inner = _key(
        config,
        "intermediate_size",
        "encoder_ffn_dim",
        "ffn_dim",
        default=round(ratio * width)
        if isinstance(ratio, int | float) and not isinstance(ratio, bool) and ratio > 0
        else 4 * width,
        strict=False,
    )
    gated = config.get("hidden_act") in _GATED_ACTIVATIONS or config.get("model_type") == "pixtral"
    per_layer = 4 * width * width + (3 if gated else 2) * width * inner + 4 * width
    patch = _key(config, "patch_size", default=0, strict=False)
    image = _key(config, "image_size", default=0, strict=False)
    embeddings = (
        patch * patch * _key(config, "num_channels", default=3, strict=False) * width
        if patch
        else 0
    )
    if patch and image:
        embeddings += (image // patch) ** 2 * width
    return layers * per_layer + embeddings + width * (output_width or width)


# Fields whose null transformers' config classes read as "derive it": head_dim (hidden
# / heads), GPT-2's n_inner (4 x hidden), Qwen-MoE's mlp_only_layers (none), and the
# expert counts (DeepseekV2Config's n_routed_experts=None is a dense model). A null
# elsewhere (DeciLM's intermediate_size, which varies per layer) is no size at all, and
# is refused rather than read as a default that changes the answer. num_key_value_heads'
# null is one per attention head, as every config class reads it, and is said so.
_NULL_MEANS_DEFAULT = {
    "head_dim",
    "n_inner",
    "num_key_value_heads",
    "q_lora_rank",
    *_EXPERT_COUNTS,
}


def _key(
    config: dict[str, Any], *names: str, default: int | None = None, strict: bool = True
) -> int:
    """The first of ``names`` the config has, as a positive integer, else ``default``.

    ``strict``: a field that is there but null (outside :data:`_NULL_MEANS_DEFAULT`),
    zero, negative or not an integer is refused, never passed over for the default: a
    ``num_key_value_heads`` of 0 read as "one per head" changed the answer silently.
    """
    for name in names:
        if name not in config:
            continue
        value = config[name]
        if _positive_int(value):
            return int(value)
        if not strict or (value is None and name in _NULL_MEANS_DEFAULT):
            continue
        raise ConfigError(
            f"model config's {name!r} is {_shown(value)}, not a positive integer;"
            " use --params with the published parameter count"
        )
    if default is not None:
        return default
    raise ConfigError(f"model config lacks a positive integer {names[0]!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _shown(value: Any) -> str:
    """A config value for an error line, cut short (a 400-digit number, a long list)."""
    text = json.dumps(value) if isinstance(value, str | type(None)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(config: dict[str, Any], name: str, default: int) -> int:
    """A non-negative integer field (``first_k_dense_replace`` may be 0)."""
    value = config.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return default


def _kv_heads(config: dict[str, Any], heads: int) -> int:
    """KV heads, as transformers' Falcon and GPT-BigCode attention and ChatGLM's remote
    code read them.

    ``multi_query`` means one KV head (Falcon-7B, StarCoder), unless Falcon's
    ``new_decoder_architecture`` (40B, 180B) says to use ``num_kv_heads`` instead.
    FalconConfig defaults ``multi_query`` to True; the RefinedWeb remote code used
    ``n_head_kv``. ChatGLM (GLM-4, ChatGLM2/3): ``multi_query_attention`` with
    ``multi_query_group_num`` KV heads (default 1), else one per head. A count that is
    not a divisor of the heads is refused, as the attention's reshape would be.
    """
    if config.get("multi_query_attention") is True:
        kv_heads = _key(config, "multi_query_group_num", default=1)
    elif config.get("multi_query", config.get("model_type") == "falcon") is True and not (
        config.get("new_decoder_architecture")
    ):
        kv_heads = 1
    else:
        kv_heads = _key(config, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
    if kv_heads > heads or heads % kv_heads:
        raise ConfigError(
            f"model config has {kv_heads} KV heads for {heads} attention heads, which do not"
            " divide them; use --params with the published parameter count"
        )
    return kv_heads


def _tied(config: dict[str, Any]) -> bool:
    value = config.get("tie_word_embeddings")
    if isinstance(value, bool):
        return value
    return config.get("model_type") not in _UNTIED_BY_DEFAULT


# Layer kinds the formula models: attention over the whole context, a window of it, or
# chunks of it (Gemma 2/3, Mistral, Llama 4 list them in ``layer_types``).
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
# Fields of state-space and other recurrent layers (Mamba, Jamba, Zamba, Nemotron-H,
# RecurrentGemma, RWKV, and vLLM's and Jamba's ``layers_block_type``): layers the
# formula would count as attention.
_RECURRENT_FIELDS = re.compile(
    r"^(mamba_|ssm_|rwkv|conv_kernel|d_state$|state_size$|time_step|attn_layer_period$"
    r"|attn_layer_offset$|hybrid_override_pattern$|block_types$|layers_block_type$"
    r"|lru_width$|linear_)"
)
# What the refusals of models fit does not model suggest, honest about what --params
# then estimates: a typical decoder's KV cache, every layer attention.
_USE_PARAMS = (
    "use --params with the published parameter count (its KV cache is then a typical"
    " decoder's, every layer attention: an over-count for this model)"
)


def _layer_kinds(config: dict[str, Any]) -> list[str] | None:
    """``layer_types`` as a list of names (``None`` without one); refused when it is
    not a list of strings (a string, objects, nested lists)."""
    kinds = config.get("layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, list) or not all(isinstance(kind, str) for kind in kinds):
        raise ConfigError(
            f"model config's 'layer_types' is {_shown(kinds)}, not a list of layer kinds;"
            " use --params with the published parameter count"
        )
    return kinds


def _refuse_unmodelled(config: dict[str, Any], experts: int) -> None:
    """Refuse what the formula would silently get wrong, rather than miscount it."""
    kinds = _layer_kinds(config) or []
    other = sorted({kind for kind in kinds if kind not in _ATTENTION_LAYERS})
    recurrent = sorted(key for key in config if _RECURRENT_FIELDS.match(key))
    if other or recurrent:
        what = ", ".join(other) if other else ", ".join(recurrent)
        raise ConfigError(
            f"model config has layers that are not attention ({what}: a state-space,"
            " recurrent or linear-attention hybrid), whose weights and state fit does not"
            f" model; {_USE_PARAMS}"
        )
    # An expert count under another name would be counted as one dense MLP per layer;
    # a layout field fit does not read (which layers have experts, how wide, how many
    # shared) would miscount the experts it does read.
    moe_fields = sorted(
        key
        for key, value in config.items()
        if ("expert" in key.lower() or "moe" in key.lower())
        and (experts == 1 or key not in _MOE_FIELDS_KNOWN)
        and (_count(config, key, 0) > 1 or (isinstance(value, list) and value))
    )
    if moe_fields:
        counted = " or ".join(repr(name) for name in _EXPERT_COUNTS)
        unread = ", ".join(moe_fields)
        raise ConfigError(
            f"model config has mixture-of-experts fields fit does not read ({unread})"
            + ("" if experts > 1 else f" and no {counted}")
            + "; use --params with the published parameter count"
        )


# Sliding-window attention, as transformers' config classes lay it out (their
# configuration_*.py) and its caches keep it (a sliding layer's cache holds the last
# ``sliding_window`` tokens):
# * ``layer_types`` in the config, when there is one, names each layer's kind;
# * Gemma 2 and gpt-oss alternate, sliding first (layer i slides unless (i + 1) % 2 == 0);
# * Gemma 3 and Cohere2 slide unless (i + 1) % sliding_window_pattern == 0 (Gemma 3's
#   default pattern 6, five local to one global; Cohere2's 4);
# * Mistral, Mixtral, Phi-3 and Starcoder2 apply the window to every layer;
# * Qwen2 and Qwen3 only with ``use_sliding_window`` (default false, when the window is
#   ignored), and then on the layers from ``max_window_layers`` on (default 28).
_ALTERNATING = {"gemma2": None, "gpt_oss": None, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_WINDOW_ON_EVERY_LAYER = {"mistral", "mixtral", "phi3", "starcoder2"}
_MAX_WINDOW_LAYERS = {"qwen2": 28, "qwen3": 28}
# Families whose config class ignores sliding_window unless use_sliding_window is true
# (its default is false in each of them).
_USE_SLIDING_WINDOW = {
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen2_vl_text",
    "qwen2_5_vl_text",
}


@dataclass(frozen=True)
class SlidingLayout:
    """Which layers keep only a window of the context (:func:`sliding_layout`)."""

    sliding_layers: int = 0
    window: int | None = None
    chunked: bool = False
    # A window named but not placed with confidence (every layer then counts the full
    # context), why, and its size (the note matters only for longer contexts).
    unread: str | None = None
    unread_size: int | None = None


def sliding_layout(config: dict[str, Any], layers: int, family: Any = None) -> SlidingLayout:
    """How many of ``layers`` hold only ``sliding_window`` tokens of KV cache.

    ``layer_types`` wins when the config has it; otherwise each family's rule (above).
    A family whose rule fit does not know, a ``layer_types`` of the wrong length, or
    chunked attention (Llama 4) keeps the full count for every layer, and says so.
    """
    family = str(family or config.get("model_type") or "")
    window = config.get("sliding_window")
    if family in _USE_SLIDING_WINDOW and config.get("use_sliding_window") is not True:
        return SlidingLayout()  # transformers sets the window to None: full attention
    chunk = _count(config, "attention_chunk_size", 0)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        kinds = config.get("layer_types")
        if isinstance(kinds, list) and "sliding_attention" in kinds:
            return SlidingLayout(
                unread="layer_types lists sliding layers but the config gives no"
                " sliding_window: every layer is counted at the full context"
            )
        return _chunked_layout(config, layers, chunk, family) if chunk else SlidingLayout()
    kinds = config.get("layer_types")
    if isinstance(kinds, list):
        if len(kinds) != layers:
            return SlidingLayout(
                unread=f"layer_types lists {len(kinds)} layers for {layers}: every layer is"
                " counted at the full context",
                unread_size=window,
            )
        sliding = sum(1 for kind in kinds if kind == "sliding_attention")
        return SlidingLayout(sliding, window if sliding else None)
    if family in _ALTERNATING:
        default = _ALTERNATING[family]
        pattern = 2
        if default is not None:
            pattern = _key(
                config, "sliding_window_pattern", "_sliding_window_pattern", default=default
            )
        sliding = sum(1 for i in range(layers) if (i + 1) % pattern)
        return SlidingLayout(sliding, window if sliding else None)
    if family in _WINDOW_ON_EVERY_LAYER:
        return SlidingLayout(layers, window)
    if family in _MAX_WINDOW_LAYERS:
        first = _count(config, "max_window_layers", _MAX_WINDOW_LAYERS[family])
        sliding = max(0, layers - first)
        return SlidingLayout(sliding, window if sliding else None)
    return SlidingLayout(
        unread=f"sliding_window {window} in a {family or 'unnamed'} config, whose layers fit"
        " cannot tell apart: every layer is counted at the full context (an over-count"
        " if some of them slide)",
        unread_size=window,
    )


def _chunked_layout(config: dict[str, Any], layers: int, chunk: int, family: str) -> SlidingLayout:
    """Chunked attention (Llama 4's ``attention_chunk_size``): a chunked layer attends
    within its chunk of ``chunk`` tokens, so its cache holds at most that many, as a
    sliding window's does. Which layers are chunked is transformers' Llama4TextConfig
    rule: ``layer_types`` when given (``chunked_attention``), else ``no_rope_layers``
    (1: a RoPE layer, chunked; 0: a NoPE layer, full attention), else, when that list is
    empty or absent, every layer but each ``no_rope_layer_interval``-th (default 4)."""
    kinds = _layer_kinds(config)
    if kinds is None:
        kinds = _rope_layer_kinds(config, layers, family)
    if kinds is None or len(kinds) != layers:
        return SlidingLayout(
            unread=f"attention_chunk_size {chunk}: fit cannot tell which layers are chunked"
            " (no layer_types or no_rope_layers for its layers): every layer is counted at"
            " the full context (an over-count)",
            unread_size=chunk,
        )
    chunked = sum(1 for kind in kinds if kind in ("chunked_attention", "sliding_attention"))
    return SlidingLayout(chunked, chunk if chunked else None, chunked=chunked > 0)


def _rope_layer_kinds(config: dict[str, Any], layers: int, family: str) -> list[str] | None:
    """Llama 4's layer kinds from ``no_rope_layers``, or from ``no_rope_layer_interval``
    for a Llama 4 config whose list is empty or absent; ``None`` otherwise."""
    flags = config.get("no_rope_layers")
    if isinstance(flags, list) and flags:
        if not all(flag in (0, 1) and not isinstance(flag, float) for flag in flags):
            raise ConfigError(
                f"model config's 'no_rope_layers' is {_shown(flags)}, not a 0 or 1 for each"
                f" layer; {_USE_PARAMS}"
            )
        return ["chunked_attention" if flag else "full_attention" for flag in flags]
    if not family.startswith("llama4") and "no_rope_layer_interval" not in config:
        return None
    every = _key(config, "no_rope_layer_interval", default=4)
    return [
        "chunked_attention" if (index + 1) % every else "full_attention" for index in range(layers)
    ]


def _int_list(config: dict[str, Any], name: str) -> list[int]:
    """A list of layer indices (``moe_layers``, ``mlp_only_layers``); null is none, and
    anything else that is not a list of integers is refused."""
    value = config.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        raise ConfigError(
            f"model config's {name!r} is {_shown(value)}, not a list of layer numbers;"
            " use --params with the published parameter count"
        )
    return value


def _moe_layers(config: dict[str, Any], layers: int) -> int:
    """How many layers have experts (every layer for Mixtral).

    Qwen-MoE: not in ``mlp_only_layers`` and every ``decoder_sparse_step``-th layer.
    DeepSeek-MoE: from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer.
    Llama 4: the layers listed in ``moe_layers``, or by default every
    ``interleave_moe_layer_step``-th (Scout: all of them; Maverick: every second).
    A step of 0 is refused (transformers divides by it).
    """
    if listed := set(_int_list(config, "moe_layers")):
        return sum(1 for index in range(layers) if index in listed)
    if (every_nth := _key(config, "interleave_moe_layer_step", default=1)) > 1:
        return sum(1 for index in range(layers) if (index + 1) % every_nth == 0)
    dense_only = set(_int_list(config, "mlp_only_layers"))
    step = _key(config, "decoder_sparse_step", default=1)
    first = _count(config, "first_k_dense_replace", 0)
    every = _key(config, "moe_layer_freq", default=1)
    return sum(
        1
        for index in range(layers)
        if index not in dense_only and (index + 1) % step == 0 and index >= first
        if index % every == 0
    )


def _expert_count(config: dict[str, Any]) -> int:
    """Experts per MoE layer; 1 for a dense model (no count, or a null or 0 one)."""
    given = {key: config[key] for key in _EXPERT_COUNTS if config.get(key) not in (None, 0)}
    return _key(given, *_EXPERT_COUNTS, default=1)


def _mlps(
    config: dict[str, Any], layers: int, hidden: int, intermediate: int
) -> tuple[tuple[tuple[int, int], ...], int, int | None]:
    """Every MLP as (inner size, count), the router and gate parameters, and the MLP
    width a token passes through averaged over the layers (``None`` when dense)."""
    experts = _expert_count(config)
    _refuse_unmodelled(config, experts)
    if experts == 1:
        return ((intermediate, layers),), 0, None
    sparse = _moe_layers(config, layers)
    # Mixtral's and Llama 4's experts are intermediate_size wide; Qwen-MoE's and
    # DeepSeek's are not. Llama 4's dense layers are intermediate_size_mlp wide.
    expert_size = _key(config, "moe_intermediate_size", default=intermediate)
    dense_size = _key(config, "intermediate_size_mlp", default=intermediate)
    mlps = [(dense_size, layers - sparse), (expert_size, experts * sparse)]
    routers = hidden * experts * sparse
    if shared := _count(config, "shared_expert_intermediate_size", 0):
        mlps.append((shared, sparse))  # Qwen-MoE: one shared expert, with a 1-output gate
        routers += hidden * sparse
    elif shared_experts := _count(config, "n_shared_experts", 0):
        # DeepSeek: the shared experts are one MLP, n_shared_experts times as wide.
        mlps.append((expert_size * shared_experts, sparse))
    elif str(config.get("model_type", "")).startswith("llama4"):
        # Llama 4: every expert layer has one shared expert, as wide as an expert, and
        # its config has no field that says so.
        mlps.append((expert_size, sparse))
    # A token goes through its top-k experts and the shared ones (mlps[2:]) in each MoE
    # layer; a config without a top-k is read as one.
    routed = _key(config, "num_experts_per_tok", "experts_per_token", default=1, strict=False)
    per_sparse = routed * expert_size + sum(size for size, _ in mlps[2:])
    active = round((dense_size * (layers - sparse) + per_sparse * sparse) / layers)
    return tuple((size, count) for size, count in mlps if count), routers, active


# Families whose config class makes an MLP 4 x hidden when the config gives no width
# (GPT2Config's n_inner=None, FalconConfig's ffn_hidden_size=None, GPTNeoConfig's
# intermediate_size=None, BLOOM's and GPT-1's fixed 4 x hidden).
_MLP_4H_BY_DEFAULT = {
    "gpt2",
    "gpt_neo",
    "gptj",
    "codegen",
    "gpt_bigcode",
    "bloom",
    "falcon",
    "RefinedWeb",
    "RefinedWebModel",
    "openai-gpt",
}
# Where configs give the MLP width: Phi-3-small names it ff_intermediate_size (its
# gegelu up_proj is 2 x that wide, a gated MLP of it).
_INTERMEDIATE_NAMES = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "ffn_hidden_size",
    "ff_intermediate_size",
)


def _intermediate(config: dict[str, Any], hidden: int, family: str) -> tuple[int, tuple[str, ...]]:
    """The MLP width and a note where it is not the config's own: 4 x hidden only where
    the config class makes it so (said so); a config of another family without a width
    is refused, never given a default that changes the count."""
    if any(config.get(name) is not None for name in _INTERMEDIATE_NAMES):
        size = _key(config, *_INTERMEDIATE_NAMES)
        return (size // 2 if family in _HALVED_INTERMEDIATE else size), ()
    for name in _INTERMEDIATE_NAMES:
        _key(config, name, default=1)  # a null outside _NULL_MEANS_DEFAULT is refused
    if family not in _MLP_4H_BY_DEFAULT:
        raise ConfigError(
            "model config gives no MLP width (intermediate_size or another name fit reads)"
            f" and fit does not know its config class's default ({family or 'no model_type'});"
            " use --params with the published parameter count"
        )
    return 4 * hidden, (
        f"MLP width {4 * hidden:,} (4 x hidden): the config gives none, and that is its"
        f" config class's default ({family})",
    )


@dataclass(frozen=True)
class _Attention:
    """Every layer's attention, as :func:`from_hf_config` sums it: its parameters, the
    layer norms' (outside the attention module, so never in a kept-unquantised
    ``self_attn``), its KV cache (:class:`Architecture`'s ``kv_layers``, ``kv_elements``
    and ``state_bytes``; ``None``: the uniform formula) and LoRA width."""

    params: int
    norms: int
    kv_layers: int | None = None
    kv_elements: int | None = None
    state_bytes: int = 0
    adapter_width: int | None = None
    kv_heads: int | None = None


def _attention(
    config: dict[str, Any], layers: int, hidden: int, heads: int, head_dim: int
) -> _Attention:
    """q, k, v, o for every layer, or the layout a config names instead of it:
    multi-head latent attention (``kv_lora_rank``), MiniMax's ``attn_type_list``."""
    if "kv_lora_rank" in config:
        return _latent_attention(config, layers, hidden, heads)
    kv_heads = _kv_heads(config, heads)
    if "attn_type_list" in config:
        return _lightning_attention(config, layers, hidden, heads, kv_heads, head_dim)
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    return _Attention(layers * per_layer, layers * 2 * hidden, kv_heads=kv_heads)


def _latent_attention(config: dict[str, Any], layers: int, hidden: int, heads: int) -> _Attention:
    """DeepSeek-V2/V3's multi-head latent attention, as their modelling code builds it:
    q from ``q_lora_rank`` (null: one h x n*(nope+rope) projection), ``kv_a_proj`` to the
    ``kv_lora_rank`` latent plus the shared rope key, ``kv_b_proj`` from the latent to
    every head's key and value, and ``o_proj``. The cache keeps the latent and the rope
    key, ``kv_lora_rank + qk_rope_head_dim`` elements a token a layer, as vLLM stores it
    (DeepSeek-V2-Lite: 576 x 27 layers x 2 bytes = 31,104 bytes a token)."""
    rank = _key(config, "kv_lora_rank")
    rope = _key(config, "qk_rope_head_dim")
    q_width = heads * (_key(config, "qk_nope_head_dim") + rope)
    kv_width = heads * (_key(config, "qk_nope_head_dim") + _key(config, "v_head_dim"))
    out_width = heads * _key(config, "v_head_dim")
    q_rank = _key(config, "q_lora_rank", default=0)
    # (inputs, outputs) of every projection; q_a's norm and kv_a's norm are the ranks.
    shapes = [(hidden, rank + rope), (rank, kv_width), (out_width, hidden)]
    shapes += [(hidden, q_rank), (q_rank, q_width)] if q_rank else [(hidden, q_width)]
    per_layer = sum(i * o for i, o in shapes) + rank + q_rank
    return _Attention(
        layers * per_layer,
        layers * 2 * hidden,
        kv_layers=layers,
        kv_elements=layers * (rank + rope),
        adapter_width=layers * sum(i + o for i, o in shapes),
        kv_heads=_key(config, "num_key_value_heads", default=heads),
    )


def _lightning_attention(
    config: dict[str, Any], layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int
) -> _Attention:
    """MiniMax-Text-01 and M1: ``attn_type_list`` marks each layer softmax attention (1,
    q/k/v/o with a KV cache) or lightning linear attention (0: ``qkv_proj``,
    ``output_gate`` and ``out_proj`` over heads x head_dim, no KV cache, and a fixed
    heads x head_dim x head_dim fp32 state a sequence whatever the context)."""
    kinds = config["attn_type_list"]
    if (
        not isinstance(kinds, list)
        or len(kinds) != layers
        or not all(kind in (0, 1) and not isinstance(kind, bool) for kind in kinds)
    ):
        raise ConfigError(
            f"model config's 'attn_type_list' is {_shown(kinds)}, not a 0 or 1 for each of"
            f" its {layers} layers; {_USE_PARAMS}"
        )
    softmax = sum(1 for kind in kinds if kind == 1)
    linear = layers - softmax
    inner, kv = heads * head_dim, kv_heads * head_dim
    gqa = (2 * hidden * inner + 2 * hidden * kv, (hidden + inner) * 2 + (hidden + kv) * 2)
    lightning = (5 * hidden * inner + inner, (hidden + 3 * inner) + (hidden + inner) * 2)
    return _Attention(
        softmax * gqa[0] + linear * lightning[0],
        layers * 2 * hidden,
        kv_layers=softmax,
        state_bytes=linear * heads * head_dim * head_dim * 4,
        adapter_width=softmax * gqa[1] + linear * lightning[1],
        kv_heads=kv_heads,
    )


# DeciLM block fields fit reads; one of the others set (a window, sink tokens, sparsity)
# changes the layer in a way the count does not follow.
_BLOCK_FIELDS = {"n_heads_in_group", "no_op", "replace_with_linear", "ffn_mult"}


def _blocks(
    config: dict[str, Any], layers: int, hidden: int, heads: int, head_dim: int
) -> tuple[_Attention, tuple[tuple[int, int], ...], int]:
    """DeciLM / Llama-Nemotron NAS (``block_configs``): each layer has its own attention
    (``n_heads_in_group`` query heads per KV head, or ``no_op``: none, or
    ``replace_with_linear``: one h x h matrix) and its own gated MLP of
    ``ffn_mult`` (DeciLM's _ffn_mult_to_intermediate_size: 2/3 x ffn_mult x h, up to a
    multiple of 256), so the top-level num_key_value_heads and intermediate_size are
    null. Returns the attention, the MLPs and the h x h linear layers' parameters."""
    blocks = config["block_configs"]
    if not isinstance(blocks, list) or len(blocks) != layers:
        given = f"{len(blocks)} blocks" if isinstance(blocks, list) else _shown(blocks)
        raise ConfigError(
            f"model config's 'block_configs' is {given} for {layers} layers, not one block"
            " a layer; use --params with the published parameter count"
        )
    params = norms = width = kv_elements = kv_layers = linear = max_kv = 0
    sizes: Counter[int] = Counter()
    for block in blocks:
        attention, ffn = _block_parts(block)
        if attention.get("replace_with_linear") is True:
            linear += hidden * hidden + hidden
        elif attention.get("no_op") is not True:
            group = _key(attention, "n_heads_in_group")
            kv_heads = heads // group
            if kv_heads * group != heads:
                raise ConfigError(
                    f"model config's block n_heads_in_group {group} does not divide its"
                    f" {heads} heads; use --params with the published parameter count"
                )
            inner, kv = heads * head_dim, kv_heads * head_dim
            params += 2 * hidden * inner + 2 * hidden * kv
            norms += hidden
            width += (hidden + inner) * 2 + (hidden + kv) * 2
            kv_layers += 1
            kv_elements += 2 * kv
            max_kv = max(max_kv, kv_heads)
        if ffn.get("replace_with_linear") is True:
            linear += hidden * hidden + hidden
        elif ffn.get("no_op") is not True:
            sizes[_ffn_mult_size(ffn, hidden)] += 1
            norms += hidden
    return (
        _Attention(
            params,
            norms,
            kv_layers=kv_layers,
            kv_elements=kv_elements,
            adapter_width=width,
            kv_heads=max_kv or heads,
        ),
        tuple(sorted(sizes.items())),
        linear,
    )


def _block_parts(block: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DeciLM block's attention and ffn configs; refused where it sets what fit does
    not model."""
    found = [block.get(part) if isinstance(block, dict) else None for part in ("attention", "ffn")]
    parts = [part for part in found if isinstance(part, dict)]
    unmodelled = sorted(
        key
        for part in parts
        for key, value in part.items()
        if key not in _BLOCK_FIELDS and value not in (None, False)
    )
    if len(parts) != len(found) or unmodelled:
        what = ", ".join(unmodelled) or "a block that is not {attention, ffn}"
        raise ConfigError(
            f"model config's block_configs have {what}, which fit does not model;"
            " use --params with the published parameter count"
        )
    return parts[0], parts[1]


def _ffn_mult_size(ffn: dict[str, Any], hidden: int) -> int:
    mult = ffn.get("ffn_mult")
    if not isinstance(mult, int | float) or isinstance(mult, bool) or not 0 < mult < 1000:
        raise ConfigError(
            f"model config's block ffn_mult is {_shown(mult)}, not a positive number;"
            " use --params with the published parameter count"
        )
    size = int(2 * mult * hidden / 3)
    return -(-size // 256) * 256


def _required(config: dict[str, Any], *names: str) -> int:
    """A size every decoder config gives; its absence names the model type."""
    if any(name in config for name in names):
        return _key(config, *names)
    kind = config.get("model_type")
    raise ConfigError(
        f"model config lacks a positive integer {names[0]!r}"
        f"{f' ({kind})' if isinstance(kind, str) else ''}: fit reads the configs of"
        " decoder-only transformers (Llama, Mistral, Qwen, Gemma, GPT-2, Falcon and"
        " their kin); use --params with the published parameter count"
    )


def from_hf_config(
    config: dict[str, Any], *, name: str | None = None, family: Any = None
) -> Architecture:
    """The architecture a Hugging Face config describes, parameters computed from it.

    Reads ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: = heads; ``multi_query``, ``num_kv_heads`` and
    ``n_head_kv`` for Falcon and GPT-BigCode, ``multi_query_group_num`` for ChatGLM),
    ``head_dim`` (``kv_channels``; default: hidden/heads), ``vocab_size``
    (``padded_vocab_size`` first), ``intermediate_size`` (:func:`_intermediate`), ``tie_word_embeddings``
    (default: the config class's, as transformers applies it), and the mixture-of-experts
    fields of Mixtral, Qwen-MoE and DeepSeek-MoE; GPT-2 and ChatGLM names too; the
    layouts :func:`_attention` and :func:`_blocks` read; and which layers attend through a
    sliding window (:func:`sliding_layout`, by ``family``: the config's model_type, or its
    model's for a nested language config without one). Raises ``ConfigError`` when a
    required field is missing or the config describes something the formula would
    miscount.
    """
    family = str(family or config.get("model_type") or "")
    layers = _required(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _required(config, "hidden_size", "n_embd", "d_model")
    heads = _required(config, "num_attention_heads", "n_head")
    vocab = _required(config, "padded_vocab_size", "vocab_size")
    if "head_dim" not in config and heads > hidden:
        raise ConfigError(f"model config has more attention heads ({heads}) than hidden units")
    head_dim = _key(config, "head_dim", "kv_channels", default=hidden // heads)
    notes: tuple[str, ...] = ()
    linear = 0
    if "block_configs" in config:
        attention, mlps, linear = _blocks(config, layers, hidden, heads, head_dim)
        _refuse_unmodelled(config, _expert_count(config))
        routers, intermediate = 0, max(size for size, _ in mlps) if mlps else hidden
        active = None
    else:
        intermediate, notes = _intermediate(config, hidden, family)
        mlps, routers, active = _mlps(config, layers, hidden, intermediate)
        attention = _attention(config, layers, hidden, heads, head_dim)
        if "num_key_value_heads" in config and config["num_key_value_heads"] is None:
            notes += (
                "num_key_value_heads is null: read as one KV head per attention head,"
                " as transformers' config classes read it",
            )
    gated = family not in _NON_GATED
    tied = _tied(config)
    mlp = sum(hidden * size * (3 if gated else 2) * count for size, count in mlps)
    embeddings = vocab * hidden * (1 if tied else 2)
    params = attention.params + attention.norms + linear + mlp + routers + embeddings + hidden
    _refuse_absurd(params)
    sliding = sliding_layout(config, layers, family)
    return Architecture(
        params=params,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=attention.kv_heads or heads,
        head_dim=head_dim,
        vocab=vocab,
        intermediate=intermediate,
        active_intermediate=active,
        tied_embeddings=tied,
        gated_mlp=gated,
        mlps=mlps,
        name=name,
        attention_params=attention.params,
        router_params=routers,
        sliding_layers=sliding.sliding_layers,
        window=sliding.window,
        window_chunked=sliding.chunked,
        window_unread=sliding.unread,
        window_unread_size=sliding.unread_size,
        kv_layers=attention.kv_layers,
        kv_elements=attention.kv_elements,
        state_bytes=attention.state_bytes,
        attention_adapter_width=attention.adapter_width,
        notes=notes,
        max_positions=_max_positions(config),
    )


def _max_positions(config: dict[str, Any]) -> int | None:
    """The longest context the config names (``max_position_embeddings``; GPT-2's
    ``n_positions``, ``n_ctx``; ``seq_length``), ``None`` without one. A ``rope_scaling``
    ``factor`` stretches it where the config still names the trained length (Qwen's YaRN:
    32,768 x 4); Llama 3.1's already names the stretched one (131,072 over 8,192)."""
    found = next(
        (config[name] for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
         if _positive_int(config.get(name))),
        None,
    )  # fmt: skip
    if found is None:
        return None
    scaling = config.get("rope_scaling")
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if isinstance(factor, int | float) and not isinstance(factor, bool) and 1 < factor < 1e4:
        original = scaling.get("original_max_position_embeddings") if scaling else None
        if not _positive_int(original) or found <= original:
            return int(found * factor)
    return int(found)


# A typical dense decoder (Llama 2/3, Mistral, Qwen 2.5 proportions), for estimates.
TYPICAL_HEAD_DIM = 128
TYPICAL_ASPECT = 128  # hidden / layers: Llama-3 8B 128, Llama-2 13B 128, 70B 102, 405B 130
TYPICAL_QUERY_PER_KV = 4  # Llama-3 8B: 32 query heads share 8 KV heads
TYPICAL_VOCAB = 128_256  # Llama 3
TYPICAL_MLP_RATIO = 3.5  # Llama-3: 14336 / 4096
# What published decoders span; each estimate is repeated over these for its range.
ASPECT_RANGE = (80, 160)  # Qwen2.5-32B 80 (5120/64) .. Falcon-40B 136, GPT-3 128
QUERY_PER_KV_RANGE = (1, 8)  # multi-head (Llama-2 7B) .. GQA-8 (Llama-3 70B)
VOCAB_RANGE = (32_000, 256_000)  # Llama-2 / Mistral .. Gemma
_SOLVE_ITERATIONS = 8


def typical_shape(
    params: int,
    *,
    aspect: int = TYPICAL_ASPECT,
    query_per_kv: int = TYPICAL_QUERY_PER_KV,
    vocab: int = TYPICAL_VOCAB,
) -> Architecture:
    """A plausible decoder with ``params`` parameters (``estimated=True``).

    Per layer a gated decoder has h*h*(2 + 2/g) attention and 3*3.5*h*h MLP weights (g
    query heads per KV head); with layers = h / aspect that is ``c * h**3 / aspect`` for
    all layers, plus 2*V*h untied embeddings. Solved for h by fixed-point iteration, h
    rounded to a multiple of the head dim. The parameter count stays the one given.
    """
    per_layer = 2 + 2 / query_per_kv + 3 * TYPICAL_MLP_RATIO  # x h**2
    hidden = float(TYPICAL_HEAD_DIM)
    for _ in range(_SOLVE_ITERATIONS):
        body = max(params - 2 * vocab * hidden, 0.1 * params)
        hidden = (body * aspect / per_layer) ** (1 / 3)
    h = max(TYPICAL_HEAD_DIM, round(hidden / TYPICAL_HEAD_DIM) * TYPICAL_HEAD_DIM)
    body = max(params - 2 * vocab * h, 0.1 * params)
    layers = max(1, round(body / (per_layer * h * h)))
    heads = h // TYPICAL_HEAD_DIM
    return Architecture(
        params=params,
        layers=layers,
        hidden=h,
        heads=heads,
        kv_heads=max(1, heads // query_per_kv),
        head_dim=TYPICAL_HEAD_DIM,
        vocab=vocab,
        intermediate=round(TYPICAL_MLP_RATIO * h),
        name=None,
        estimated=True,
    )


def shape_variants(params: int) -> list[Architecture]:
    """:func:`typical_shape` at every corner of the published ranges (8 shapes)."""
    return [
        typical_shape(params, aspect=aspect, query_per_kv=groups, vocab=vocab)
        for aspect, groups, vocab in itertools.product(
            ASPECT_RANGE, QUERY_PER_KV_RANGE, VOCAB_RANGE
        )
    ]
