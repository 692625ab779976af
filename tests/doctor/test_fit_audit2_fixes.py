"""``gpuwatch fit``, second accuracy audit: training activations against published
measurements, Llama 4's chunked attention, encoders fit cannot size, encoder-only models,
and MLP widths a config names otherwise or not at all.

Each test names the finding it covers and fails on the code before the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from doctor.cli_run import model_config, run
from doctor.published_configs import (
    BERT_BASE_UNCASED,
    GEMMA3_4B,
    LLAMA4_SCOUT_PUBLISHED,
    LLAMA4_SCOUT_TEXT,
    LLAMA_33_70B,
    PHI3_SMALL_8K,
    PHI4_MULTIMODAL,
    PHI35_VISION,
)
from gpuwatch.doctor.architecture import (
    Architecture,
    encoder_params,
    from_model_config,
    load_hf_config,
)
from gpuwatch.doctor.fit import Workload, estimate, weight_bytes
from gpuwatch.doctor.units import GIB

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_8B_PATH = FIXTURES / "llama-3.1-8b" / "config.json"
LLAMA_8B: dict[str, Any] = json.loads(LLAMA_8B_PATH.read_text(encoding="utf-8"))
MIXTRAL: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "vocab_size": 32000,
}
GPT2_SMALL: dict[str, Any] = {
    "model_type": "gpt2",
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "vocab_size": 50257,
}


def _fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, config: Any, *args: str
) -> tuple[int, str, str]:
    path = model_config(tmp_path, name, config)
    return run(["fit", "--config", path, *args], capsys)


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, config: Any) -> str:
    code, out, err = _fit(tmp_path, capsys, name, config, "--gpu", "H100-80GB")
    assert code == 3 and not out, (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _qlora(arch: Architecture, context: int, **kwargs: Any) -> Workload:
    # Unsloth's HF+FA2 runs: 4-bit QLoRA on every linear layer, rank 32, batch 1.
    return Workload(arch, dtype="nf4", mode="qlora", context=context, lora_rank=32, **kwargs)


def _longest(arch: Architecture, card_gib: int) -> int:
    """The longest context whose total fits the card whole (no headroom): what a run
    that goes on until it is out of memory finds."""
    low, high = 1, 1_000_000
    while low < high:
        mid = (low + high + 1) // 2
        needed = estimate(_qlora(arch, mid, checkpointing=True)).total
        low, high = (mid, high) if needed <= card_gib * GIB else (low, mid - 1)
    return low


# --- 1. training activations: gated MLPs, the fp32 stream of QLoRA, the loss ---------

# Unsloth's published Hugging Face + FA2 limits (unsloth.ai/blog/llama3-3 and its
# benchmarks page): the longest sequence that trained, by card. Before, fit put
# Llama-3.3-70B's limit on 80 GB at about 16,000 tokens, and 8B's at 2.3 x the measured.
HF_FA2_LIMITS = [
    ("llama-3.1-8b", 16, 2_551),
    ("llama-3.1-8b", 24, 5_789),
    ("llama-3.1-8b", 40, 12_264),
    ("llama-3.1-8b", 48, 15_502),
    ("llama-3.1-8b", 80, 28_454),
    ("llama-3.3-70b", 80, 6_916),
]


@pytest.mark.parametrize(("model", "card", "measured"), HF_FA2_LIMITS)
def test_qlora_limits_agree_with_published_hf_measurements(
    model: str, card: int, measured: int
) -> None:
    arch = (
        load_hf_config(LLAMA_8B_PATH)
        if model == "llama-3.1-8b"
        else from_model_config(LLAMA_33_70B)
    )
    assert abs(_longest(arch, card) / measured - 1) <= 0.10


def test_qlora_70b_past_the_measured_limit_is_not_offered_checkpointing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "makes it fit: gradient checkpointing -> 67.25 GiB" at 12,000 tokens, where
    # HF+FA2 runs out of memory past 6,916.
    code, out, _ = _fit(
        tmp_path, capsys, "llama-3.3-70b", LLAMA_33_70B,
        "--mode", "qlora", "--context", "12000", "--gpu", "A100-80GB",
    )  # fmt: skip
    assert code == 10
    offered = [line for line in out.splitlines() if "makes it fit" in line]
    assert not any("checkpointing" in line for line in offered), offered
    # 48 GB: out of memory at any length (HF+FA2 measured OOM).
    assert estimate(_qlora(from_model_config(LLAMA_33_70B), 256, checkpointing=True)).total > (
        48 * GIB
    )


def _per_token(hidden: int, query: int, kv: int, mlp: int, *, gated: bool) -> tuple[int, int]:
    """fit.py's table, written out: what a layer saves, and its backward's extra."""
    saved = 12 * hidden + 4 * (query + kv) + (8 if gated else 4) * mlp
    return saved, (4 if gated else 2) * mlp


@pytest.mark.parametrize("checkpointing", [False, True])
def test_layer_activations_follow_the_mlp_and_attention_widths(checkpointing: bool) -> None:
    tokens = 2048
    for arch, gated in (
        (load_hf_config(LLAMA_8B_PATH), True),
        (from_model_config(GPT2_SMALL), False),
    ):
        h, layers, vocab, mlp = (
            arch.hidden or 0,
            arch.layers or 0,
            arch.vocab or 0,
            arch.intermediate or 0,
        )
        kv = (arch.kv_heads or 0) * (arch.head_dim or 0)
        saved, backward = _per_token(h, h, kv, mlp, gated=gated)
        stored = 2 * h * layers + saved + backward if checkpointing else saved * layers + backward
        got = estimate(
            Workload(arch, mode="full", context=tokens, checkpointing=checkpointing)
        ).activations
        # The loss: the bf16 logits and three fp32 tensors of their size, 14 B a logit.
        assert got == tokens * (stored + vocab * 14)
    # Llama-3.1-8B's layer is 45 h a token, not the 34 h of a GPT layer with a 4h MLP.
    assert _per_token(4096, 4096, 1024, 14336, gated=True)[0] == 45 * 4096


def test_qlora_keeps_an_fp32_stream_and_fp32_embeddings() -> None:
    arch = load_hf_config(LLAMA_8B_PATH)
    tokens, h, layers = 4096, 4096, 32
    qlora = estimate(_qlora(arch, tokens, checkpointing=True))
    lora = estimate(Workload(arch, mode="lora", context=tokens, lora_rank=32, checkpointing=True))
    # prepare_model_for_kbit_training's fp32 embeddings: the checkpoints are 4 h, not 2 h.
    assert (qlora.activations or 0) - (lora.activations or 0) == tokens * 2 * h * layers
    trainable = arch.lora_params(32) or 0
    assert qlora.weights == weight_bytes(arch, "nf4") + trainable * 4 + arch.embedding_params * 2


def test_moe_activations_follow_the_experts_a_token_passes_through() -> None:
    arch = from_model_config(MIXTRAL)
    assert arch.active_intermediate == 2 * 14336  # two routed experts a token
    tokens = 1024
    saved, backward = _per_token(4096, 4096, 1024, 2 * 14336, gated=True)
    got = estimate(Workload(arch, mode="full", context=tokens)).activations
    assert got == tokens * (saved * 32 + backward + 32000 * 14)


# --- 2. Llama 4's chunked attention -------------------------------------------------

PER_LAYER = 2 * 8 * 128 * 2  # Scout: 8 KV heads of 128, K and V, 2 bytes


def test_llama4_scout_chunked_layers_hold_one_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: 12.00 GiB of KV cache (every layer at 65,536 tokens), 72.51 GiB, "does NOT
    # fit" on one H100 in int4, Meta's headline deployment.
    args = ("--dtype", "int4", "--context", "65536", "--gpu", "H100-80GB")
    code, out, _ = _fit(tmp_path, capsys, "scout", LLAMA4_SCOUT_PUBLISHED, *args, "--json")
    result = json.loads(out)
    assert code == 0 and result["verdict"] == "fits"
    assert result["breakdown"]["kv_cache_bytes"] == PER_LAYER * (12 * 65536 + 36 * 8192)
    kv = result["kv_cache"]
    assert (kv["full_layers"], kv["sliding_layers"], kv["window"]) == (12, 36, 8192)
    assert kv["chunked"] is True and kv["window_not_applied"] is None
    assert not any("chunk" in note for note in result["notes"])
    _, text, _ = run(["fit", "--config", str(tmp_path / "scout" / "config.json"), *args], capsys)
    assert "36 chunked (chunk 8192)" in text and "chunked layers hold 8,192" in text


@pytest.mark.parametrize(
    ("layout", "chunked"),
    [
        ({"no_rope_layers": [1, 1, 0, 1] * 12}, 36),  # 1: a RoPE layer, chunked
        ({"no_rope_layers": [], "no_rope_layer_interval": 2}, 24),
        ({"layer_types": ["chunked_attention", "full_attention"] * 24}, 24),
        ({"attention_chunk_size": None}, 36),  # Llama4TextConfig's 8,192 applies
    ],
)
def test_llama4_chunked_layers_as_transformers_lays_them_out(
    layout: dict[str, Any], chunked: int
) -> None:
    text = {**LLAMA4_SCOUT_TEXT, **layout}
    text = {key: value for key, value in text.items() if value is not None}
    arch = from_model_config({**LLAMA4_SCOUT_PUBLISHED, "text_config": text})
    assert (arch.sliding_layers, arch.window, arch.window_chunked) == (chunked, 8192, True)
    assert arch.window_unread is None


def test_chunked_attention_fit_cannot_place_keeps_the_full_count_and_says_so() -> None:
    arch = from_model_config({**LLAMA_8B, "attention_chunk_size": 4096})
    assert arch.sliding_layers == 0 and arch.window_unread is not None
    assert "cannot tell which layers are chunked" in arch.window_unread


# --- 3. encoders and adapters fit cannot size ---------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "names"),
    [
        # Before: 3.84B, the language model alone: 1.73B (31 %) left out, no note.
        ("phi-4-mm", PHI4_MULTIMODAL, "audio_processor, embd_layer, speech_lora, vision_lora"),
        ("phi-3.5-vision", PHI35_VISION, "embd_layer, img_processor"),
    ],
)
def test_encoders_fit_cannot_size_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, config: Any, names: str
) -> None:
    err = _refused(tmp_path, capsys, name, config)
    assert f"model config's {names} describe encoders or adapters" in err
    assert "--params" in err


def test_an_encoder_under_an_unfamiliar_key_is_counted() -> None:
    tower = {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096}
    arch = from_model_config({**LLAMA_8B, "speech_encoder": tower})
    expected = encoder_params(tower, key="speech_encoder", output_width=4096)
    assert arch.encoder_params == expected > 300_000_000
    assert arch.params == 8_030_261_248 + expected


def test_nested_model_configs_fit_does_not_count_are_noted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        **LLAMA_8B,
        "projector_config": {"n_embed": 4096, "depth": 2, "input_dim": 1152},
        "aligner_config": {"cls": "MlpProjector", "params": {"n_embed": 2048, "depth": 2}},
    }
    code, out, _ = _fit(tmp_path, capsys, "vl", config, "--gpu", "H100-80GB", "--json")
    notes = json.loads(out)["notes"]
    assert code == 0
    assert any(
        "projector_config (width 4,096, 2 layers)" in note
        and "aligner_config.params (width 2,048, 2 layers)" in note
        and "does not count" in note
        for note in notes
    ), notes


# --- 4. encoder-only models ---------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        BERT_BASE_UNCASED,  # before: 136.7M (+25 %) and a 36,864 B/token KV cache
        {**BERT_BASE_UNCASED, "model_type": "roberta", "architectures": ["RobertaModel"]},
        {**BERT_BASE_UNCASED, "model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"]},
        {**BERT_BASE_UNCASED, "model_type": "distilbert", "architectures": ["DistilBertModel"]},
        {**BERT_BASE_UNCASED, "model_type": "modernbert", "intermediate_size": 1152},
        {**BERT_BASE_UNCASED, "model_type": "new_bert", "architectures": ["NewForMaskedLM"]},
    ],
    ids=["bert", "roberta", "xlm-roberta", "distilbert", "modernbert", "masked-lm"],
)
def test_encoder_only_models_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any]
) -> None:
    err = _refused(tmp_path, capsys, "encoder", config)
    assert "encoder-only model" in err and "no KV cache" in err


# --- 5. MLP widths ------------------------------------------------------------------


def test_phi3_small_reads_ff_intermediate_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: 8,195,936,256 (+10.9 %), its MLP read as 4 x hidden with no note.
    code, out, _ = _fit(
        tmp_path, capsys, "phi-3-small", PHI3_SMALL_8K, "--gpu", "RTX4090", "--json"
    )
    result = json.loads(out)
    assert code == 0 and result["model"]["params"] == 7_390_629_888  # published 7.39B
    assert result["notes"] == []


def test_a_missing_mlp_width_is_refused_unless_the_class_default_applies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_width = {key: value for key, value in LLAMA_8B.items() if key != "intermediate_size"}
    err = _refused(tmp_path, capsys, "qwen3", {**no_width, "model_type": "qwen3"})
    assert "gives no MLP width" in err and "(qwen3)" in err
    # GPT2Config makes it 4 x hidden: counted so, and said so.
    arch = from_model_config(GPT2_SMALL)
    assert arch.intermediate == 4 * 768
    assert any("config class's default (gpt2)" in note for note in arch.notes)
    # LlamaConfig's own default (11,008) still fills a Llama config in, as before.
    assert from_model_config({**no_width}).intermediate == 11_008


@pytest.mark.parametrize("config", [GEMMA3_4B, LLAMA4_SCOUT_PUBLISHED], ids=["gemma3", "scout"])
def test_the_language_model_counted_is_not_noted_as_uncounted(config: dict[str, Any]) -> None:
    """Its class defaults are filled into a copy: the note compared the copy, not the
    config's own text_config, and said the model it had counted was not counted."""
    arch = from_model_config(config)
    assert not [n for n in arch.notes if "does not count" in n], arch.notes
