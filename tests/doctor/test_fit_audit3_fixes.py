"""``gpuwatch fit``, third audit: several GPUs (tensor parallel, FSDP), the training
settings people run (gradient checkpointing, LoRA rank), "free now" with headroom, an
unreachable agent, cut-short configs, GPTQ group sizes, dtype spellings, contexts past
the model's positions, and the catalogue's H100 NVL, bare family names and MIG profiles.

Each test names the finding it covers and fails on the code before the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from doctor.cli_run import model_config, run
from doctor.fake_agent_server import FakeAgent
from doctor.published_configs import QWEN25_7B, QWEN25_72B
from gpuwatch.snapshot import Gpu, HostSnapshot, MigInstance

GIB = 2**30
MIB = 2**20


def _fit_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], *args: str
) -> tuple[int, dict[str, Any]]:
    path = model_config(tmp_path, f"m{len(list(tmp_path.iterdir()))}", config)
    code, out, err = run(["fit", "--config", path, *args, "--json"], capsys)
    assert out, err
    return code, json.loads(out)


def _host(agent: FakeAgent, *gpus: Gpu) -> None:
    assert isinstance(agent.snapshot, HostSnapshot)
    agent.snapshot = agent.snapshot.model_copy(update={"gpus": list(gpus)})


def _card(index: int, total: int, free: int | None = None, **extra: Any) -> Gpu:
    free = total if free is None else free
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA H100 80GB HBM3",
        memory_total_bytes=total,
        memory_used_bytes=total - free,
        memory_free_bytes=free,
        **extra,
    )


# --- 1. several GPUs -------------------------------------------------------------------


def test_tensor_parallel_splits_weights_and_kv_cache_not_overheads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: no --gpus; Qwen2.5-72B was judged on one card only.
    _, one = _fit_json(tmp_path, capsys, QWEN25_72B, "--gpu", "H100-80GB", "--context", "8192")
    code, four = _fit_json(
        tmp_path, capsys, QWEN25_72B, "--gpu", "H100-80GB", "--context", "8192", "--gpus", "4"
    )
    whole, split = one["breakdown"], four["breakdown"]
    assert split["weights_bytes"] == -(-whole["weights_bytes"] // 4)
    assert split["kv_cache_bytes"] == whole["kv_cache_bytes"] // 4  # 2 of its 8 KV heads each
    assert split["activations_bytes"] == whole["activations_bytes"]
    assert split["overhead_bytes"] == whole["overhead_bytes"] == GIB
    assert (code, four["verdict"], four["gpus_per_model"]) == (0, "fits", 4)
    assert any("tensor parallel over 4 GPUs" in note for note in four["notes"])


def test_kv_heads_are_replicated_past_their_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Qwen2.5-7B has 4 KV heads: over 8 GPUs each still holds one, a quarter of the cache.
    _, one = _fit_json(tmp_path, capsys, QWEN25_7B, "--gpu", "L4", "--context", "32768")
    _, eight = _fit_json(
        tmp_path, capsys, QWEN25_7B, "--gpu", "L4", "--context", "32768", "--gpus", "4"
    )
    assert eight["breakdown"]["kv_cache_bytes"] == one["breakdown"]["kv_cache_bytes"] // 4


def test_fsdp_shards_weights_gradients_and_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--gpu", "H100-80GB", "--mode", "full", "--context", "2048")
    _, one = _fit_json(tmp_path, capsys, QWEN25_7B, *args)
    code, eight = _fit_json(tmp_path, capsys, QWEN25_7B, *args, "--gpus", "8")
    whole, split = one["breakdown"], eight["breakdown"]
    assert split["gradients_bytes"] == -(-whole["gradients_bytes"] // 8)
    assert split["optimizer_bytes"] == -(-whole["optimizer_bytes"] // 8)
    # 1/8 of the weights plus the one layer FSDP gathers whole (28 layers, bf16).
    layer = (whole["weights_bytes"] - 2 * 1_089_994_752) // 28
    assert split["weights_bytes"] == -(-whole["weights_bytes"] // 8) + layer
    assert split["activations_bytes"] == whole["activations_bytes"]  # each GPU's own batch
    assert code == 0 and one["verdict"] == "does_not_fit"


def test_a_host_of_alike_cards_offers_tensor_parallel_first(
    tmp_path: Path, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: on an 8-GPU box the advice was a slow CPU offload or "a bigger GPU".
    _host(agent, *(_card(i, 80 * GIB) for i in range(4)))
    path = model_config(tmp_path, "qwen72", QWEN25_72B)
    code, out, _ = run(["fit", "--config", path, "--gpu", "local", "--agent", agent.url], capsys)
    assert code == 10  # one card still does not hold it
    first = out.split("\n\n")[1].splitlines()
    assert "does NOT fit" in first[0]
    assert first[1].startswith("  makes it fit: tensor parallel over 4 GPUs, per GPU (--gpus 4")
    # --gpus 2 is asked about on this host's cards; --gpus 8 is more than it has.
    code, out, _ = run(
        ["fit", "--config", path, "--gpu", "local", "--agent", agent.url, "--gpus", "2"], capsys
    )
    assert "2 x GPU 0 (NVIDIA H100 80GB HBM3)" in out
    code, _, err = run(
        ["fit", "--config", path, "--gpu", "local", "--agent", agent.url, "--gpus", "8"], capsys
    )
    assert code == 3 and "at most 4 alike GPU(s)" in err


def test_the_split_is_listed_with_its_figure_when_even_all_cards_are_too_few(
    tmp_path: Path, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    _host(agent, _card(0, 24 * GIB), _card(1, 24 * GIB))
    code, data = _fit_json(tmp_path, capsys, QWEN25_72B, "--gpu", "local", "--agent", agent.url)
    parallel = data["gpus"][0]["parallel"]
    assert code == 10 and parallel["fits"] is False
    assert parallel["change"].startswith("tensor parallel over 2 GPUs")
    assert parallel["total_bytes"] > 24 * GIB


# --- 2. gradient checkpointing and LoRA rank -------------------------------------------


def test_qlora_assumes_checkpointing_as_peft_does_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model_config(tmp_path, "qwen7", QWEN25_7B)
    base = ["fit", "--config", path, "--gpu", "L4", "--mode", "qlora", "--context", "2048"]
    code, out, _ = run(base, capsys)
    assert code == 0 and "with gradient checkpointing" in out
    code, out, _ = run([*base, "--no-gradient-checkpointing"], capsys)
    assert code == 10 and "without gradient checkpointing" in out
    _, on, _ = run([*base, "--json"], capsys)
    _, off, _ = run([*base, "--json", "--no-gradient-checkpointing"], capsys)
    on_data, off_data = json.loads(on), json.loads(off)
    assert on_data["gradient_checkpointing"] is True and off_data["gradient_checkpointing"] is False
    assert on_data["breakdown"]["activations_bytes"] < off_data["breakdown"]["activations_bytes"]


def test_lora_rank_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = model_config(tmp_path, "qwen7", QWEN25_7B)
    base = ["fit", "--config", path, "--gpu", "A100-80GB", "--mode", "lora", "--json"]
    _, r16, _ = run(base, capsys)
    _, r64, _ = run([*base, "--lora-rank", "64"], capsys)
    grown = json.loads(r64)["breakdown"]["gradients_bytes"]
    assert grown == 4 * json.loads(r16)["breakdown"]["gradients_bytes"]  # adapters x rank
    assert json.loads(r64)["lora_rank"] == 64
    code, _, err = run(["fit", "--config", path, "--gpu", "L4", "--lora-rank", "8"], capsys)
    assert code == 3 and "--lora-rank" in err
    code, _, err = run(["fit", "--config", path, "--gpu", "L4", "--gradient-checkpointing"], capsys)
    assert code == 3 and "training" in err


# --- 3. free now, with the verdict's headroom ------------------------------------------


def test_free_now_wants_the_same_headroom_as_the_verdict(
    tmp_path: Path, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    _, alone = _fit_json(tmp_path, capsys, QWEN25_7B, "--gpu", "H100-80GB")
    needed = alone["breakdown"]["total_bytes"]
    # Free just above the need: before, "fits in what is free now" (and true in JSON).
    _host(agent, _card(0, 80 * GIB, needed + MIB))
    _, data = _fit_json(tmp_path, capsys, QWEN25_7B, "--gpu", "local", "--agent", agent.url)
    gpu = data["gpus"][0]
    assert (gpu["fits_free_now"], gpu["free_now_verdict"]) == (False, "does_not_fit")
    # 12 % to spare: tight.
    _host(agent, _card(0, 80 * GIB, int(needed / 0.88)))
    path = model_config(tmp_path, "tight", QWEN25_7B)
    _, out, _ = run(["fit", "--config", path, "--gpu", "local", "--agent", agent.url], capsys)
    assert "fits, but tight, in what is free now" in out


def test_free_now_takes_the_top_of_an_estimated_range(
    agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["fit", "--params", "3B", "--gpu", "H100-80GB", "--context", "16384", "--json"]
    _, out, _ = run(args, capsys)
    top = json.loads(out)["breakdown"]["total_high_bytes"]
    central = json.loads(out)["breakdown"]["total_bytes"]
    assert top > central / 0.85  # the central total fits what the top does not
    _host(agent, _card(0, 80 * GIB, int(central / 0.8)))
    args[4] = "local"
    _, out, _ = run([*args, "--agent", agent.url], capsys)
    assert json.loads(out)["gpus"][0]["fits_free_now"] is False


# --- 4. an unreachable agent -----------------------------------------------------------


def test_no_agent_is_exit_5_and_a_bad_url_exit_3(
    no_agent_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["fit", "--params", "7B", "--gpu", "local", "--agent", no_agent_url], capsys)
    assert code == 5 and "no gpuwatch agent answered" in err
    code, _, err = run(["fit", "--params", "7B", "--gpu", "local", "--agent", "gpu-box"], capsys)
    assert code == 3 and err.startswith("gpuwatch: error: --agent 'gpu-box'")


# --- 6. a cut-short config -------------------------------------------------------------


def test_a_top_level_config_without_its_sizes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: filled with Qwen2Config's defaults (a 7.7B model) and "fits", silently.
    cut = {"model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 11008}
    path = model_config(tmp_path, "cut", cut)
    code, out, err = run(["fit", "--config", path, "--gpu", "L4"], capsys)
    assert (code, out) == (3, "")
    assert "lacks num_hidden_layers, num_attention_heads, vocab_size" in err


def test_class_defaults_a_top_level_config_leans_on_are_noted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mistral = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 32768,
    }
    _, data = _fit_json(tmp_path, capsys, mistral, "--gpu", "L4")
    assert any(
        "num_key_value_heads=8" in n and "mistral's class defaults" in n for n in data["notes"]
    )


# --- 5. GPTQ group sizes ---------------------------------------------------------------


def test_gptq_group_size_sets_the_bits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    linear = 7_615_487_488 - 1_089_994_752  # Qwen2.5-7B less its embeddings and lm_head
    weights = {}
    for group in (32, 128, -1):
        quantization = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True}
        _, data = _fit_json(
            tmp_path, capsys, {**QWEN25_7B, "quantization_config": quantization}, "--gpu", "L4"
        )
        weights[group] = data["breakdown"]["weights_bytes"] - 1_089_994_752 * 2
    # An fp16 scale and a 4-bit zero (qzeros) per group; one a row for -1.
    assert weights[32] == round(linear * (4 + 20 / 32) / 8)
    assert weights[128] == round(linear * (4 + 20 / 128) / 8)
    assert weights[-1] == round(linear * 4 / 8)


# --- 8. dtype spellings and fp8 --------------------------------------------------------


@pytest.mark.parametrize(("spelt", "dtype"), [("bfloat16", "bf16"), ("BF16", "bf16"),
                                                ("Float16", "fp16"), ("FP8", "fp8")])  # fmt: skip
def test_dtype_spellings(
    spelt: str, dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, data = _fit_json(tmp_path, capsys, QWEN25_7B, "--gpu", "L4", "--dtype", spelt)
    assert data["dtype"] == dtype


def test_fp8_is_a_byte_a_weight_and_named_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, int8 = _fit_json(tmp_path, capsys, QWEN25_7B, "--gpu", "L4", "--dtype", "int8")
    fp8_config = {**QWEN25_7B, "quantization_config": {"quant_method": "fbgemm_fp8"}}
    path = model_config(tmp_path, "fp8", fp8_config)
    _, out, _ = run(["fit", "--config", path, "--gpu", "L4", "--json"], capsys)
    stored = json.loads(out)
    assert stored["dtype"] == "fp8"
    assert stored["breakdown"]["weights_bytes"] == int8["breakdown"]["weights_bytes"]
    code, _, err = run(["fit", "--config", path, "--gpu", "L4", "--dtype", ""], capsys)
    assert code == 3 and "--dtype must be one of" in err


# --- 9. context past the model's positions ---------------------------------------------


def test_a_context_past_the_models_positions_is_noted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, past = _fit_json(tmp_path, capsys, QWEN25_7B, "--gpu", "H200", "--context", "65536")
    assert any("past the model's 32,768 positions" in n for n in past["notes"])
    _, within = _fit_json(tmp_path, capsys, QWEN25_7B, "--gpu", "H200", "--context", "32768")
    assert not any("positions" in n for n in within["notes"])
    # YaRN x4 over the trained 32,768 stretches it to 131,072.
    yarn = {
        **QWEN25_7B,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
    _, stretched = _fit_json(tmp_path, capsys, yarn, "--gpu", "H200", "--context", "65536")
    assert not any("positions" in n for n in stretched["notes"])


# --- 7. catalogue ----------------------------------------------------------------------


def test_catalogue_h100_nvl_bare_names_and_mig_profiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model_config(tmp_path, "qwen7", QWEN25_7B)
    for name, mib in (("H100 NVL", 95_830), ("h100-94gb", 95_830), ("MIG 2g.20gb", 19_968)):
        _, out, _ = run(["fit", "--config", path, "--gpu", name, "--json"], capsys)
        assert json.loads(out)["gpus"][0]["total_bytes"] == mib * MIB, name
    code, _, err = run(["fit", "--config", path, "--gpu", "A100"], capsys)
    assert code == 3 and "A100-40GB, A100-80GB" in err


def test_a_mig_instance_is_advised_a_larger_profile(
    tmp_path: Path, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "a bigger GPU (A10G)" for a 2g.20gb slice of an H100.
    mig = MigInstance(
        index=0, uuid="MIG-0", gpu_instance_id=3, profile="2g.20gb",
        memory_total_bytes=19_968 * MIB, memory_used_bytes=0,
    )  # fmt: skip
    _host(agent, _card(0, 80 * GIB, mig_instances=[mig]))
    path = model_config(tmp_path, "qwen7", QWEN25_7B)
    code, out, _ = run(
        ["fit", "--config", path, "--gpu", "local", "--agent", agent.url, "--context", "32768"],
        capsys,
    )
    assert code == 10
    assert "makes it fit: a larger MIG profile: 3g.40gb" in out


# --- 11. the model's name --------------------------------------------------------------


def test_the_model_is_named_after_its_file_or_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "qwen2.5-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN25_7B), encoding="utf-8")
    (tmp_path / "qwen-small.json").write_text(json.dumps(QWEN25_7B), encoding="utf-8")
    monkeypatch.chdir(folder)
    _, out, _ = run(["fit", "--config", "./config.json", "--gpu", "L4", "--json"], capsys)
    assert json.loads(out)["model"]["name"] == "qwen2.5-7b"  # was ""
    _, out, _ = run(["fit", "--config", "../qwen-small.json", "--gpu", "L4", "--json"], capsys)
    assert json.loads(out)["model"]["name"] == "qwen-small"  # was the folder's
