"""``gpuwatch explain`` and ``gpuwatch fit`` through the real entry point (exit codes, JSON)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from doctor.cli_run import run
from doctor.fake_agent_server import FakeAgent

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA = FIXTURES / "llama-3.1-8b" / "config.json"
MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 20.00 MiB is free. Including non-PyTorch memory, this process "
    "has 1.20 GiB memory in use. Of the allocated memory 800.00 MiB is allocated by PyTorch, and "
    "100.00 MiB is reserved by PyTorch but unallocated."
)


def test_explain_json_from_a_file_with_the_live_view(
    tmp_path: Path, agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"step 10 loss 2.1\r\n\xff\xfe" + MESSAGE.encode() + b"\r\n")
    code, out, _ = run(["explain", str(log), "--json", "--agent", agent.url], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["recognized"] is True
    assert result["kind"] == "pytorch_allocator"
    assert result["device"] == "cuda:0"
    assert result["requested_bytes"] == 2 * 2**30
    assert result["other_processes"] == []
    assert result["diagnoses"][0]["fix"] == "other_processes"
    assert result["live"]["processes"][0]["pid"] == 4242


def test_explain_text_option_human_output(
    capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    code, out, _ = run(["explain", "--text", MESSAGE, "--agent", no_agent_url], capsys)
    assert code == 0
    assert out.startswith("Out of memory on cuda:0: PyTorch CUDA allocator")
    assert "$ gpuwatch status" in out


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:9402", "http://"])
def test_explain_refuses_an_agent_url_that_can_be_nobodys(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A typo in --agent was ignored and the live view silently left out.
    code, out, err = run(["explain", "--text", MESSAGE, "--agent", url], capsys)
    assert (code, out) == (3, "") and err.count("\n") == 1 and "--agent" in err
    code, out, _ = run(["explain", "--text", MESSAGE, "--agent", url, "--no-live"], capsys)
    assert code == 0 and out.startswith("Out of memory on cuda:0")


def test_explain_takes_the_message_pasted_as_its_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["explain", MESSAGE, "--json", "--no-live"], capsys)
    assert code == 0 and json.loads(out)["requested_bytes"] == 2 * 2**30
    # A name that is no file, and reads like no sentence, is still a missing file (exit 3).
    code, _, err = run(["explain", "train.log", "--no-live"], capsys)
    assert (
        code == 3
        and err.strip()
        == "gpuwatch: error: cannot read train.log: No such file or directory (to explain "
        "this text itself, use --text)"
    )
    # A short message with an OOM's words in it is the message, not a missing file.
    code, out, _ = run(["explain", "cudaErrorMemoryAllocation", "--json", "--no-live"], capsys)
    assert code == 0 and json.loads(out)["recognized"] is True
    # ... but a name like a file's, with such a word in it, is still a missing file.
    code, _, err = run(["explain", "cudnn_oom.log", "--no-live"], capsys)
    assert code == 3 and "cannot read cudnn_oom.log" in err
    # A file whose name happens to be a sentence is read as a file.
    (tmp_path / "a b c d").write_text(MESSAGE)
    code, out, _ = run(["explain", "a b c d", "--json", "--no-live"], capsys)
    assert code == 0 and json.loads(out)["recognized"] is True


def test_explain_reads_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(MESSAGE.encode())))
    code, out, _ = run(["explain", "-", "--json", "--no-live"], capsys)
    assert code == 0 and json.loads(out)["recognized"] is True


class _Pipe(io.RawIOBase):
    """A stream that cannot seek, as a pipe into stdin."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        chunk = self._data.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)


@pytest.mark.parametrize("via", ["file", "pipe"])
def test_an_input_past_the_limit_is_read_from_its_end(
    via: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A long training log ends with its OOM: past the limit, the end is what counts.
    import gpuwatch.cli.doctor as doctor_cli

    monkeypatch.setattr(doctor_cli, "MAX_INPUT_BYTES", 2**20)
    log = b"step 1 loss 0.5 lr 3e-4 nothing to see here\n" * 80_000 + MESSAGE.encode() + b"\n"
    assert len(log) > 3 * 2**20
    if via == "file":
        (tmp_path / "train.log").write_bytes(log)
        source = str(tmp_path / "train.log")
    else:
        pipe = io.BufferedReader(_Pipe(log))
        assert not pipe.seekable()
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(pipe))
        source = "-"
    code, out, err = run(["explain", source, "--json", "--no-live"], capsys)
    assert code == 0 and json.loads(out)["recognized"] is True
    assert "only its last 1.00 MiB were read" in err


