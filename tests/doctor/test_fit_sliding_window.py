"""``fit --config`` on models whose layers attend through a sliding window: such a layer
keeps only the last ``sliding_window`` tokens of KV cache, so the cache is
``full layers x context + sliding layers x min(context, window)``, not every layer at
the full context.

Before, every layer counted the whole context: Gemma 3 4B at 128k tokens came out at a
17 GiB KV cache (it holds 2.6 GiB) and "does NOT fit" on a 24 GiB card it fits on.

Configs are the published config.json files (Hugging Face model repositories), trimmed
to the keys fit reads; which layers slide is transformers' rule for each family
(configuration_gemma2.py, configuration_gemma3.py, configuration_gpt_oss.py,
configuration_qwen2.py, cache_utils.DynamicCache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.doctor.cli_run import model_config, run
from tests.doctor.published_configs import GEMMA3_4B, GPT_OSS_20B

GEMMA2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "attn_logit_softcapping": 50.0,
    "cache_implementation": "hybrid",
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "vocab_size": 256000,
}
GEMMA3_27B: dict[str, Any] = {
    **GEMMA3_4B,
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "vocab_size": 262208,
    },
}
# google/gemma-3-270m lists its layers: full attention at 5, 11 and 17.
GEMMA3_270M: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "_sliding_window_pattern": 6,
    "head_dim": 256,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "sliding_window": 512,
    "vocab_size": 262144,
}
MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
# Qwen2.5 publishes a window it does not use: use_sliding_window is false.
QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
QWEN3_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def fit_json(tmp_path: Path, capsys: Any, name: str, config: dict[str, Any], *args: str) -> Any:
    path = model_config(tmp_path, name, config)
    code, out, err = run(["fit", "--config", path, "--gpu", "H100-80GB", "--json", *args], capsys)
    assert code in (0, 10), err
    return json.loads(out)


# (model, config, context, bytes per layer per token, full layers, sliding layers, window)
LONG_CONTEXT = [
    ("gemma-2-9b", GEMMA2_9B, 8192, 2 * 8 * 256 * 2, 21, 21, 4096),
    ("gemma-3-4b-it", GEMMA3_4B, 131072, 2 * 4 * 256 * 2, 5, 29, 1024),
    ("gemma-3-27b-it", GEMMA3_27B, 131072, 2 * 16 * 128 * 2, 10, 52, 1024),
    ("gemma-3-270m", GEMMA3_270M, 32768, 2 * 1 * 256 * 2, 3, 15, 512),
    ("gpt-oss-20b", GPT_OSS_20B, 131072, 2 * 8 * 64 * 2, 12, 12, 128),
    ("Mistral-7B-v0.1", MISTRAL_7B_V01, 32768, 2 * 8 * 128 * 2, 0, 32, 4096),
]


@pytest.mark.parametrize(
    ("name", "config", "context", "per_layer", "full", "sliding", "window"),
    LONG_CONTEXT,
    ids=[case[0] for case in LONG_CONTEXT],
)
def test_sliding_layers_hold_only_their_window(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    config: dict[str, Any],
    context: int,
    per_layer: int,
    full: int,
    sliding: int,
    window: int,
) -> None:
    report = fit_json(tmp_path, capsys, name, config, "--context", str(context))
    expected = per_layer * (full * context + sliding * min(context, window))
    assert report["breakdown"]["kv_cache_bytes"] == expected
    assert report["kv_cache"] == {
        "full_layers": full,
        "sliding_layers": sliding,
        "window": window,
        "full_layers_bytes": per_layer * full * context,
        "sliding_layers_bytes": per_layer * sliding * window,
        "full_context_bytes": per_layer * (full + sliding) * context,
        "state_bytes": 0,
        "chunked": False,
        "window_not_applied": None,
    }
    # The per-token figure stays every layer's, as before.
    assert report["kv_cache_bytes_per_token"] == per_layer * (full + sliding)


def test_gemma3_at_128k_fits_a_24gib_card_it_was_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every layer at 128k was a 17 GiB KV cache and 33.5 GiB in all; 29 of its 34 layers
    # hold 1,024 tokens: 2.6 GiB, 19.1 GiB in all.
    path = model_config(tmp_path, "gemma-3-4b-it", GEMMA3_4B)
    code, out, _ = run(["fit", "--config", path, "--gpu", "24GiB", "--context", "131072"], capsys)
    assert code == 0, out
    assert "24GiB (24.00 GiB): fits" in out
    lines = out.splitlines()
    kv = next(i for i, line in enumerate(lines) if line.lstrip().startswith("KV cache"))
    assert lines[kv].split()[-2:] == ["2.61", "GiB"]
    assert lines[kv + 1].split() == ["5", "full-attention", "layers", "2.50", "GiB"]
    assert lines[kv + 2].split() == ["29", "sliding", "(window", "1024)", "116.00", "MiB"]
    assert "sliding layers hold 1,024 of 131,072 tokens" in lines[kv + 3]
    assert "every layer at the full context would be 17.00 GiB" in lines[kv + 3]


def test_gemma3_27b_at_128k_now_fits_an_h200(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 62 GiB of KV cache for every layer at 128k (130 GiB in all) is 10.4 GiB.
    path = model_config(tmp_path, "gemma-3-27b-it", GEMMA3_27B)
    args = ["fit", "--config", path, "--gpu", "H200", "--context", "131072", "--json"]
    code, out, _ = run(args, capsys)
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "fits"
    assert report["kv_cache"]["full_context_bytes"] == 62 * 2**30
    assert report["breakdown"]["kv_cache_bytes"] < 10.5 * 2**30


def test_a_short_context_inside_the_window_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model_config(tmp_path, "gemma-2-9b", GEMMA2_9B)
    code, out, _ = run(["fit", "--config", path, "--gpu", "24GiB", "--context", "4096"], capsys)
    assert code == 0
    assert "context 4,096 is within the 4,096-token window: no saving" in out
    report = fit_json(tmp_path, capsys, "gemma-2-9b-json", GEMMA2_9B, "--context", "4096")
    every_layer = 2 * 42 * 8 * 256 * 2 * 4096
    assert report["breakdown"]["kv_cache_bytes"] == every_layer
    assert report["kv_cache"]["full_context_bytes"] == every_layer
    assert report["kv_cache"]["sliding_layers"] == 21


@pytest.mark.parametrize(
    ("name", "config", "per_token"),
    [
        ("Qwen2.5-7B", QWEN25_7B, 2 * 28 * 4 * 128 * 2),  # use_sliding_window: false
        ("Qwen3-0.6B", QWEN3_06B, 2 * 28 * 8 * 128 * 2),  # sliding_window: null
    ],
    ids=["qwen2.5-window-off", "qwen3-window-null"],
)
def test_a_window_the_model_does_not_use_is_ignored(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    config: dict[str, Any],
    per_token: int,
) -> None:
    report = fit_json(tmp_path, capsys, name, config, "--context", "32768")
    assert report["breakdown"]["kv_cache_bytes"] == per_token * 32768
    assert report["kv_cache"]["sliding_layers"] == 0
    assert report["kv_cache"]["window"] is None
    assert report["kv_cache"]["window_not_applied"] is None
    assert not any("sliding" in note for note in report["notes"])


def test_qwen2_with_its_window_on_slides_from_max_window_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Qwen2Config: layer i slides when use_sliding_window and i >= max_window_layers.
    config = {
        **QWEN25_7B,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 21,
    }
    report = fit_json(tmp_path, capsys, "qwen-swa", config, "--context", "32768")
    assert (report["kv_cache"]["full_layers"], report["kv_cache"]["sliding_layers"]) == (21, 7)
    per_layer = 2 * 4 * 128 * 2
    assert report["breakdown"]["kv_cache_bytes"] == per_layer * (21 * 32768 + 7 * 4096)


def test_layer_types_wins_over_the_family_pattern(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Gemma 3's pattern would make 15 of 18 layers slide; the list says none does.
    config = {**GEMMA3_270M, "layer_types": ["full_attention"] * 18}
    report = fit_json(tmp_path, capsys, "gemma-3-all-full", config, "--context", "32768")
    assert report["kv_cache"]["sliding_layers"] == 0
    assert report["breakdown"]["kv_cache_bytes"] == 2 * 18 * 1 * 256 * 2 * 32768


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({**MISTRAL_7B_V01, "model_type": "someday_lm"}, "sliding_window 4096 in a someday_lm"),
        (
            {**GEMMA3_270M, "layer_types": ["sliding_attention", "full_attention"]},
            "layer_types lists 2 layers for 18",
        ),
    ],
    ids=["unknown-family", "layer-types-length"],
)
def test_a_window_fit_cannot_place_keeps_the_full_count_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], reason: str
) -> None:
    report = fit_json(tmp_path, capsys, "unsure", config, "--context", "32768")
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    assert report["breakdown"]["kv_cache_bytes"] == 2 * layers * kv_heads * head_dim * 2 * 32768
    assert report["kv_cache"]["sliding_layers"] == 0
    assert reason in report["kv_cache"]["window_not_applied"]
    assert any(reason in note for note in report["notes"])
    path = model_config(tmp_path, "unsure-text", config)
    _, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB", "--context", "32768"], capsys)
    assert f"note: KV cache: {reason}" in out


def test_the_longest_context_offered_counts_the_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Gemma 3 27B at 256k on an 80 GiB card: what fits is bounded by its 10 full layers.
    report = fit_json(tmp_path, capsys, "gemma-3-27b-it", GEMMA3_27B, "--context", "262144")
    [gpu] = report["gpus"]
    shorter = [o for o in gpu["options"] if o["change"].startswith("shorter context")]
    assert shorter, gpu["options"]
    offered = int(shorter[0]["change"].split("--context ")[1].rstrip(")"))
    assert offered == 77312  # every layer at the full context: 26,112


def test_training_has_no_kv_cache_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = fit_json(tmp_path, capsys, "gemma-2-9b", GEMMA2_9B, "--mode", "lora")
    assert report["kv_cache"] is None and report["breakdown"]["kv_cache_bytes"] is None


# google/gemma-3-4b-it's config.json as published: its text_config leaves the heads, the
# head size and the vocabulary to Gemma3TextConfig's defaults (8, 4, 256, 262,208), and
# fit refused it ("lacks a positive integer 'num_attention_heads'", exit 3).
GEMMA3_4B_AS_PUBLISHED: dict[str, Any] = {
    **GEMMA3_4B,
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}


def test_gemma3_as_published_is_read_with_its_class_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def weighed(config: dict[str, Any], model: str) -> dict[str, Any]:
        path = model_config(tmp_path, model, config)
        code, out, err = run(
            ["fit", "--config", path, "--gpu", "24GiB", "--context", "8192", "--json"], capsys
        )
        assert code == 0, err
        return json.loads(out)

    published = weighed(GEMMA3_4B_AS_PUBLISHED, "gemma-3-4b-it")
    spelled_out = weighed(GEMMA3_4B, "gemma-3-4b-spelled-out")
    assert published["model"]["params"] == spelled_out["model"]["params"]
    assert published["kv_cache"] == spelled_out["kv_cache"]


def test_a_model_folder_s_control_characters_are_shown_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # fit names the model after its folder, and the report goes to a terminal: a folder
    # named with an ESC sequence and a newline must not clear the screen or forge a line.
    path = model_config(tmp_path, "gpt-oss\x1b[2J\nFIX: it fits", GPT_OSS_20B)
    code, out, err = run(["fit", "--config", path, "--gpu", "H100-80GB"], capsys)
    assert code == 0, err
    assert "\x1b" not in out and "gpt-oss\\x1b[2J\\nFIX: it fits" in out
    assert not any(line.startswith("FIX") for line in out.splitlines())
