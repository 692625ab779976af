"""``gpuwatch fit --kv-cache-dtype``: an engine's fp8 KV cache (vLLM ``--kv-cache-dtype
fp8``) halves a 16-bit cache whatever the weights are, and fit offers it when the cache
is what does not fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from doctor.cli_run import model_config, run

# Llama-2-7B's shape: 32 KV heads (no grouped-query attention), so its cache is large.
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}
# 2 (K, V) x 32 layers x 32 heads x 128 dims, a token.
ELEMENTS_PER_TOKEN = 2 * 32 * 32 * 128


def _fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, dict[str, Any], str]:
    path = model_config(tmp_path, f"m{len(list(tmp_path.iterdir()))}", LLAMA2_7B)
    code, out, err = run(["fit", "--config", path, *args], capsys)
    return code, (json.loads(out) if "--json" in args and out else {}), out + err


@pytest.mark.parametrize(
    ("spelling", "element_bytes", "named"),
    [
        (None, 2, "16-bit"),
        ("auto", 2, "16-bit"),
        ("fp8", 1, "fp8"),
        ("FP8_E4M3", 1, "fp8"),
        ("fp8_e5m2", 1, "fp8"),
        ("bfloat16", 2, "bf16"),
        ("fp32", 4, "fp32"),
    ],
)
def test_the_cache_is_counted_at_its_element_size(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    spelling: str | None,
    element_bytes: int,
    named: str,
) -> None:
    option = [] if spelling is None else ["--kv-cache-dtype", spelling]
    code, report, _ = _fit(
        tmp_path,
        capsys,
        "--gpu",
        "H100-80GB",
        "--context",
        "4096",
        "--batch",
        "2",
        *option,
        "--json",
    )
    assert code == 0
    assert report["kv_cache_dtype"] == named
    assert report["kv_cache_bytes_per_token"] == ELEMENTS_PER_TOKEN * element_bytes
    assert report["breakdown"]["kv_cache_bytes"] == ELEMENTS_PER_TOKEN * element_bytes * 4096 * 2


def test_an_fp8_cache_is_offered_when_the_cache_is_what_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 32 sequences of 4,096 tokens: a 64 GiB cache on an 80 GB card.
    args = ("--gpu", "H100-80GB", "--context", "4096", "--batch", "32")
    code, _, text = _fit(tmp_path, capsys, *args)
    assert code == 10
    assert "makes it fit: fp8 KV cache (--kv-cache-dtype fp8" in text
    code, _, text = _fit(tmp_path, capsys, *args, "--kv-cache-dtype", "fp8")
    assert code == 0, text
    assert "fp8 KV cache" in text.splitlines()[0]
    # Already fp8: not offered again.
    code, _, text = _fit(tmp_path, capsys, *args, "--batch", "64", "--kv-cache-dtype", "fp8")
    assert code == 10
    assert "--kv-cache-dtype fp8" not in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kv-cache-dtype", "int8"), "--kv-cache-dtype must be auto or one of"),
        (("--kv-cache-dtype", ""), "--kv-cache-dtype must be auto or one of"),
        (("--kv-cache-dtype", "fp8", "--mode", "full"), "applies to --mode inference"),
    ],
)
def test_a_cache_type_fit_cannot_count_is_one_line_and_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code, _, text = _fit(tmp_path, capsys, "--gpu", "H100-80GB", *args)
    assert code == 3
    assert message in text
    assert "Traceback" not in text
    assert len(text.strip().splitlines()) == 1


def test_training_reports_no_cache_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, report, _ = _fit(tmp_path, capsys, "--gpu", "H100-80GB", "--mode", "lora", "--json")
    assert report["kv_cache_dtype"] is None
