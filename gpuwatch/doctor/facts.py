"""What one OOM message says, as printed: the output of :func:`gpuwatch.doctor.parse.parse_oom`.

Fields are exactly what the text states (converted to bytes), or ``None`` when the
message has no such clause. Nothing is guessed here: odd values such as NVML's
``17179869184.00 GiB`` (2**64, "not available") or ``this process has 0 bytes`` are kept
as printed, and :mod:`gpuwatch.doctor.diagnosis` decides what they mean.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The coarse family, which decides the kind of fix. Documented in docs/doctor.md.
Kind = Literal[
    # PyTorch's CUDA caching allocator (also cudaMallocAsync, legacy THC), and the copies
    # of it that out-of-tree devices ship with the same wording (Ascend NPU, MUSA, MLU).
    "pytorch_allocator",
    "hip",  # the same allocator on ROCm
    "xpu",  # the same allocator on Intel GPUs (and IPEX)
    "mps",  # PyTorch on Apple silicon
    "metal",  # a Metal command buffer out of memory (llama.cpp's Metal backend, MLX)
    "driver",  # a raw CUDA/HIP runtime or driver "out of memory" (also CuPy, Numba, RMM)
    "cublas",
    "cuda_library",  # another CUDA library's allocation status: cuFFT, cuSOLVER, cuSPARSE, ...
    "cudnn",
    "nccl",
    "bitsandbytes",
    "cupy",
    "ggml",  # llama.cpp
    "xla",  # JAX / XLA RESOURCE_EXHAUSTED
    "tensorflow",
    "paddle",  # PaddlePaddle's allocator ("Out of memory error on GPU 0. Cannot allocate ...")
    "onnxruntime",  # ONNX Runtime's memory arena (BFCArena)
    "tensorrt",  # TensorRT's builder or runtime
    "tgi",  # Hugging Face Text Generation Inference: its start-up warm-up did not fit
    "hami",  # HAMi (Kubernetes GPU sharing): the pod's share of the GPU ran out
    "vulkan",  # a Vulkan compute backend (MLC-LLM/TVM, Mesa): VK_ERROR_OUT_OF_DEVICE_MEMORY
    "directml",  # DirectML on Windows (torch-directml)
    "opencl",  # OpenCL: CL_MEM_OBJECT_ALLOCATION_FAILURE
    "hpu",  # Intel Gaudi's runtime (PT_DEVMEM)
    "cann",  # Huawei Ascend's runtime (CANN: EL0004, 207001)
    "mindspore",  # MindSpore's device memory pool (Ascend NPU or GPU)
    "exllama",  # ExLlamaV2's loader: the model and its KV cache do not fit the GPUs it may use
    "catboost",  # CatBoost's GPU trainer: its memory pool (a share of the free GPU) ran out
    # NVENC, NVIDIA's video encoder: NV_ENC_ERR_OUT_OF_MEMORY (10), which GeForce drivers also
    # return when their cap on simultaneous encode sessions is reached.
    "nvenc",
    # A GPU's or another accelerator's memory ran out, in a wording no family above knows
    # (families/generic.py): recognised, with only the figures the wording makes plain.
    "device",
    "host",  # not the GPU: host RAM (PyTorch's CPU allocator, or a worker SIGKILLed by the OOM killer)
    "vllm_kv_cache",  # vLLM start-up: the KV cache (or what is left after it) does not fit
]


class ProcessUse(BaseModel):
    """One ``Process N has X memory in use`` clause (NVML's process list, in its order)."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    used_bytes: int


class OomFacts(BaseModel):
    """The numbers and names one OOM message prints. Sizes in bytes."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind
    # Fine-grained wording family, e.g. "pytorch_caching_allocator_oom_v2" (docs/doctor.md).
    category: str
    exception: str | None = None
    device_type: str | None = None  # cuda, hip, xpu, mps, metal, gpu (TF/XLA), tpu, cpu, host
    device_index: int | None = None

    requested_bytes: int | None = None
    total_bytes: int | None = None  # card capacity (cudaMemGetInfo total / "Device limit")
    free_bytes: int | None = None
    # "Including non-PyTorch memory, this process has X memory in use" (NVML, by PID).
    process_in_use_bytes: int | None = None
    allocated_bytes: int | None = None  # live tensors (PyTorch "allocated", CuPy pool, BFC InUse)
    reserved_bytes: int | None = None  # whole cache ("reserved in total by PyTorch", CuPy total)
    reserved_unallocated_bytes: int | None = None  # cache not backing any tensor ("cached" pre-1.4)
    allowed_bytes: int | None = None  # a per-process cap: memory fraction, MPS watermark, BFC limit
    # A cap on one allocation, whatever is free: IPEX's "can NOT allocate memory block with
    # size larger than 4GB" (Intel GPUs without large-allocation support), Metal's maximum
    # buffer size (MLX).
    per_allocation_limit_bytes: int | None = None
    private_pools_bytes: int | None = None  # CUDA/HIP Graphs private pools
    other_allocations_bytes: int | None = None  # MPS: memory outside the MPS allocator
    other_processes: list[ProcessUse] = Field(default_factory=list)
    # Sizes of each retried allocation (TensorFlow stream executor, pinned host memory).
    attempts_bytes: list[int] = Field(default_factory=list)
    # TensorFlow BFC "ran out of memory ... not a failure" warnings next to the failure.
    nonfatal_requests_bytes: list[int] = Field(default_factory=list)

    # vLLM start-up figures.
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_needed_bytes: int | None = None
    kv_cache_available_bytes: int | None = None
    estimated_max_model_len: int | None = None
    dummy_requests: int | None = None
    # TGI's warm-up: the prefill tokens it could not handle.
    prefill_tokens: int | None = None
    # HAMi: what the pod would have held had the allocation succeeded (over its limit).
    would_use_bytes: int | None = None

    # cuDNN / MXNet convolution workspace.
    workspace_required_bytes: int | None = None
    workspace_given_bytes: int | None = None

    library_status: str | None = None  # CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_...
    cuda_error: str | None = None  # cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY
    cuda_error_code: int | None = None
    api_call: str | None = None  # cublasCreate(handle), cuCtxCreate
    advice: str | None = None  # the framework's own hint: expandable_segments, max_split_size_mb...
    alloc_conf_var: str | None = None  # PYTORCH_CUDA_ALLOC_CONF / PYTORCH_HIP_ALLOC_CONF / ...
    host: str | None = None  # NCCL's "host:pid:tid [gpu]" prefix
    pid: int | None = None
    source_location: str | None = None  # e.g. "THCStorage.cu:66", "csrc/pythonInterface.c"
    source_line: int | None = None
    phase: str | None = None  # e.g. "model weights" when the text says the model was loading
    # XLA on a TPU: the extra memory its largest allocation takes for padding to the
    # chip's tiles ("Extra memory due to padding: 31.00G (32.0x expansion)").
    padding_bytes: int | None = None
    # Tensor shape and dtype (TensorFlow), kept as printed.
    tensor_shape: str | None = None
    dtype: str | None = None

    # The message as matched (layout repaired, at most a few kB), for people and incidents.
    message: str = ""
    # Later OOM messages in the same text (another rank, a retry), first one excluded.
    additional_messages: list[OomFacts] = Field(default_factory=list)

    @property
    def device(self) -> str | None:
        """``"cuda:0"``-style name, or ``None`` when the message names no device index.

        TensorFlow and XLA say ``GPU:0``; their GPU builds are CUDA ones (ROCm builds
        print ``HIP_ERROR_*`` and are recorded as ``hip``), so ``gpu`` is named ``cuda``.
        """
        if self.device_index is None or self.device_type in (None, "host"):
            return None
        device_type = "cuda" if self.device_type == "gpu" else self.device_type
        return f"{device_type}:{self.device_index}"
