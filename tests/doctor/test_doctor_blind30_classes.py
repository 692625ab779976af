"""The classes blind-30 showed missing or misread: NVENC, OpenCL's status by its number,
applications' own words for host RAM (Ollama, Unity, Unreal Engine, LMCache), TGI's warm-up
with a total, AWS Neuron, the GPU's memory called RAM, DirectML's E_OUTOFMEMORY, a CUDA
check's "error 2 in file F line N", llama.cpp's older Metal status, and NCCL's named failure.

The lines are written for the class they stand for, in wordings other than the held-out
corpus's (test_doctor_heldout.py has the real ones), and each class has near misses: the
same API's other statuses, another number, the same words without the context that makes
them the GPU's, a retry.
"""

from __future__ import annotations

from typing import Any

from doctor.class_tables import class_tests
from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.parse import parse_oom

MIB = 1024**2

POSITIVE: list[tuple[str, dict[str, Any]]] = [
    # NVENC: NV_ENC_ERR_OUT_OF_MEMORY (10), however the program prints it.
    (
        "[hevc_nvenc @ 0x7f3a2c00a880] InitializeEncoder failed: out of memory (10): (no details)",
        {
            "kind": "nvenc",
            "category": "nvenc_out_of_memory",
            "api_call": "nvEncInitializeEncoder",
            "cuda_error_code": 10,
        },
    ),
    (
        "[av1_nvenc @ 0x55e1c2f0] CreateInputBuffer failed: out of memory (10)\n"
        "Error initializing output stream 0:0 -- Error while opening encoder",
        {"kind": "nvenc", "api_call": "nvEncCreateInputBuffer"},
    ),
    (
        "NvEncoder::CreateEncoder : m_nvenc.nvEncOpenEncodeSessionEx(&encodeSessionExParams, "
        "&hEncoder) returned error 10 at src/NvEncoder.cpp:54",
        {"kind": "nvenc", "api_call": "nvEncOpenEncodeSessionEx"},
    ),
    (
        "[NVENC encoder: 'simple_h264_stream'] init_encoder: nvEncOpenEncodeSessionEx failed: "
        "10 (NV_ENC_ERR_OUT_OF_MEMORY)",
        {"kind": "nvenc", "cuda_error": "NV_ENC_ERR_OUT_OF_MEMORY"},
    ),
    (
        "nvenc : Error on NvEncOpenEncodeSessionEx(device_type=NV_ENC_DEVICE_TYPE_DIRECTX): 10 "
        "(NVENC indicates that the API call failed because it was unable to allocate enough "
        "memory to perform the requested operation.)",
        {"kind": "nvenc", "api_call": "NvEncOpenEncodeSessionEx"},
    ),
    # OpenCL's status by its number, next to the call; -5 and -6 by name too.
    (
        "clCreateBuffer failed with error -4 (size 3221225472)",
        {
            "kind": "opencl",
            "category": "opencl_mem_object_allocation_failure",
            "api_call": "clCreateBuffer",
            "cuda_error_code": -4,
        },
    ),
    (
        "miner 2: OpenCL error -4 when calling clEnqueueWriteBuffer for the DAG",
        {"kind": "opencl", "api_call": "clEnqueueWriteBuffer"},
    ),
    (
        "clEnqueueNDRangeKernel(queue, kernel, 2, NULL, global, NULL, 0, NULL, NULL) = -5",
        {"kind": "opencl", "category": "opencl_out_of_resources", "cuda_error_code": -5},
    ),
    (
        "clCreateContext returned -6",
        {"kind": "host", "category": "opencl_out_of_host_memory", "device_type": "host"},
    ),
    (
        "clFinish failed: CL_OUT_OF_HOST_MEMORY",
        {"kind": "host", "cuda_error": "CL_OUT_OF_HOST_MEMORY", "api_call": "clFinish"},
    ),
    # Applications' own words for system RAM.
    (
        'Error: {"error":"model requires more system memory (5.8 GiB) than is available (4.7 GiB)"}',
        {
            "kind": "host",
            "category": "ollama_system_memory",
            "requested_bytes": round(5.8 * 1024**3),
            "free_bytes": round(4.7 * 1024**3),
        },
    ),
    (
        "Error: 500 Internal Server Error: model requires more system memory than is currently available",
        {"kind": "host", "category": "ollama_system_memory", "requested_bytes": None},
    ),
    (
        "Could not allocate memory: System out of memory!\n"
        "Trying to allocate: 1048576B with 16 alignment. MemoryLabel: Texture",
        {"kind": "host", "category": "unity_out_of_memory", "requested_bytes": 1048576},
    ),
    (
        "DynamicHeapAllocator out of memory - Could not get memory for large allocation 134217728!",
        {"kind": "host", "category": "unity_out_of_memory", "requested_bytes": 134217728},
    ),
    (
        "Fatal error: [File:D:/build/++UE5/Sync/Engine/Source/Runtime/Core/Private/Windows/"
        "WindowsPlatformMemory.cpp] [Line: 207] Ran out of memory allocating 1073741824 bytes "
        "with alignment 16",
        {"kind": "host", "category": "unreal_out_of_memory", "requested_bytes": 1073741824},
    ),
    (
        "Failed to allocate memory for tensor(torch.Size([2, 32, 256, 1024]), torch.bfloat16) "
        "because no memory is available",
        {
            "kind": "host",
            "category": "lmcache_buffer_full",
            "tensor_shape": "[2, 32, 256, 1024]",
            "dtype": "bfloat16",
        },
    ),
    (
        "Failed to allocate memory block of size 2097152 because no memory is available",
        {"kind": "host", "category": "lmcache_buffer_full", "requested_bytes": 2097152},
    ),
    # TGI's warm-up, with the batch's total.
    (
        'Error: Warmup(Generation("Not enough memory to handle 32768 total tokens with 4096 '
        "prefill tokens. You need to decrease `--max-batch-total-tokens` or "
        '`--max-batch-prefill-tokens`"))',
        {
            "kind": "tgi",
            "category": "tgi_warmup_total_tokens",
            "prefill_tokens": 4096,
            "kv_cache_tokens": 32768,
        },
    ),
    # AWS Neuron.
    (
        'RuntimeError: nrt_load status=4 message="Allocation Failure"',
        {"kind": "device", "category": "neuron_device_alloc_failed", "device_type": "neuron"},
    ),
    (
        "2024-Jul-10 09:14:35.191118 12878:14362 ERROR  TDRV:log_dev_mem   Failed to allocate "
        "43.325MB (usage: dma rings) on ND 3:NC 0, current utilization:\n\t* total: 15.972GB",
        {"kind": "device", "device_type": "neuron", "device_index": 3},
    ),
    (
        "[TDRV:dmem_alloc_internal] Failed to alloc DEVICE memory: 536870912",
        {"kind": "device", "device_type": "neuron", "requested_bytes": 536870912},
    ),
    (
        "ERROR   NRT:nrt_infodump   Failure: NRT_RESOURCE in nrt_load()",
        {"kind": "device", "category": "neuron_device_alloc_failed"},
    ),
    (
        "[TDRV:dmem_alloc_internal] Failed to alloc HOST memory: 1048576",
        {"kind": "host", "category": "neuron_host_alloc_failed", "requested_bytes": 1048576},
    ),
    # The GPU's memory called RAM (the fallback for other wordings).
    (
        "Not enough GPU RAM free (1024MB free, need at least 2048MB)",
        {"kind": "device", "free_bytes": 1024 * MIB, "requested_bytes": 2048 * MIB},
    ),
    ("Renderer: out of video RAM while uploading the texture atlas", {"kind": "device"}),
    # DirectML: Windows' E_OUTOFMEMORY where DirectML or Direct3D 12 is named.
    (
        "onnxruntime\\core\\providers\\dml\\DmlExecutionProvider\\src\\ExecutionProvider.cpp(563)"
        "\\onnxruntime_pybind11_state.pyd!00007FF8: (caller: 00007FF8) Exception(3) tid(2a1c) "
        "8007000E Not enough memory resources are available to complete this operation.",
        {"kind": "directml", "category": "directml_e_outofmemory", "device_type": "dml"},
    ),
    (
        "D3D12: CreateCommittedResource failed with HRESULT 0x8007000E (E_OUTOFMEMORY)",
        {"kind": "directml", "cuda_error": "E_OUTOFMEMORY"},
    ),
    (
        "[torch_directml] RuntimeError: Unknown error -2147024882",
        {"kind": "directml"},
    ),
    # A check that prints the runtime's status and text: kind driver.
    (
        "amrex::Abort::3::CUDA error 2 in file ../Src/Base/AMReX_GpuDevice.cpp line 412: "
        "out of memory !!!",
        {
            "kind": "driver",
            "category": "cuda_runtime_error_oom",
            "source_location": "AMReX_GpuDevice.cpp:412",
        },
    ),
    (
        "HIP error 2 in file Src/Base/AMReX_Arena.cpp line 169: out of memory",
        {"kind": "driver", "device_type": "hip"},
    ),
    ("CUDA error 2: out of memory", {"kind": "driver", "device_type": "cuda"}),
    # llama.cpp's older Metal backend: the status, then the words.
    (
        "ggml_metal_graph_compute: command buffer 1 failed with status 5\nerror: out of memory",
        {"kind": "metal", "category": "metal_command_buffer_oom"},
    ),
    # NCCL: the failure it names, each line behind a prefix.
    (
        "host-3: ncclUnhandledCudaError: Call to CUDA function failed.\nhost-3: Last error:\n"
        "host-3: Cuda failure 'out of memory'",
        {"kind": "nccl", "category": "nccl_cuda_oom"},
    ),
    (
        "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
        "Cuda failure 2 'out of memory'",
        {"kind": "nccl", "category": "nccl_cuda_oom"},
    ),
    (
        "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:47, unhandled cuda error, NCCL "
        "version 2.7.8\nncclUnhandledCudaError: Call to CUDA function failed.",
        {"kind": "nccl", "category": "nccl_unhandled_cuda_error"},
    ),
]