@pytest.mark.parametrize("as_json", [False, True])
def test_not_an_oom_exits_6_with_one_line(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["explain", "--text", "epoch 3: loss 0.41, CUDA memory allocated 9.8 GiB", "--no-live"]
    code, out, err = run([*args, "--json"] if as_json else args, capsys)
    assert code == 6
    assert err.strip().splitlines() == [
        "gpuwatch: error: not an OOM message I recognise: this does not look like an "
        "out-of-memory error"
    ]
    if as_json:
        assert json.loads(out)["recognized"] is False
    else:
        assert out == ""


def test_missing_file_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["explain", str(tmp_path / "absent.log"), "--no-live"], capsys)
    assert code == 3
    assert "Traceback" not in err


def test_fit_json_breakdown_matches_published_figures(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["fit", "--config", str(LLAMA), "--gpu", "H100-80GB", "--context", "8192", "--json"], capsys
    )
    assert code == 0
    result = json.loads(out)
    assert result["model"]["params"] == 8_030_261_248
    assert result["kv_cache_bytes_per_token"] == 131_072
    assert result["breakdown"]["weights_bytes"] == 8_030_261_248 * 2
    assert result["breakdown"]["kv_cache_bytes"] == 131_072 * 8192
    assert result["gpus"][0]["verdict"] == "fits"


def test_fit_json_verdict_is_the_best_gpus_and_says_tight(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 19 GiB leaves 10-15 % headroom (tight), 18 GiB too little, 24 GiB enough.
    def verdicts(*gpus: str) -> tuple[int, str, list[str]]:
        code, out, _ = run(
            ["fit", "--config", str(LLAMA), *(a for g in gpus for a in ("--gpu", g)), "--json"],
            capsys,
        )
        result = json.loads(out)
        return code, result["verdict"], [g["verdict"] for g in result["gpus"]]

    assert verdicts("19GiB") == (0, "tight", ["tight"])  # tight still fits, for scripts
    assert verdicts("18GiB") == (10, "does_not_fit", ["does_not_fit"])
    assert verdicts("18GiB", "19GiB") == (0, "tight", ["does_not_fit", "tight"])
    assert verdicts("19GiB,24GiB", "18GiB") == (0, "fits", ["tight", "fits", "does_not_fit"])
    code, _, err = run(["fit", "--config", str(LLAMA), "--gpu", "19GiB,", "--json"], capsys)
    assert code == 3 and "empty GPU name" in err


def test_fit_human_output_names_what_makes_it_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["fit", "--params", "70B", "--gpu", "RTX4090"], capsys)
    assert code == 10  # does not fit: a verdict scripts can branch on
    assert "does NOT fit: needs " in out and "x the card" in out
    assert "makes it fit:" in out
    assert "% headroom" not in out  # was "-401% headroom"


def test_fit_params_only_agrees_with_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    # The case: --params 8B said "fits (77% headroom)", the config said no.
    # Without checkpointing (QLoRA's default is on, as PEFT turns it on).
    off = "--no-gradient-checkpointing"
    by_params = run(
        ["fit", "--params", "8B", "--mode", "qlora", off, "--gpu", "24GiB", "--json"], capsys
    )
    by_config = run(
        ["fit", "--config", str(LLAMA), "--mode", "qlora", off, "--gpu", "24GiB", "--json"],
        capsys,
    )
    for code, out, _ in (by_params, by_config):
        assert code == 10
        result = json.loads(out)
        assert result["verdict"] == "does_not_fit"
        assert result["gpus"][0]["verdict"] == "does_not_fit"
        assert result["breakdown"]["activations_bytes"] > 15 * 2**30
    guessed = json.loads(by_params[1])
    assert "activations" in guessed["estimated"]
    assert guessed["breakdown"]["total_low_bytes"] <= guessed["breakdown"]["total_bytes"]
    assert json.loads(by_config[1])["estimated"] == []


def test_fit_unknown_names_the_missing_input_and_exits_11(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(["fit", "--params", "8B", "--context", "131072", "--gpu", "A6000"], capsys)
    assert code == 11
    assert "cannot tell" in out and "KV cache" in out and "--config config.json" in out
    code, out, _ = run(
        ["fit", "--params", "8B", "--context", "131072", "--gpu", "A6000", "--json"], capsys
    )
    result = json.loads(out)
    assert code == 11 and result["verdict"] == "unknown"
    assert "--config" in result["unknown_because"]


def test_fit_fits_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["fit", "--params", "8B", "--gpu", "H100-80GB"], capsys)
    assert code == 0 and "fits (" in out


