"""More families, by class: OpenCV's CUDA module, the CUDA driver API's status by its number,
NPP, RAPIDS Memory Manager's pool, Graphcore's Poplar, Tenstorrent's tt-metal, SYCL's and
Level Zero's statuses, Vulkan renderers (VMA, DXVK), OpenGL, wgpu and SGLang.

The lines are written for the class they stand for, in wordings other than the held-out
corpus's (test_doctor_heldout.py has the real ones), and each class has near misses: an
out-of-resources error that is not about memory, a fallback the program went on after,
a warning, advice that only mentions memory, host RAM.
"""

from __future__ import annotations

from typing import Any

from doctor.class_tables import class_tests
from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.parse import parse_oom

POSITIVE: list[tuple[str, dict[str, Any]]] = [
    # OpenCV's CUDA modules: cv::Exception -217 with the runtime's text.
    (
        "cv2.error: OpenCV(4.8.0) /io/opencv/modules/core/src/cuda/gpu_mat.cu:121: error: "
        "(-217:Gpu API call) out of memory in function 'allocate'",
        {
            "kind": "driver",
            "category": "opencv_cuda_oom",
            "api_call": "allocate",
            "source_location": "gpu_mat.cu:121",
        },
    ),
    (
        "OpenCV Error: Gpu API call (out of memory) in allocate, file "
        "/build/opencv/modules/core/src/cuda/gpu_mat.cu, line 88",
        {"kind": "driver", "category": "opencv_cuda_oom", "source_location": "gpu_mat.cu:88"},
    ),
    (
        "modules/core/src/cuda_host_mem.cpp:210: error: (-217) out of memory in function create",
        {"kind": "driver", "category": "host_pinned_memory_oom", "device_type": "host"},
    ),
    # The CUDA driver API's status by its number (2 is CUDA_ERROR_OUT_OF_MEMORY).
    (
        "numba.cuda.cudadrv.driver.CudaAPIError: [2] Call to cuMemAlloc results in UNKNOWN_CUDA_ERROR",
        {"kind": "driver", "cuda_error_code": 2, "api_call": "cuMemAlloc"},
    ),
    (
        "[memsaver] CUresult error result=2 file=csrc/core.cpp func=cu_mem_map line=77",
        {
            "kind": "driver",
            "category": "cuda_driver_error_oom",
            "cuda_error_code": 2,
            "api_call": "cu_mem_map",
            "source_location": "core.cpp:77",
        },
    ),
    (
        'checkCudaErrors() Driver API error = 0002 "out of memory" from file <vectorAddDrv.cpp>, line 112.',
        {"kind": "driver", "cuda_error_code": 2, "source_location": "vectorAddDrv.cpp:112"},
    ),
    # NPP's statuses.
    (
        "RuntimeError: nppiResize_8u_C3R failed with status NPP_MEMORY_ALLOCATION_ERR",
        {"kind": "cuda_library", "category": "npp_alloc_failed"},
    ),
    (
        "NPP error: NPP_NO_MEMORY_ERROR in nppiFilter",
        {"kind": "cuda_library", "library_status": "NPP_NO_MEMORY_ERROR"},
    ),
    (
        "Unhandled exception. ManagedCuda.NPP.NPPException: Device allocation error\n"
        "   at ManagedCuda.NPP.NPPImage_8uC1..ctor(Int32 nWidthPixels, Int32 nHeightPixels)",
        {"kind": "cuda_library", "library_status": "NPP_MEMORY_ALLOCATION_ERR"},
    ),
    # RAPIDS Memory Manager.
    (
        "terminate called after throwing an instance of 'rmm::out_of_memory'\n"
        "  what():  out_of_memory: RMM failure at:/opt/rmm/include/rmm/mr/device/"
        "pool_memory_resource.hpp:255: Maximum pool size exceeded (failed to allocate 2.00 GiB)",
        {
            "kind": "driver",
            "category": "rmm_pool_exhausted",
            "requested_bytes": 2 * 1024**3,
            "source_location": "pool_memory_resource.hpp:255",
        },
    ),
    (
        "MemoryError: std::bad_alloc: out_of_memory: CUDA error at: /conda/include/rmm/mr/device/"
        "cuda_memory_resource.hpp:60: cudaErrorMemoryAllocation out of memory",
        {"kind": "driver", "category": "rmm_out_of_memory"},
    ),
    (
        "java.lang.OutOfMemoryError: std::bad_alloc: out_of_memory: RMM failure at:"
        "/build/rmm/mr/pinned_host_memory_resource.hpp:90: Maximum pool size exceeded",
        {"kind": "driver", "category": "host_pinned_memory_oom", "device_type": "host"},
    ),
    # Graphcore's Poplar.
    (
        "poplar::graph_memory_allocation_error: Memory allocation error : Out of memory on tile "
        "12: 700123 bytes used but tiles only have 638976 bytes of memory",
        {"kind": "device", "category": "poplar_tile_memory_exhausted", "device_type": "ipu"},
    ),
    (
        "Error: Out of memory: Cannot fit all variable data onto one or more tiles. Exiting.",
        {"kind": "device", "category": "poplar_tile_memory_exhausted"},
    ),
    # Tenstorrent's tt-metal.
    (
        "E       RuntimeError: TT_THROW @ tt_metal/impl/allocator/bank_manager.cpp:141: tt::exception\n"
        "E       info:\n"
        "E       Out of Memory: Not enough space to allocate 48814080 B L1 buffer across 60 banks, "
        "where each bank needs to store 813568 B",
        {"kind": "device", "category": "tt_metal_l1_oom", "requested_bytes": 48814080},
    ),
    (
        "TT_FATAL: Out of Memory: Not enough space to allocate 37888 B L1_SMALL buffer across 64 banks",
        {"kind": "device", "category": "tt_metal_l1_oom", "device_type": "tenstorrent"},
    ),
    (
        "Statically allocated circular buffers in program 77 clash with L1 buffers on core range "
        "[(x=0,y=0) - (x=7,y=7)]. L1 buffer allocated at 974336",
        {"kind": "device", "category": "tt_metal_l1_oom", "requested_bytes": None},
    ),
    # SYCL, Unified Runtime, Level Zero.
    (
        "RuntimeError: Native API failed. Native API returns: 39 (UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)",
        {
            "kind": "device",
            "category": "sycl_out_of_device_memory",
            "cuda_error": "UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",
            "cuda_error_code": 39,
        },
    ),
    (
        "llama_kv_cache_init: SYCL0 KV buffer size = 1024.00 MiB\n"
        "Native API failed. Native API returns: -5 (PI_ERROR_OUT_OF_RESOURCES) -5 (PI_ERROR_OUT_OF_RESOURCES)\n"
        "Exception caught at file:/llama.cpp/ggml/src/ggml-sycl/ggml-sycl.cpp, line:3213",
        {"kind": "ggml", "category": "ggml_sycl_out_of_resources", "cuda_error_code": -5},
    ),
    (
        "Native API failed. Native API returns: -6 (PI_ERROR_OUT_OF_HOST_MEMORY) -6 (PI_ERROR_OUT_OF_HOST_MEMORY)",
        {"kind": "host", "category": "sycl_out_of_host_memory", "device_type": "host"},
    ),
    (
        "zeMemAllocDevice failed: ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",
        {"kind": "device", "cuda_error": "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY"},
    ),
    # Vulkan renderers.
    (
        "[RenderSystem] OUT OF VIDEO MEMORY! ( vmaCreateImage )",
        {"kind": "vulkan", "api_call": "vmaCreateImage"},
    ),
    (
        "vmaAllocateMemoryForBuffer: out of device memory",
        {"kind": "vulkan", "category": "vulkan_out_of_device_memory"},
    ),
    (
        "err:   DxvkMemoryAllocator: Memory allocation failed\n"
        "  Size:      67108864\n  Alignment: 256\n  Mem flags: 0x7",
        {"kind": "vulkan", "requested_bytes": 67108864},
    ),
    (
        "vkCreateBuffer failed: VK_ERROR_OUT_OF_HOST_MEMORY",
        {"kind": "host", "category": "vulkan_out_of_host_memory"},
    ),
    # OpenGL.
    (
        "The application has requested more GPU memory than is available in the system.\n"
        "Error code: 6\n (pid=1234 tid=5678 game.exe 64bit)",
        {"kind": "device", "category": "nvidia_opengl_out_of_memory", "pid": 1234},
    ),
    (
        "glTexImage2D failed: GL_OUT_OF_MEMORY",
        {"kind": "device", "category": "opengl_out_of_memory"},
    ),
    # wgpu and WebGPU.
    (
        "wgpu error: Validation Error\n\nCaused by:\n  In Device::create_texture\n"
        "      note: label = `depth`\n    Not enough memory left.",
        {"kind": "device", "category": "wgpu_out_of_memory", "api_call": "Device::create_texture"},
    ),
    (
        "thread 'main' panicked at 'wgpu error: Out of Memory', src/render.rs:20",
        {"kind": "device", "category": "wgpu_out_of_memory"},
    ),
    (
        "Uncaught (in promise) GPUOutOfMemoryError: Failed to allocate buffer",
        {"kind": "device", "category": "wgpu_out_of_memory"},
    ),
    # SGLang.
    (
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
        "Current value: mem_fraction_static=0.84",
        {
            "kind": "device",
            "category": "sglang_kv_pool_does_not_fit",
            "advice": "Please try to increase --mem-fraction-static (now 0.84)",
        },
    ),
    (
        "RuntimeError: Prefill out of memory. Try to lower your batch size.\nTry to allocate 8192 tokens.",
        {"kind": "device", "category": "sglang_kv_pool_exhausted", "phase": "prefill"},
    ),
    (
        "RuntimeError: Decode out of memory. Try to lower your batch size.",
        {"kind": "device", "category": "sglang_kv_pool_exhausted", "phase": "decode"},
    ),
]