NEGATIVE = [
    # NVENC's other statuses, and "out of memory (10)" from another encoder.
    "[h264_nvenc @ 0x5601aa5b40c0] OpenEncodeSessionEx failed: unsupported device (2): (no details)",
    "[h264_nvenc @ 0x5601aa5b40c0] No capable devices found",
    "[hevc_nvenc @ 0x5601aa5b40c0] InitializeEncoder failed: invalid param (8): Invalid Level.",
    "init_encoder: nvEncOpenEncodeSessionEx failed: 15 (NV_ENC_ERR_INVALID_VERSION)",
    "NvEncoder::CreateEncoder : m_nvenc.nvEncOpenEncodeSessionEx(&params, &hEncoder) returned error 2",
    "[libx264 @ 0x5601aa5b40c0] frame thread creation failed: out of memory (10)",
    # OpenCL's other statuses, and -5 for a launch resource.
    "clCreateBuffer failed with error -61",
    "clEnqueueNDRangeKernel failed: err = -54",
    "clEnqueueNDRangeKernel -5: local work-group size 1024 exceeds the device's maximum",
    "clBuildProgram -11",
    # Host RAM in prose, and Unity's probe, which it retries.
    "The 70B model requires more system memory than is available on most laptops.",
    "DynamicHeapAllocator allocation probe 1 failed - Could not get memory for large allocation 8388608.",
    # AWS Neuron: too few NeuronCores, another status.
    "NRTD response code 'NERR_RESOURCE_NC' (9) There were insufficent NCs for the requested operation",
    'nrt_tensor_allocate status=2 message="Invalid argument"',
    # RAM alone is the host's, not the GPU's.
    "Not enough RAM free (1024MB free, need at least 2048MB)",
    # E_OUTOFMEMORY without DirectML around it (dmlc-core is not DirectML).
    "CreateFileMapping failed: 0x8007000E Not enough memory resources are available to complete this operation.",
    "dmlc-core/src/io/local_filesys.cc:209: error 8007000E",
    # A CUDA check's other status.
    "amrex::Abort::0::CUDA error 700 in file ../Src/Base/AMReX_GpuDevice.cpp line 600: an "
    "illegal memory access was encountered !!!",
    # Metal's status 5 with another error, or alone.
    "ggml_metal_graph_compute: command buffer 0 failed with status 5\nerror: Internal Error "
    "(0000000e:Internal Error)",
    "ggml_metal_graph_compute: command buffer 0 failed with status 5",
    # NCCL naming another CUDA failure, behind prefixes or in its WARN line before.
    "node-7: ncclUnhandledCudaError: Call to CUDA function failed.\nnode-7: Last error:\n"
    "node-7: Cuda failure 'initialization error'",
    "[rank1]: ncclUnhandledCudaError: Call to CUDA function failed.\n[rank1]: Last error:\n"
    "[rank1]: Cuda failure 3 'initialization error'",
    "gpu-node:1234:1240 [0] include/alloc.h:48 NCCL WARN Cuda failure 'an illegal memory access "
    "was encountered'\nRuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1191, unhandled cuda "
    "error, NCCL version 2.14.3\nncclUnhandledCudaError: Call to CUDA function failed.",
]