@pytest.mark.parametrize(
    "args",
    [
        ["fit", "--params", "8B", "--gpu", "RTX9999"],
        ["fit", "--params", "eight", "--gpu", "RTX4090"],
        ["fit", "--params", "7", "--gpu", "T4"],  # 7 parameters: a forgotten B
        ["fit", "--params", "8B", "--mode", "full", "--dtype", "int4", "--gpu", "RTX4090"],
        ["fit", "--gpu", "RTX4090"],
        ["fit", "--params", "8B", "--config", str(LLAMA), "--gpu", "RTX4090"],
    ],
)
def test_fit_bad_options_exit_3(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(args, capsys)
    assert code == 3
    assert err.startswith("gpuwatch: error: ")


def test_fit_local_uses_the_agents_gpus(
    agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        ["fit", "--params", "8B", "--gpu", "local", "--agent", agent.url, "--json"], capsys
    )
    assert code == 0
    gpu = json.loads(out)["gpus"][0]
    assert gpu["name"] == "GPU 0 (NVIDIA GeForce RTX 4090)"
    assert gpu["fits_free_now"] is False  # 2 GiB free: the notebook holds the rest


def test_explain_does_not_attach_a_card_of_another_size(
    agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not isinstance(agent.snapshot, (bytes, int))
    gpu = agent.snapshot.gpus[0].model_copy(update={"memory_total_bytes": 48 * 2**30})
    agent.snapshot = agent.snapshot.model_copy(update={"gpus": [gpu]})
    code, out, _ = run(["explain", "--text", MESSAGE, "--agent", agent.url], capsys)
    assert code == 0
    assert (
        "note: this message is from a 23.65 GiB card; this host's GPU 0 has 48.00 GiB: "
        "live context not attached"
    ) in out
    assert "Right now on" not in out


def test_explain_an_npu_message_names_its_allocator_and_gets_no_nvidia_context(
    agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    # torch_npu's copy of the allocator: its own variable, and this host's NVIDIA GPU 0
    # (whatever its size) is not the card that failed.
    npu = (
        "RuntimeError: NPU out of memory. Tried to allocate 5.03 GiB (NPU 3; 60.96 GiB total "
        "capacity; 49.47 GiB already allocated; 49.47 GiB current active; 1.32 GiB free; "
        "57.55 GiB reserved in total by PyTorch)"
    )
    code, out, _ = run(["explain", "--text", npu, "--agent", agent.url], capsys)
    assert code == 0
    assert out.startswith("Out of memory on npu:3: PyTorch NPU allocator (RuntimeError)")
    assert "$ export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in out
    assert "note: this message is about NPU memory; this host's agent sees NVIDIA GPUs" in out
    assert "Right now on" not in out


@pytest.mark.parametrize(
    ("message", "headline", "command"),
    [
        (
            "Out of memory error on GPU 0. Cannot allocate 56.000000MB memory on GPU 0, "
            "7.782776GB memory has been allocated and available memory is only 12.750000MB.",
            "Out of memory on cuda:0: PaddlePaddle allocator",
            "lower the batch size",
        ),
        (
            "[TRT] [E] 2: [virtualMemoryBuffer.cpp::resizePhysical::145] Error Code 2: "
            "OutOfMemory (no further information)",
            "Out of memory: TensorRT",
            "trtexec --onnx=model.onnx --memPoolSize=workspace:1024",
        ),
        (
            "Non-zero status code returned while running ReduceSum node. "
            "onnxruntime::BFCArena::AllocateRawInternal Failed to allocate memory for "
            "requested buffer of size 939524096",
            "Out of memory: ONNX Runtime memory arena",
            '"arena_extend_strategy": "kSameAsRequested"',
        ),
        (
            'Error: Warmup(Generation("Not enough memory to handle 4096 prefill tokens. '
            'You need to decrease `--max-batch-prefill-tokens`"))',
            "Out of memory: TGI warm-up",
            "$ text-generation-launcher --model-id MODEL --max-batch-prefill-tokens 2048",
        ),
        (
            "[HAMI-core ERROR (pid:25 thread=139892685178688 allocator.c:53)]: "
            "Device 0 OOM 27147995136 / 25757220864",
            "Out of memory on cuda:0: HAMi pod GPU share",
            "this allocation would have taken it to 25.28 GiB: the pod's share ran out",
        ),
        (
            "(NCudaLib::TOutOfMemoryError) catboost/cuda/cuda_lib/memory_pool/"
            "stack_like_memory_pool.h:303: Error: Out of memory. Requested 776.3222656 MB; "
            "Free 676.4537106 MB",
            "Out of memory: CatBoost GPU memory pool (NCudaLib::TOutOfMemoryError)",
            "max_ctr_complexity=1",
        ),
        (
            "RuntimeError: Insufficient VRAM for model and cache",
            "Out of memory: ExLlamaV2 loader (RuntimeError)",
            "--cache_8bit or --cache_4bit",
        ),
        (
            "[ERROR] PRE_ACT(54175,fffdbcff91e0,python):2024-10-22-11:24:55.301.443 "
            "[mindspore/ccsrc/backend/common/mem_reuse/mem_dynamic_allocator.cc:392] "
            "AddMemBlockAndMemBufByEagerFree] TotalUsedMemStatistics : 29356337664 plus "
            "TotalUsedByEventMemStatistics : 0 and plus alloc size : 301990400 is more than "
            "total mem size : 29464985600.",
            "Out of memory: MindSpore device memory pool",
            'mindspore.set_context(max_device_memory="30GB")',
        ),
        (
            "[TensorRT-LLM][ERROR] CUDA runtime error in ::cudaMallocAsync(ptr, n, "
            "mCudaStream->get()): out of memory (/app/tensorrt_llm/cpp/tensorrt_llm/runtime/"
            "tllmBuffers.h:112)",
            "Out of memory: TensorRT",
            "kv_cache_free_gpu_mem_fraction: 0.8",
        ),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: "
            "can't allocate memory: you tried to allocate 12582912000 bytes. Error code 12 "
            "(Cannot allocate memory)",
            "Out of memory: host memory (not the GPU)",
            "look at what holds system RAM",
        ),
        (
            "[h264_nvenc @ 0x5601aa5b40c0] OpenEncodeSessionEx failed: out of memory (10)",
            "Out of memory: NVENC video encoder",
            "nvidia-smi --query-gpu=encoder.stats.sessionCount --format=csv",
        ),
        # Kind "device", from a family of its own: the headline names it.
        (
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
            "Out of memory: SGLang (RuntimeError)",
            "--mem-fraction-static 0.9",
        ),
        (
            "Out of Memory: Not enough space to allocate 117440512 B DRAM buffer across 12 "
            "banks, where each bank needs to store 9787392 B, but bank size is only "
            "1046181792 B (assert.hpp:103)",
            "Out of memory: Tenstorrent tt-metal\n  requested 112.00 MiB",
            "tt-smi",
        ),
    ],
    ids=[
        "paddle",
        "tensorrt",
        "onnxruntime",
        "tgi",
        "hami",
        "catboost",
        "exllama",
        "mindspore",
        "tensorrt-llm",
        "cpu-allocator",
        "nvenc",
        "sglang",
        "tt-metal",
    ],
)
def test_explain_other_frameworks_get_their_own_fix(
    message: str, headline: str, command: str, capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    code, out, _ = run(["explain", "--text", message, "--agent", no_agent_url], capsys)
    assert code == 0
    assert out.startswith(headline)
    assert command in out


def test_explain_uses_the_figures_a_raw_cuda_error_printed(
    capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    # Theano's wording carries the driver's free and total: the evidence must use them,
    # not the raw-CUDA-error text written for messages without figures.
    message = (
        "Error allocating 33554432 bytes of device memory (out of memory). "
        "Driver report 21364736 bytes free and 11715084288 bytes total"
    )
    code, out, _ = run(["explain", "--text", message, "--agent", no_agent_url], capsys)
    assert code == 0
    assert "requested 32.00 MiB   free 20.38 MiB of 10.91 GiB" in out
    assert "the card was full (20.38 MiB free of 10.91 GiB)" in out
    assert "printed no sizes" not in out


def test_explain_a_rocm_message_points_at_rocm_tools_not_nvidia_smi(
    capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    message = (
        "MIOpen Error: /data/repo/MIOpen/src/hip/handlehip.cpp:70: "
        "Memory not available to allocate buffer: 655360000"
    )
    code, out, _ = run(["explain", "--text", message, "--agent", no_agent_url], capsys)
    assert code == 0
    assert out.startswith("Out of memory: HIP runtime (ROCm)")
    assert "rocm-smi --showpids" in out
    assert "nvidia-smi" not in out


def test_explain_without_input_at_a_terminal_prints_a_hint_and_exits_2(tmp_path: Path) -> None:
    # stdin is a real terminal (a pty): the old behaviour was a silent wait for Ctrl-D.
    import os
    import pty
    import subprocess

    leader, follower = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "explain", "--no-live"],
            stdin=follower,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
        )
    finally:
        os.close(follower)
        os.close(leader)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "gpuwatch explain FILE" in result.stderr and "| gpuwatch explain" in result.stderr
    assert result.stdout == ""


def test_explain_a_tools_failed_allocation_uses_the_request_and_free_it_printed(
    capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    # A tool's own wording (GrabGPU's) with the request and what was free, no total: the
    # figures are shown, and the evidence does not claim the message had none.
    message = "GPU-1: Failed to allocate 16.00 GB GPU memory (0.00 GB available)"
    code, out, _ = run(["explain", "--text", message, "--agent", no_agent_url], capsys)
    assert code == 0
    assert out.startswith("Out of memory on cuda:1: CUDA runtime/driver")
    assert "requested 16.00 GiB   free 0 bytes" in out
    assert "printed only the request and what was free" in out
    assert "printed no sizes" not in out


@pytest.mark.parametrize(
    ("message", "holders"),
    [
        (
            "Error while calling cudaMalloc(&data, new_size*sizeof(float)) in file "
            "dlib/cuda/gpu_data.cpp:221. code: 2, reason: out of memory",
            "nvidia-smi --query-compute-apps",
        ),
        ("Cuda error: cudaMallocHost h_buf failed: out of memory.", "free -h"),
    ],
    ids=["device-call", "pinned-host-call"],
)
def test_explain_a_check_that_names_the_runtime_call_points_at_its_memory(
    message: str, holders: str, capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    code, out, _ = run(["explain", "--text", message, "--agent", no_agent_url], capsys)
    assert code == 0
    assert out.startswith("Out of memory: CUDA runtime/driver")
    assert holders in out


@pytest.mark.parametrize(
    ("message", "headline"),
    [
        # ggml's CUDA_CHECK in a HIP build names its backend "ROCm" (blind-25); the
        # check's "current device ... at ggml-cuda/common.cuh" makes it llama.cpp's.
        (
            "ROCm error: out of memory\n  current device: 0, in function stream at "
            "//ml/backend/ggml/ggml/src/ggml-cuda/common.cuh",
            "Out of memory on hip:0: llama.cpp (ggml)",
        ),
        # HIP's older enum name, an alias of hipErrorOutOfMemory (blind-26).
        (
            "But the dvptr is NULL after invoke hipMalloc(). And it returns hipErrorMemoryAllocation.",
            "Out of memory: HIP runtime (ROCm)",
        ),
    ],
    ids=["ggml-rocm-check", "hip-old-enum"],
)
def test_explain_hips_other_names_for_its_runtime_error_point_at_rocm_tools(
    message: str, headline: str, capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    code, out, _ = run(["explain", "--text", message, "--agent", no_agent_url], capsys)
    assert code == 0
    assert out.startswith(headline)
    assert "rocm-smi --showpids" in out
    assert "nvidia-smi" not in out


def test_explain_a_title_that_goes_on_in_another_script_after_the_first_line(
    capsys: pytest.CaptureFixture[str], no_agent_url: str
) -> None:
    # "cuda out of memory" followed straight by Chinese (blind-26): \b sees no boundary
    # between "y" and "的", so only an ASCII letter or digit after it may disqualify it.
    message = "请问您在训练的时候有没有遇到过cuda out of memory的情况？"
    code, out, _ = run(["explain", "--text", message, "--agent", no_agent_url], capsys)
    assert code == 0
    assert out.startswith("Out of memory: PyTorch CUDA allocator")
    assert "paste the whole message" in out
    # An ASCII word glued on is another word, not the allocator's line.
    code, _, _ = run(
        ["explain", "--text", "cuda out of memoryless", "--agent", no_agent_url], capsys
    )
    assert code == 6


@pytest.mark.parametrize("how", ["argument", "text", "stdin", "file"])
def test_empty_input_is_exit_3_however_it_comes(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blank = tmp_path / "blank.log"
    blank.write_text("\n  \n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"  \n")))
    args = {"argument": [""], "text": ["--text", " "], "stdin": ["-"], "file": [str(blank)]}[how]
    code, _, err = run(["explain", *args, "--no-live"], capsys)
    assert code == 3 and "nothing to explain: the input is empty" in err