NEGATIVE = [
    # Out of resources that are not memory.
    "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 98304",
    "CUDA error: too many resources requested for launch (ERROR_LAUNCH_OUT_OF_RESOURCES)",
    "Native API failed. Native API returns: 40 (UR_RESULT_ERROR_OUT_OF_RESOURCES): "
    "work-group size 1024 exceeds the kernel's maximum, registers spilled",
    "RuntimeError: Native API failed. Native API returns: 20 (UR_RESULT_ERROR_DEVICE_LOST)",
    # The driver API's other statuses.
    "CUresult error result=700 file=csrc/core.cpp func=cu_mem_map line=77",
    "numba.cuda.cudadrv.driver.CudaAPIError: [1] Call to cuLaunchKernel results in CUDA_ERROR_INVALID_VALUE",
    "CUresult error result=20 file=x.cpp",
    # OpenCV's other CUDA errors.
    "error: (-217:Gpu API call) invalid device ordinal in function 'setDevice'",
    # A fallback the program went on after, and RMM's log of a tryAlloc.
    "vmaAllocateMemory failed for DEVICE_LOCAL memory, out of device memory: falling back to system memory",
    "[RMM] [error] [A][Stream 0][Upstream 256B][FAILURE maximum pool size exceeded]",
    # SGLang: the warning after which it retracts requests and goes on; and advice.
    "Decode out of memory happened. #retracted_reqs: 3, #new_token_ratio: 0.7 -> 1.0",
    "If you see out-of-memory errors during serving, set a smaller --mem-fraction-static.",
    # Poplar's advice and profile text, tt-metal's allocator notices.
    "Setting debug.allowOutOfMemory lets compilation continue when memory runs short on a tile.",
    "Allocated 117440512 B DRAM buffer across 12 banks",
    # NPP's other statuses, OpenGL's other errors, wgpu's validation errors.
    "nppiResize_8u_C3R failed with status NPP_SIZE_ERROR",
    "glTexImage2D failed: GL_INVALID_ENUM",
    "wgpu error: Validation Error\n\nCaused by:\n  In Device::create_buffer\n    Buffer size 9 is not aligned",
    # "Not enough memory left" outside a wgpu report: not the GPU's.
    "Not enough memory left on the SD card to save the photo",
]