test_each_class_is_recognised_with_its_figures, test_near_misses_are_not_recognised = class_tests(
    POSITIVE, NEGATIVE
)


def test_nvenc_advice_counts_the_sessions_before_freeing_video_memory() -> None:
    result = explain("[h264_nvenc @ 0x55] OpenEncodeSessionEx failed: out of memory (10)")
    first = result.diagnoses[0]
    assert "GeForce" in first.evidence
    assert "session" in first.summary
    sessions = "nvidia-smi --query-gpu=encoder.stats.sessionCount --format=csv"
    assert first.commands[0].startswith(sessions)
    assert first.commands.index(first.commands[0]) < first.commands.index("gpuwatch status")


def test_opencl_out_of_resources_advice_says_it_may_be_a_kernel_fault() -> None:
    result = explain("clEnqueueReadBuffer failed: CL_OUT_OF_RESOURCES")
    assert "out of bounds" in result.diagnoses[-1].evidence


def test_ollama_evidence_states_both_sizes() -> None:
    result = explain(
        "Error: model requires more system memory (5.8 GiB) than is available (4.7 GiB)"
    )
    evidence = result.diagnoses[-1].evidence
    assert "5.80 GiB" in evidence and "4.70 GiB" in evidence
    assert any(command.startswith("ollama ps") for command in result.diagnoses[-1].commands)


def test_tgi_total_tokens_advice_lowers_the_total() -> None:
    result = explain(
        "Not enough memory to handle 32768 total tokens with 4096 prefill tokens. You need to "
        "decrease `--max-batch-total-tokens` or `--max-batch-prefill-tokens`"
    )
    commands = " ".join(d for diagnosis in result.diagnoses for d in diagnosis.commands)
    assert "--max-batch-total-tokens 16384" in commands


def test_neuron_holders_are_listed_with_neurons_tools() -> None:
    result = explain("[TDRV:dmem_alloc] Failed to alloc DEVICE memory: 4194304")
    assert any(command.startswith("neuron-ls") for command in result.diagnoses[-1].commands)


def test_the_new_anchor_words_in_many_lines_do_not_crowd_out_a_message() -> None:
    noise = "".join(
        f"step {n}: clEnqueueNDRangeKernel ok, clFinish ok, nrt_tensor_allocate ok\n" * 40
        for n in range(60)
    )
    assert parse_oom(noise + "RuntimeError: CUDA error: out of memory\n").kind == "driver"
