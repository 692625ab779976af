"""`gpuwatch fit --config .../config.json` names the model after its folder, except a
folder named by a hash: a Hugging Face cache snapshot
(`models--ORG--NAME/snapshots/<commit>/config.json`) is `ORG/NAME`, and another hash
folder takes the config's `_name_or_path`, else its `model_type`. Before, the report
was headed by the snapshot's commit hash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.doctor.architecture import load_hf_config

LLAMA: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "torch_dtype": "bfloat16", "model_type": "llama",
}  # fmt: skip
COMMIT = "8cde5ca8380496c9a6cc7ef3a8b46a0372a1d920"


def _name(tmp_path: Path, folder: str, config: dict[str, Any]) -> str:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(load_hf_config(path).name)


@pytest.mark.parametrize(
    ("folder", "extra", "named"),
    [
        (
            f"models--meta-llama--Meta-Llama-3-8B/snapshots/{COMMIT}",
            {},
            "meta-llama/Meta-Llama-3-8B",
        ),
        (COMMIT, {"_name_or_path": "meta-llama/Meta-Llama-3-8B"}, "meta-llama/Meta-Llama-3-8B"),
        (COMMIT, {"_name_or_path": "/data/ckpt/llama-ft/"}, "llama-ft"),
        (COMMIT, {}, "llama"),
        ("Meta-Llama-3-8B", {"_name_or_path": "base-model"}, "Meta-Llama-3-8B"),  # as before
    ],
)
def test_a_hash_folder_is_not_the_model_name(
    tmp_path: Path, folder: str, extra: dict[str, Any], named: str
) -> None:
    assert _name(tmp_path, folder, {**LLAMA, **extra}) == named