test_each_class_is_recognised_with_its_figures, test_near_misses_are_not_recognised = class_tests(
    POSITIVE, NEGATIVE
)


def test_opencv_host_memory_after_the_device_one_is_a_second_message() -> None:
    text = (
        "cuda_info.cpp:80: error: (-217:Gpu API call) out of memory in function 'setDevice'\n"
        "cuda_host_mem.cpp:95: error: (-217:Gpu API call) out of memory in function 'allocate'"
    )
    facts = parse_oom(text)
    assert (facts.category, facts.api_call) == ("opencv_cuda_oom", "setDevice")
    assert [m.device_type for m in facts.additional_messages] == ["host"]


def test_sglang_startup_advice_says_to_raise_the_fraction() -> None:
    result = explain(
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
    )
    assert "--mem-fraction-static 0.9" in " ".join(result.diagnoses[-1].commands)


def test_rmm_pool_advice_names_the_pool_settings() -> None:
    result = explain(
        "MemoryError: std::bad_alloc: out_of_memory: RMM failure at:/x/rmm/mr/device/"
        "arena_memory_resource.hpp:159: Maximum pool size exceeded"
    )
    assert "maximum size" in result.diagnoses[-1].evidence
    assert any("maximum_pool_size" in command for command in result.diagnoses[-1].commands)


def test_a_new_anchor_word_in_many_lines_does_not_crowd_out_a_message() -> None:
    noise = "".join(f"step {n}: CUresult ok, circular buffers sized\n" * 40 for n in range(60))
    assert parse_oom(noise + "RuntimeError: CUDA error: out of memory\n").kind == "driver"
