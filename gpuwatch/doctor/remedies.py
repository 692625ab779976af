"""The exact commands and code changes each fix recommends (docs/doctor.md explains them).

Kept apart from the rules in :mod:`gpuwatch.doctor.diagnosis` so the wording can be
reviewed in one place, and so the rules read as arithmetic.
"""

from __future__ import annotations

import math

from gpuwatch.doctor.live import NVIDIA_DEVICE_TYPES, LiveGpu, LiveProcess
from gpuwatch.doctor.units import format_size

FIND_HOLDERS = [
    "gpuwatch status",
    "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv",
]

_SYSTEM_RAM = ["free -h", "ps -eo pid,user,rss,comm --sort=-rss | head   # who holds system RAM"]
_UNIFIED_MEMORY = ["vm_stat   # unified memory: other apps count against the GPU's share"]
# Who holds the device, for hardware nvidia-smi (and gpuwatch's NVML agent) cannot see.
FIND_HOLDERS_BY_DEVICE = {
    "hip": ["rocm-smi --showpids", "rocm-smi --showmeminfo vram"],
    "npu": ["npu-smi info"],
    "hpu": ["hl-smi"],
    "musa": ["mthreads-gmi"],
    "mlu": ["cnmon"],
    "host": _SYSTEM_RAM,
    "cpu": _SYSTEM_RAM,
    "dml": ["Task Manager > Performance > GPU: dedicated GPU memory, and which apps hold it"],
    "mps": _UNIFIED_MEMORY,
    "metal": _UNIFIED_MEMORY,
    "ipu": ["gc-monitor   # Graphcore: which processes have the IPUs attached"],
    "tenstorrent": ["tt-smi   # Tenstorrent: the boards and who uses them"],
    "neuron": [
        "neuron-ls   # AWS Neuron: the devices and the processes (PIDs) holding each",
        "neuron-top   # their memory use, live",
    ],
    "sycl": [
        "xpu-smi ps   # Intel GPUs: the processes using each device",
        "nvidia-smi, or rocm-smi --showpids   # SYCL on an NVIDIA or AMD GPU",
    ],
}


# Who holds a GPU whose vendor the message does not name.
ANY_VENDOR_HOLDERS = [
    *(f"{command}   # NVIDIA GPUs" for command in FIND_HOLDERS),
    "rocm-smi --showpids   # AMD GPUs",
    "# another accelerator: its vendor's monitoring tool lists who holds its memory",
]
# APIs that run on any vendor's GPU (by kind, or by category where the kind is another
# framework's: llama.cpp's Vulkan backend), with their own view of the device's limits.
# CUDA's switches do nothing for them.
_VULKAN_LIMITS = [
    "vulkaninfo | grep -i -E 'heapSize|maxMemoryAllocationSize'   # the device's memory "
    "heaps, and the largest single allocation its driver allows"
]
_API_TOOLS: dict[str, list[str]] = {
    "vulkan": _VULKAN_LIMITS,
    "ggml_vulkan_alloc_failed": _VULKAN_LIMITS,
    "opencl": [
        "clinfo | grep -i -E 'global memory size|max memory allocation'   # the device's "
        "memory, and the largest single buffer it allows (CL_DEVICE_MAX_MEM_ALLOC_SIZE)"
    ],
    "wgpu_out_of_memory": [],
    "opengl_out_of_memory": [],
    "nvidia_opengl_out_of_memory": [],
    "ggml": [],  # llama.cpp, its backend not named: CUDA, HIP, Vulkan, SYCL, Metal
}


def holders_of(device_type: str | None) -> list[str]:
    """Who holds a device of ``device_type``: nvidia-smi only for NVIDIA's (or an unnamed)
    device, that hardware's own tool for the others (ROCm, Ascend, ...)."""
    if device_type is None or device_type in NVIDIA_DEVICE_TYPES:
        return FIND_HOLDERS
    return FIND_HOLDERS_BY_DEVICE.get(
        device_type,
        [f"the {device_type.upper()} vendor's monitoring tool lists who holds its memory"],
    )


def find_holders(device_type: str | None, *apis: str) -> list[str]:
    """The commands that show who else holds a device of ``device_type``. ``apis``: the
    message's category and kind; where one is an API that runs on any vendor's GPU, that
    API's own tool, and never CUDA's switches. Otherwise, on CUDA (or where the message
    names no device), also how to find the call that really failed."""
    nvidia = device_type is None or device_type in NVIDIA_DEVICE_TYPES
    tools = next((_API_TOOLS[api] for api in apis if api in _API_TOOLS), None)
    if tools is not None and nvidia:
        return [*(ANY_VENDOR_HOLDERS if device_type is None else FIND_HOLDERS), *tools]
    if nvidia:
        return [*FIND_HOLDERS, "CUDA_LAUNCH_BLOCKING=1 python ...   # find the real failing call"]
    return holders_of(device_type)


def fragmentation(alloc_conf_var: str | None, *, legacy: bool, modern: bool = False) -> list[str]:
    """Allocator settings; ``legacy``: a pre-2.1 PyTorch without expandable segments;
    ``modern``: known to have them (no line for older versions)."""
    var = alloc_conf_var or "PYTORCH_CUDA_ALLOC_CONF"
    if legacy:
        return [
            f"export {var}=max_split_size_mb:128   # before python starts",
            "# or upgrade to PyTorch >= 2.1 and use expandable_segments:True",
        ]
    commands = [f"export {var}=expandable_segments:True   # before python starts"]
    if not modern:
        commands.append(f"# PyTorch < 2.1: export {var}=max_split_size_mb:128")
    return commands


def memory_fraction(module: str, needed: int, total: int | None, free: int | None) -> list[str]:
    """How to give a process capped by ``torch.<module>.set_per_process_memory_fraction``
    the ``needed`` bytes (its reserve plus the request) on a ``total``-byte card."""
    call = f"torch.{module}.set_per_process_memory_fraction"
    commands = []
    if total:
        fraction = math.ceil(needed / total * 100) / 100
        if fraction <= 1:
            commands.append(
                f"{call}({fraction:.2f})   # at least; the reserve plus this request is "
                f"{format_size(needed)} of the {format_size(total)} card"
            )
        else:
            commands.append(
                f"# even the whole {format_size(total)} card is less than the "
                f"{format_size(needed)} needed: raise the limit and make the working set smaller"
            )
    commands.append(
        f"or remove the {call}(...) call (the default is the whole card); a framework may set "
        "it for you (look for a memory-fraction or reserve-VRAM option)"
    )
    if free is not None and total and free < needed:
        commands.append(
            f"# the card had {format_size(free)} free: other processes may still leave too little"
        )
    return commands


def reduce_activations(device: str = "cuda") -> list[str]:
    """What makes a PyTorch working set smaller; ``device``: the torch device type the
    tensors are on, which autocast names."""
    return [
        "halve the batch and keep the effective batch: loss = loss / accum_steps; "
        "optimizer.step() every accum_steps batches",
        "cap sequence length (tokenizer max_length / truncation): attention activations grow with it",
        f'train in bf16: with torch.autocast(device_type="{device}", dtype=torch.bfloat16): ...',
        "model.gradient_checkpointing_enable()   # or torch.utils.checkpoint(block, x, use_reentrant=False)",
        "for evaluation: model.eval(); with torch.inference_mode(): ...",
    ]


REDUCE_ACTIVATIONS = reduce_activations()

HELD_ACROSS_STEPS = [
    "total_loss += loss.item()   # not `+= loss`: that keeps every step's graph alive",
    "outputs.append(logits.detach().cpu())   # not the GPU tensor with its graph",
    "with torch.inference_mode(): ...   # around every evaluation loop",
    "del outputs, loss; gc.collect(); torch.cuda.empty_cache()   # in notebooks: restart the kernel",
]


def model_too_large(needed_bytes: int, capacity_bytes: int | None) -> list[str]:
    """Options when the weights alone do not fit, with the arithmetic for 16-bit weights."""
    params_billions = needed_bytes / 2 / 1e9  # 2 bytes per parameter in bf16/fp16
    commands = [
        f"# ~{format_size(needed_bytes)} at 16-bit is ~{params_billions:.1f}B parameters: "
        f"int8 needs ~{format_size(needed_bytes // 2)}, 4-bit ~{format_size(needed_bytes // 4)}",
        "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)   # quantise",
        'from_pretrained(..., device_map="auto", max_memory={0: "20GiB", "cpu": "64GiB"})   # offload',
    ]
    gpu = f" --gpu {format_size(capacity_bytes).replace(' ', '')}" if capacity_bytes else ""
    commands.append(
        f"gpuwatch fit --params {params_billions:.1f}B --dtype bf16{gpu}   # full breakdown"
    )
    return commands


# The weights did not fit and the message gives no sizes to work out by how much.
WEIGHTS_UNSIZED = [
    "a quantised (8-bit or 4-bit) or smaller model",
    'offload part of it to the CPU (device_map="auto", or the application\'s low-VRAM / '
    "CPU-offload setting)",
]


# What a message without sizes still says, by kind (the "unknown" diagnosis's evidence).
UNKNOWN_BY_KIND = {
    "driver": "CUDA itself failed to allocate and printed no sizes; at start-up this usually "
    "means the GPU was already full or the CUDA context did not fit",
    "cublas": "cuBLAS could not allocate its handle or workspace: the GPU was (nearly) full "
    "when the first matrix multiply ran",
    "cudnn": "cuDNN could not initialise or find an algorithm: usually no memory left for "
    "its handle or workspace",
    "nccl": "NCCL could not allocate its communication buffers: the GPU had no headroom left",
    "bitsandbytes": "bitsandbytes' managed-memory (paged optimizer) allocation failed; WSL2 "
    "lacks full unified-memory support; use a non-paged optimizer (adamw_torch, adamw_bnb_8bit)",
    "metal": "a Metal command buffer ran out of unified memory: the model, its context or "
    "other apps use more than macOS lets the GPU have",
    "cuda_library": "a CUDA library (cuFFT, cuSOLVER, cuSPARSE, cuRAND, ...) could not allocate "
    "its plan, handle or workspace: the GPU was (nearly) full when it was created",
    "paddle": "PaddlePaddle says what this process holds and what was free, not who holds the "
    "rest: check the GPU for other processes first, then lower the batch size",
    "onnxruntime": "ONNX Runtime's arena could not grow; by default it grows in doubling "
    "steps and keeps what it took, so it can fail with much of the GPU idle in its own cache",
    "tensorrt": "TensorRT could not allocate device memory: usually the builder's workspace "
    "or an engine's activations, or other processes on the GPU",
    "tgi": "TGI's start-up warm-up ran the largest prefill its settings allow and it did not "
    "fit beside the weights: other processes on the GPU count against it too",
    "hami": "HAMi limits this pod to a share of the GPU (nvidia.com/gpumem): the share ran "
    "out, or the card did because other pods were scheduled onto it",
    "vulkan": "the Vulkan driver could not allocate device memory: the GPU was full, or one "
    "allocation was larger than the driver allows (maxMemoryAllocationSize)",
    "directml": "DirectML could not allocate a tensor in video memory: the model and its "
    "activations need more than the GPU has free; other apps' video memory counts too",
    "opencl": "the OpenCL runtime could not allocate a buffer on the device: the GPU was full, "
    "or one buffer was larger than the device allows (CL_DEVICE_MAX_MEM_ALLOC_SIZE)",
    "hpu": "the Gaudi (HPU) runtime could not allocate device memory: the model, its "
    "activations or its compiled graphs need more than the card has free",
    "cann": "Ascend's runtime (CANN) could not allocate device memory: the NPU was full; other "
    "processes on it count too",
    "catboost": "CatBoost serves every allocation from a pool it takes when training starts "
    "(gpu_ram_part of the GPU's free memory) and the pool ran out: the trees, borders and "
    "categorical combinations need more, or other processes left the pool small",
    "exllama": "ExLlamaV2 placed the layers itself and the weights plus the KV cache for the "
    "context length do not fit the GPUs it may use; other processes' memory counts against it",
    "mindspore": "MindSpore serves every tensor from a pool it takes at start (max_device_memory) "
    "and the pool could not serve this one: the model's working set is larger than the pool",
    "device": "the message says the device's memory ran out, in a wording gpuwatch has no "
    "family for, so it gives no figures to check: first see who else holds the device, then "
    "make this program's working set smaller (batch, sequence length, model precision)",
    "host": "a worker was killed with SIGKILL (exit -9), not by a GPU out-of-memory (that raises "
    "an exception): on Linux usually the kernel's OOM killer reclaiming system RAM, or a "
    "scheduler's limit",
}

# ... and by category, where the wording says more than its kind.
UNKNOWN_BY_CATEGORY = {
    "onnxruntime_cpu_arena_alloc_failed": "ONNX Runtime's arena on the CPU provider could "
    "not grow: system RAM ran out, not GPU memory; the arena keeps what it took, so "
    "sess_options.enable_cpu_mem_arena = False, or a smaller batch or input, is the fix",
    "ggml_cuda_check_oom": "llama.cpp's check of a CUDA/HIP call says the runtime could not "
    "allocate: the weights, the KV cache for the context (-c) and the compute buffers for "
    "the batch (-b / -ub) did not fit beside what else holds the GPU; offload fewer layers "
    "(-ngl) or lower the context",
    "host_pinned_memory_oom": "pinned *host* memory ran out (system RAM), not GPU memory",
    "gpu_alloc_failed": "the program could not get the GPU memory it asked for and printed only "
    "the request and what was free, not who holds the rest: other processes, or its own "
    "earlier allocations",
    "pytorch_caching_allocator_oom_absurd_size": "the requested size is over 1 EB: a corrupt "
    "(negative or overflowed) tensor size, a bug",
    "pytorch_thc_cuda_runtime_error": "the legacy THC allocator printed no sizes",
    "nccl_shm_exhausted": "NCCL could not create its shared-memory segment: /dev/shm is full "
    "(a container's default is 64 MiB); this is host memory, not the GPU",
    "nccl_host_alloc_failed": "NCCL could not allocate pinned host memory (system RAM)",
    "nccl_unhandled_cuda_error": "NCCL hit a CUDA error it does not name; out of memory is the "
    "usual cause; NCCL_DEBUG=WARN prints the CUDA failure",
    "cuda_managed_memory_oom": "a CUDA managed (unified) memory allocation failed: on Linux "
    "managed memory may outgrow the GPU and page to system RAM, but under WSL2 and Windows "
    "it cannot (no oversubscription), so there it fails once the GPU's own memory is full (on "
    "Linux it fails only when system RAM is short too)",
    "nccl_last_warning_oom": "NCCL failed with a CUDA error it does not name; the last warning "
    "it logged was CUDA's out of memory, which the message itself says may be unrelated: "
    "likely no headroom was left for NCCL's buffers, but NCCL_DEBUG=WARN shows the failure",
    "cublas_handle_oom_suspect": "cuBLAS could not create its handle (CUBLAS_STATUS_NOT_INITIALIZED): "
    "almost always the GPU had no memory left for it",
    "cudnn_status_oom_suspect": "cuDNN failed with a status that in practice usually means no "
    "memory was left for its handle or workspace",
    "tensorflow_dst_tensor_not_initialized": "TensorFlow could not allocate the destination of "
    "a GPU copy ('Dst tensor is not initialized'): the GPU was out of memory",
    "xla_tpu_memory_space_exhausted": "the compiled XLA program needs more TPU memory than the "
    "chip has: smaller batch, rematerialisation (jax.checkpoint), or shard over more chips",
    "metal_command_buffer_oom": "a Metal command buffer ran out of unified memory",
    "ggml_backend_buffer_alloc_failed": "llama.cpp could not allocate a backend buffer (the "
    "cudaMalloc / hipMalloc failure itself was not in the text)",
    "ggml_host_buffer_alloc_failed": "llama.cpp could not allocate a CPU buffer: system RAM ran "
    "out (the layers kept on the CPU, or a copy made with mmap off), not GPU memory",
    "miopen_alloc_failed": "MIOpen (ROCm's DNN library) could not allocate a buffer for a "
    "convolution or its workspace: the GPU was (nearly) full",
    "ggml_vulkan_alloc_failed": "llama.cpp's Vulkan backend could not allocate device memory: "
    "fewer layers on the GPU (-ngl), a smaller context, or a smaller quantisation",
    "onnxruntime_arena_absurd_size": "the requested size is over 1 EiB: a corrupt or overflowed "
    "tensor shape (a bad dynamic dimension, or a kernel bug), not a memory shortage",
    "mlx_buffer_larger_than_allowed": "one buffer is larger than Metal allows a single buffer to "
    "be on this Mac, whatever is free: split the work (smaller batch, context or prompt chunk)",
    "cpu_allocator_out_of_memory": "PyTorch's CPU allocator could not get system RAM: the "
    "tensor was on the CPU (a model loaded there first, a batch collated there), not the GPU",
    "tensorrt_llm_out_of_memory": "TensorRT-LLM sizes its runtime buffers for the engine's maximum "
    "batch and tokens, and the KV cache takes a fraction of what is free after them: together "
    "they did not fit",
    "tensorrt_llm_kv_cache_too_small": "the paged KV cache TensorRT-LLM could fit in the memory "
    "left after the weights cannot hold one whole sequence of the engine's maximum length",
    "catboost_tree_ctrs": "CatBoost estimated that its combinations of categorical features "
    "(tree-ctrs) need more than its pool has: fewer combinations, or keep them in host memory",
    "rmm_pool_exhausted": "RAPIDS Memory Manager's pool (or arena) reached the maximum size it "
    "was created with: that cap, not necessarily the card, ran out; a larger maximum pool, "
    "smaller batches or partitions, or fewer tasks sharing the GPU",
    "opencv_cuda_oom": "OpenCV's CUDA module got the runtime's out-of-memory: the GpuMat (or the "
    "CUDA context, in setDevice) did not fit beside what else holds the GPU",
    "npp_alloc_failed": "NPP could not allocate an image or its scratch buffer on the GPU: the "
    "GPU was (nearly) full",
    "poplar_tile_memory_exhausted": "Poplar places every variable and temporary on the IPU's "
    "tiles when it compiles, and the program does not fit a tile's SRAM: smaller batches, "
    "recomputation, availableMemoryProportion, or more IPUs (pipelining, sharding)",
    "poplar_memory_allocation_error": "Poplar could not fit the program's memory when it "
    "compiled it for the IPU (graph variables, or a host stream's buffer): smaller batches, "
    "fewer or smaller streams, or more IPUs",
    "tt_metal_dram_buffer_oom": "tt-metal could not place a buffer in the device's DRAM banks: "
    "the tensors kept on the device (weights, KV cache, activations) need more than is free",
    "tt_metal_l1_oom": "tt-metal could not place a buffer in the cores' L1 (on-chip SRAM): the "
    "op's sharding or memory config asks for more L1 than each core has; move the tensor to "
    "DRAM (ttnn.DRAM_MEMORY_CONFIG) or shard it over more cores",
    "sycl_out_of_device_memory": "the SYCL runtime (Level Zero, OpenCL or CUDA under it) could "
    "not allocate device memory: the GPU was full, or one allocation was larger than the "
    "device allows at once",
    "sycl_out_of_resources": "the SYCL runtime's 'out of resources' for an allocation: on Intel "
    "GPUs usually device memory (or one allocation over the device's single-allocation limit); "
    "a kernel's launch limits would say so",
    "ggml_sycl_out_of_device_memory": "llama.cpp's SYCL backend could not allocate device "
    "memory: offload fewer layers (-ngl), lower the context (-c), or a smaller quantisation",
    "ggml_sycl_out_of_resources": "llama.cpp's SYCL backend got 'out of resources' for an "
    "allocation, on Intel GPUs usually device memory: offload fewer layers (-ngl), lower the "
    "context (-c) or the batch (-b / -ub), or a smaller quantisation",
    "sycl_out_of_host_memory": "the SYCL runtime could not allocate host memory: system RAM "
    "ran out, not the GPU",
    "vulkan_out_of_host_memory": "the Vulkan driver could not allocate host memory: system RAM "
    "ran out, not the GPU",
    "nvidia_opengl_out_of_memory": "NVIDIA's OpenGL driver closed the program: it asked for more "
    "video memory than the GPU had free; other programs' video memory counts too",
    "opengl_out_of_memory": "the OpenGL driver could not allocate the texture or buffer asked "
    "for (GL_OUT_OF_MEMORY): the GPU's memory was full, or the object too large",
    "wgpu_out_of_memory": "wgpu could not allocate a buffer or texture on the device: the GPU "
    "(or, on integrated GPUs and in a browser, the share it is allowed) was full",
    "sglang_kv_pool_does_not_fit": "SGLang reserves --mem-fraction-static of the GPU for the "
    "weights and the KV-cache pool; after the weights nothing of it was left for the pool. "
    "Raise the fraction (the opposite of the fix for an out-of-memory while serving), or "
    "free the GPU, or shard or quantise the model",
    "sglang_kv_pool_exhausted": "a batch found no free KV-cache slots in SGLang's pool: fewer "
    "requests at once, a smaller prefill chunk, or a larger pool",
    "tgi_warmup_total_tokens": "TGI's start-up warm-up sizes the batch's KV cache for "
    "--max-batch-total-tokens and runs a prefill: that total did not fit beside the weights "
    "(the prefill was small); other processes on the GPU count against it too",
    "opencl_out_of_resources": "an OpenCL call returned CL_OUT_OF_RESOURCES (-5): the runtime "
    "could not get what the device needed, usually its memory (or one buffer over "
    "CL_DEVICE_MAX_MEM_ALLOC_SIZE); NVIDIA's OpenCL also returns it for a kernel that read "
    "or wrote out of bounds, so if memory was free, check the kernel's indexing",
    "opencl_out_of_host_memory": "an OpenCL call returned CL_OUT_OF_HOST_MEMORY (-6): the "
    "runtime could not allocate system RAM, not the GPU's memory",
    "directml_e_outofmemory": "DirectML (Direct3D 12) got Windows' E_OUTOFMEMORY (0x8007000E): "
    "the GPU's video memory, and the shared system memory Windows lets it spill into, were "
    "full; other apps' video memory counts too",
    "neuron_device_alloc_failed": "the Neuron runtime could not allocate device memory on the "
    "Inferentia/Trainium chip (NRT_RESOURCE): the model's weights, its tensors and the "
    "runtime's buffers need more than the NeuronCores' memory has free; other processes "
    "holding the device count too",
    "neuron_host_alloc_failed": "the Neuron runtime could not allocate host memory: system RAM "
    "ran out, not the Neuron device's",
    "ollama_system_memory": "Ollama checks before loading that the model (the layers not "
    "offloaded to a GPU, and its context) fits in the system RAM that is free, and it did not",
    "compiler_out_of_memory": "the CUDA compiler (ptxas, cicc) ran out of system RAM while "
    "building: each compile job of a CUDA extension (flash-attention, xformers, ONNX Runtime) "
    "can take several GB, and a build runs one per core at once; this is not the GPU's memory",
    "unity_out_of_memory": "Unity's memory manager could not get system RAM for an allocation "
    "(32-bit builds and mobile devices have far less than the machine's RAM)",
    "unreal_out_of_memory": "Unreal Engine could not allocate system RAM (virtual memory): on "
    "Windows, RAM plus the paging file ran out, which is what 'the paging file is too small' says",
    "jvm_heap_exhausted": "the Java virtual machine's heap reached its limit (-Xmx; on Spark "
    "spark.executor.memory or spark.driver.memory): that limit, not the machine's RAM nor the "
    "GPU, ran out; GC overhead limit exceeded says the same (the JVM spent nearly all its time "
    "collecting a full heap)",
    "jvm_off_heap_exhausted": "a pool the Java virtual machine keeps outside its heap ran out: "
    "direct (NIO) buffers, capped by -XX:MaxDirectMemorySize, or class metadata (Metaspace, "
    "-XX:MaxMetaspaceSize); on Spark that room comes out of spark.executor.memoryOverhead",
    "lmcache_buffer_full": "LMCache's CPU buffer for KV-cache chunks (max_local_cpu_size) is "
    "full: that fixed pool, not the machine's RAM, had no room; where the server went on "
    "serving, those chunks were only not cached",
    "linux_oom_killer": "the Linux kernel's OOM killer killed the process to reclaim system "
    "RAM: the machine's RAM (and swap) ran out, not the GPU's memory; a model loaded on the "
    "CPU first, DataLoader workers each holding a copy of the dataset, or other programs",
    "cgroup_oom_killer": "the kernel killed the process because its memory cgroup reached its "
    "limit (a container's --memory, a Kubernetes pod's limits.memory, a systemd slice, "
    "Slurm's --mem): that limit, not the machine's RAM nor the GPU, ran out",
    "dataloader_worker_sigkilled": "a DataLoader worker was killed with SIGKILL, not by a GPU "
    "out-of-memory: most likely the kernel's OOM killer reclaiming system RAM (each worker "
    "holds its own copy of the dataset's Python objects, and prefetched batches), or a "
    "scheduler's kill; dmesg says which",
    "dataloader_shm_exhausted": "the DataLoader's workers hand their batches to the main "
    "process through shared memory (/dev/shm) and it is too small (a Docker container's "
    "default is 64 MiB): this is host memory, not the GPU",
    "ggml_metal_alloc_failed": "llama.cpp could not allocate a Metal buffer in unified memory: "
    "the weights, the KV cache for the context (-c) and the compute buffers need more than "
    "the GPU's share of the Mac's memory (about two thirds to three quarters of RAM); other "
    "apps' memory counts against it",
    "paddle_bad_alloc": "only Paddle's exception name (paddle::memory::allocation::BadAlloc) "
    "is here: its allocator could not allocate, and the message with the sizes (Out of "
    "memory error on GPU N. Cannot allocate ...) was not pasted; it says which fix applies",
    "host_oom_in_words": "the text says system RAM (the CPU's memory) ran out, not the GPU's: "
    "the kernel's OOM killer, or a process's own allocation failing; a model or optimizer "
    "state held on the CPU (offloading), DataLoader workers each holding a copy of the "
    "dataset, or other programs",
    "cupy_oom_name_only": "only CuPy's exception name is here; its message (the size asked "
    "for, what the pool holds) says which fix applies: paste the whole message",
    "pytorch_caching_allocator_oom_first_line": "only the message's first line is here; its "
    "figures (requested, free, held by others) say which fix applies: paste the whole message",
}

# ONNX Runtime's CUDA provider options that bound its arena (onnxruntime.ai, CUDA EP).
ONNXRUNTIME_ARENA = [
    'ort.InferenceSession(path, providers=[("CUDAExecutionProvider", {"arena_extend_strategy": '
    '"kSameAsRequested", "gpu_mem_limit": 8 * 1024**3})])   # grow by what is asked, cap it',
    '{"cudnn_conv_algo_search": "HEURISTIC"}   # provider option: no exhaustive search for a big conv workspace',
    "feed smaller batches or shapes: the node's activations grow with them",
]

PADDLE = [
    "lower the batch size (the message's own advice, once no other process holds the GPU)",
    "paddle.device.cuda.empty_cache()   # between phases, to hand cached blocks back",
]


# HAMi-core's own settings (its README): the pod's share, and the switch that bypasses it.
HAMI = [
    "resources: limits: nvidia.com/gpumem: <MiB>   # raise the pod's share, or lower the batch",
    "kubectl describe pod POD   # which GPU, and which other pods HAMi placed on it",
    "CUDA_DISABLE_CONTROL=true   # in the pod: turns HAMi's limit off, to test whether the limit is the cause",
]


def tgi_warmup(prefill_tokens: int | None, total_tokens: int | None = None) -> list[str]:
    """TGI's launcher options for a warm-up that did not fit ``prefill_tokens`` (and, where
    the message names it, a batch of ``total_tokens`` in the KV cache)."""
    fewer = f"{max(1, prefill_tokens // 2)}" if prefill_tokens else "N"
    if total_tokens:
        # The total (the batch's KV cache) is what did not fit beside the weights.
        return [
            f"text-generation-launcher --model-id MODEL --max-batch-total-tokens {max(1, total_tokens // 2)}",
            "or leave it unset: with flash-attention models TGI infers it from the memory left after warm-up",
            "--max-total-tokens must stay at or below it: the longest request must still fit",
            "--quantize (awq, gptq, bitsandbytes-nf4) or --num-shard 2: less of the GPU for weights",
        ]
    return [
        f"text-generation-launcher --model-id MODEL --max-batch-prefill-tokens {fewer}",
        "lower --max-input-tokens and --max-total-tokens too: the longest request must still fit",
        "--quantize (awq, gptq, bitsandbytes-nf4) or --num-shard 2: less of the GPU for weights",
    ]


# TensorRT-LLM: the engine's maxima (trtllm-build) and the runtime's KV-cache share
# (Triton's tensorrt_llm config.pbtxt, or the executor's KvCacheConfig).
TENSORRT_LLM = [
    "trtllm-build ... --max_batch_size 8 --max_num_tokens 4096   # buffers are sized for these maxima",
    "kv_cache_free_gpu_mem_fraction: 0.8   # the KV cache's share of what is free after the weights",
    "--max_input_len / --max_seq_len: a shorter maximum sequence needs fewer KV-cache blocks",
    *FIND_HOLDERS,
]

# TensorRT-LLM's executor (the PyTorch backend, trtllm-serve and the LLM API): what makes
# the component that did not fit smaller, as the message's own list of options says.
_TRTLLM_MAX_NUM_TOKENS = (
    "trtllm-serve MODEL --max_num_tokens 4096   # LLM(max_num_tokens=...): the executor's "
    "buffers grow with the tokens in one batch"
)
_TRTLLM_SHARD = [
    "trtllm-serve MODEL --tp_size 2   # LLM(tensor_parallel_size=2), or --pp_size: each GPU holds part of the weights",
    "a quantised checkpoint (FP8, NVFP4, INT4-AWQ): smaller weights",
    _TRTLLM_MAX_NUM_TOKENS,
]
_TRTLLM_COMPONENT_KNOBS = {
    "kv cache": [
        "KvCacheConfig(free_gpu_memory_fraction=0.7)   # the KV cache's share of the memory free "
        "after the model (trtllm-serve: --kv_cache_free_gpu_memory_fraction 0.7)",
        "KvCacheConfig(max_tokens=...)   # or cap the tokens the KV cache holds",
        "trtllm-serve MODEL --tp_size 2   # LLM(tensor_parallel_size=2): less of each GPU for the weights",
    ],
    "model": _TRTLLM_SHARD,
    "draft model for speculative decoding": _TRTLLM_SHARD,
    "sampler": [
        "trtllm-serve MODEL --max_seq_len N   # the sampler's buffers grow with it "
        "(and with max_attention_window_size)"
    ],
    "drafter": ["trtllm-serve MODEL --max_seq_len N   # or a smaller max_draft_len"],
}


def tensorrt_llm_executor(component: str | None) -> list[str]:
    """The options for the executor's ``component`` that did not fit (lower case, as
    the message names it); the temporary buffers' ``max_num_tokens`` for the others, and
    the KV cache's and the weights' where the component is not named."""
    if component is None:
        knobs = [*_TRTLLM_COMPONENT_KNOBS["kv cache"][:1], *_TRTLLM_SHARD]
    else:
        knobs = _TRTLLM_COMPONENT_KNOBS.get(component, [_TRTLLM_MAX_NUM_TOKENS])
    return [*knobs, *FIND_HOLDERS]


MINDSPORE = [
    'mindspore.set_context(max_device_memory="30GB")   # the pool\'s size: up to what the card has free',
    "lower the batch size, or recompute activations: cell.recompute()",
    "npu-smi info   # Ascend: who else holds the NPU (nvidia-smi on a GPU)",
]

# CatBoost's GPU training parameters that bound its memory (catboost.ai, "GPU training").
CATBOOST = [
    "depth=6, border_count=32   # memory grows with 2**depth leaves and with the borders per feature",
    "max_ctr_complexity=1   # fewer combinations of categorical features (tree-ctrs)",
    "gpu_cat_features_storage='CpuPinnedMemory'   # categorical features in pinned host RAM",
    "one fit per GPU at a time: a hyperparameter search running fits side by side splits the card",
    *FIND_HOLDERS,
]

# ExLlamaV2's loader settings (text-generation-webui's names; TabbyAPI's config has the same).
EXLLAMA = [
    "--max_seq_len 8192   # the KV cache grows with the context: a shorter one needs less",
    "--cache_8bit or --cache_4bit   # a quantised KV cache: about a half or a quarter of FP16's",
    "a lower bits-per-weight quantisation of the model (e.g. 4.0 bpw instead of 5.0)",
    "--gpu-split 20,24   # GiB per GPU; leave room for the cache and the display on GPU 0",
    *FIND_HOLDERS,
]


# RAPIDS Memory Manager's pool: cuDF (Python), Spark RAPIDS and dask-cuda set its size.
RMM_POOL = [
    "rmm.reinitialize(pool_allocator=True, maximum_pool_size=...)   # cuDF: a larger cap, or none",
    "spark.rapids.memory.gpu.maxAllocFraction / spark.rapids.sql.concurrentGpuTasks=1   # Spark RAPIDS",
    "LocalCUDACluster(rmm_pool_size=..., device_memory_limit=...)   # dask-cuda: spill earlier",
    *FIND_HOLDERS,
]

# SGLang's server arguments (sglang.launch_server).
SGLANG_STARTUP = [
    "python -m sglang.launch_server ... --mem-fraction-static 0.9   # more of the GPU for weights and the KV pool",
    "--tp 2 or a quantised model (--quantization fp8)   # less of each GPU for the weights",
    *FIND_HOLDERS,
]
SGLANG_SERVING = [
    "--max-running-requests 32 --chunked-prefill-size 4096   # fewer tokens in flight at once",
    "--mem-fraction-static   # a larger KV pool, if the activations still fit beside it",
]

# NVENC's NV_ENC_ERR_OUT_OF_MEMORY: GeForce drivers return it for one session too many.
NVENC_SESSIONS = [
    "nvidia-smi --query-gpu=encoder.stats.sessionCount --format=csv   # NVENC sessions open now",
    "nvidia-smi encodersessions   # which processes hold them",
    "close the other encoders (OBS, ShadowPlay / Game DVR, another ffmpeg or transcoder), or "
    "encode fewer streams at once: GeForce drivers cap the sessions a GPU may open",
    "only if the session count is under that cap: free video memory (smaller -extra_hw_frames / "
    "-surfaces in ffmpeg, or stop other GPU programs)",
    *FIND_HOLDERS,
]

# The kernel's OOM killer: its own lines say who was killed and what it held.
OOM_KILLER = [
    "sudo dmesg -T | grep -i -E 'killed process|out of memory'   # every kill, with the RAM each process held",
    *_SYSTEM_RAM,
    "fewer DataLoader workers (num_workers), or load the model straight to the GPU (device_map, low_cpu_mem_usage=True)",
    "more swap, or a machine with more RAM, if the job's working set really needs it",
]

# Free memory covered the request and the allocation still failed: something other than
# the card's free memory refused it.
FREE_COVERED_CAUSES = (
    "the card's free memory was not what ran out: a per-process cap (a memory fraction, "
    "a container's, MIG or vGPU slice's limit), a cap on one allocation (Intel GPUs allow "
    "4 GiB without large-allocation support), on Windows the system's commit limit (RAM "
    "plus the page file back every GPU allocation under WDDM), or memory other processes "
    "took between the failure and the reading"
)
_WINDOWS_COMMIT = (
    "Windows: System > Advanced system settings > Performance > Virtual memory   # a larger "
    "page file, or close programs holding RAM: WDDM backs GPU memory with the commit limit"
)


def free_covered(device_type: str | None) -> list[str]:
    """Where to look when free memory covered the request: the commit limit, and on an
    NVIDIA card what its driver says is free to this process (a MIG or vGPU slice's)."""
    if device_type is None or device_type in NVIDIA_DEVICE_TYPES:
        return [
            _WINDOWS_COMMIT,
            "nvidia-smi -q -d MEMORY   # what the driver reports free; a MIG or vGPU slice shows its own size",
        ]
    return [_WINDOWS_COMMIT]


# What to look at, where a limit rather than the machine's RAM or the GPU ran out (the
# summary's "look at ..." otherwise names system RAM or the GPU's holders).
UNKNOWN_LOOK_AT_BY_CATEGORY = {
    "xla_tpu_memory_space_exhausted": "the program's own memory on the TPU (a compile-time "
    "message lists its largest allocations), not other processes",
    "xla_compile_aborted_not_enough_memory": "what the compiled program needs, not other processes",
    "cgroup_oom_killer": "the memory cgroup's limit (the container, pod or job)",
    "compiler_out_of_memory": "the build's parallel jobs (MAX_JOBS), not the GPU",
    "jvm_heap_exhausted": "the JVM's heap limit (-Xmx), not the machine's RAM",
    "jvm_off_heap_exhausted": "the JVM's limits outside its heap",
    "lmcache_buffer_full": "LMCache's CPU buffer (max_local_cpu_size)",
}

# A TPU program that does not fit when XLA compiles it, in each framework's words.
TPU_COMPILE = [
    "reduce the per-core batch, or rematerialise activations (jax.checkpoint, "
    "tf.recompute_grad, torch_xla's checkpoint)",
    "shard parameters and activations over more TPU cores (jax.sharding / pjit, Mesh "
    "TensorFlow's layout rules, torch_xla SPMD)",
]
# ... where the padding to the chip's tiles is what does not fit.
TPU_TILE_PADDING = [
    "find the allocation in the message's 'Largest program allocations': its Shape (e.g. "
    "s32[8388608,8,4]) and the op that made it",
    "reshape or transpose it so a large dimension is minor (last): [N, 8, 4] as [8, 4, N], "
    "or flattened to [N * 32]; small trailing dimensions are padded to 8 x 128",
    *TPU_COMPILE,
]

_NCCL_UNNAMED = [
    "export NCCL_DEBUG=WARN   # prints the CUDA failure behind 'unhandled cuda error'",
    *FIND_HOLDERS,
]

UNKNOWN_COMMANDS_BY_CATEGORY: dict[str, list[str]] = {
    "rmm_pool_exhausted": RMM_POOL,
    "sglang_kv_pool_does_not_fit": SGLANG_STARTUP,
    "sglang_kv_pool_exhausted": SGLANG_SERVING,
    "tt_metal_l1_oom": [
        "ttnn.to_memory_config(tensor, ttnn.DRAM_MEMORY_CONFIG)   # keep large tensors in DRAM, not L1",
        "a smaller batch, or shard the op over more cores",
    ],
    "poplar_tile_memory_exhausted": [
        "lower availableMemoryProportion for convolutions and matmuls   # less temporary memory per tile",
        "a smaller micro-batch, recomputation, or pipeline the model over more IPUs",
    ],
    "nccl_shm_exhausted": [
        "docker run --shm-size=8g ...   # or --ipc=host; Kubernetes: an emptyDir medium: Memory at /dev/shm",
        "df -h /dev/shm",
        "export NCCL_SHM_DISABLE=1   # last resort: slower inter-GPU transport",
    ],
    "nccl_unhandled_cuda_error": _NCCL_UNNAMED,
    "cuda_managed_memory_oom": [
        "smaller chunks, partitions or batches: under WSL2 and Windows managed memory holds no "
        "more than the GPU",
        "LocalCUDACluster(device_memory_limit=..., jit_unspill=True)   # dask-cuda: spill to "
        "host memory yourself before the GPU fills",
        *FIND_HOLDERS,
    ],
    "nccl_last_warning_oom": _NCCL_UNNAMED,
    "xla_tpu_memory_space_exhausted": TPU_COMPILE,
    "xla_compile_aborted_not_enough_memory": TPU_COMPILE,
    "tensorrt_out_of_memory": [
        "config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)   # cap the builder's workspace",
        "trtexec --onnx=model.onnx --memPoolSize=workspace:1024   # the same, in MiB",
        "build with smaller maximum shapes in the optimization profile (batch, sequence)",
        *FIND_HOLDERS,
    ],
    # families/generic.py, where the message names no vendor: any vendor's tool.
    "device_out_of_memory": ANY_VENDOR_HOLDERS,
    "exllama_autosplit_full": EXLLAMA,
    "exllama_split_too_small": EXLLAMA,
    "tensorrt_llm_out_of_memory": TENSORRT_LLM,
    "tensorrt_llm_kv_cache_too_small": TENSORRT_LLM,
    "mindspore_pool_exhausted": MINDSPORE,
    "cpu_allocator_out_of_memory": [
        *_SYSTEM_RAM,
        'load the model straight to the GPU (device_map="auto", low_cpu_mem_usage=True), or fewer DataLoader workers',
    ],
    "catboost_pool_exhausted": CATBOOST,
    "catboost_tree_ctrs": CATBOOST,
    "hami_pod_limit": HAMI,
    "hami_allocate_failed": HAMI,
    "worker_sigkilled_host_oom_suspect": [
        "sudo dmesg -T | grep -i -E 'killed process|out of memory'   # the kernel's OOM killer, if it was",
        *_SYSTEM_RAM,
        "fewer DataLoader workers (num_workers), or load the model straight to the GPU (device_map, low_cpu_mem_usage=True)",
    ],
    "linux_oom_killer": OOM_KILLER,
    "host_oom_in_words": OOM_KILLER,
    "paddle_bad_alloc": [
        *FIND_HOLDERS,
        "paste the whole message: Paddle prints the request "
        "and what was free before the C++ traceback",
    ],
    "cgroup_oom_killer": [
        "cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory.peak   # the limit, and the peak use (cgroup v2)",
        "raise the limit: docker run --memory=64g ..., Kubernetes resources.limits.memory, Slurm --mem",
        "kubectl describe pod POD   # Last State: Terminated, Reason: OOMKilled, and the limits",
        "fewer DataLoader workers (num_workers), or load the model straight to the GPU (device_map, low_cpu_mem_usage=True)",
    ],
    "dataloader_worker_sigkilled": [
        "sudo dmesg -T | grep -i -E 'killed process|out of memory'   # the kernel's OOM killer, if it was",
        *_SYSTEM_RAM,
        "DataLoader(..., num_workers=2, prefetch_factor=2)   # fewer workers, fewer batches in flight",
        "keep the dataset's samples in numpy arrays, not Python lists or dicts: workers' reads "
        "of Python objects copy their pages (reference counts)",
    ],
    "dataloader_shm_exhausted": [
        "df -h /dev/shm   # its size, and how full it is",
        "docker run --shm-size=8g ...   # or --ipc=host; Kubernetes: an emptyDir medium: Memory at /dev/shm",
        "DataLoader(..., num_workers=2)   # fewer workers, or smaller batches: less in /dev/shm at once",
        "torch.multiprocessing.set_sharing_strategy('file_system')   # another way to share tensors",
    ],
    "ggml_metal_alloc_failed": [
        "llama.cpp: lower the context (-c) and batch (-b / -ub), offload fewer layers (-ngl), "
        "or a smaller quantisation (Q4_K_M)",
        "sudo sysctl iogpu.wired_limit_mb=<MiB>   # raise the GPU's share of unified memory (macOS 14+)",
        *_UNIFIED_MEMORY,
    ],
    "onnxruntime_arena_absurd_size": [
        "check the input shapes fed to the session: a dynamic dimension of 0 or -1, or an overflowed product",
        "run it on the CPU provider to see whether the same node asks for the same size",
    ],
    "ollama_system_memory": [
        "free -h   # what is free now; other programs' RAM counts against the model",
        "ollama ps   # models Ollama keeps loaded; ollama stop MODEL unloads one",
        "a smaller model or quantisation (a smaller tag, q4_K_M), or a smaller context (num_ctx)",
    ],
    "compiler_out_of_memory": [
        "MAX_JOBS=4 pip install flash-attn --no-build-isolation   # fewer compile jobs at once "
        "(PyTorch extensions read MAX_JOBS)",
        "cmake --build . --parallel 4 / make -j4 / ./build.sh --parallel 4   # the same for "
        "CMake builds (ONNX Runtime)",
        "free -h   # the RAM the build has; a prebuilt wheel for your CUDA and PyTorch avoids "
        "the build",
    ],
    "unity_out_of_memory": [
        "the Memory Profiler package (Window > Analysis): which assets and allocations hold memory",
        "lower texture quality and mesh sizes, or stream assets (Addressables) instead of loading them at once",
        "a 64-bit build: a 32-bit player has at most 2-4 GB whatever the machine has",
    ],
    "unreal_out_of_memory": [
        "Windows: System > About > Advanced system settings > Performance > Virtual memory: "
        "let Windows manage the paging file size, or raise it",
        "Task Manager > Memory: close what else holds RAM",
        "lower texture quality (r.Streaming.PoolSize) and view distance",
    ],
    "jvm_heap_exhausted": [
        "Spark: --conf spark.executor.memory=8g (the executors), --driver-memory 8g (the "
        "driver: collect(), toPandas() and broadcasts land there)",
        "more, smaller partitions (df.repartition(N), spark.sql.shuffle.partitions): less "
        "held by each task at once",
        "java -Xmx8g -XX:+HeapDumpOnOutOfMemoryError ...   # a larger heap, and a dump of what filled it",
    ],
    "jvm_off_heap_exhausted": [
        "Spark: --conf spark.executor.memoryOverhead=2g   # each executor's room outside its heap",
        "java -XX:MaxDirectMemorySize=4g ... (direct buffers) or -XX:MaxMetaspaceSize=1g (Metaspace)",
        "java -XX:NativeMemoryTracking=summary ..., then jcmd PID VM.native_memory summary   # which pool grew",
    ],
    "lmcache_buffer_full": [
        "LMCACHE_MAX_LOCAL_CPU_SIZE=<GB>   # max_local_cpu_size in the config: a larger CPU buffer, if the host has the RAM",
        "free -h   # the host's RAM that the buffer would take",
        "LMCACHE_LOCAL_DISK / a remote backend: room beyond the CPU buffer",
    ],
    "neuron_device_alloc_failed": [
        "neuron-ls   # which processes hold each Neuron device; stop the ones you own",
        "neuron-top   # memory use per NeuronCore, live",
        "shard over more NeuronCores (tensor parallel degree, tp_degree), or a smaller batch or sequence length",
    ],
    "nvenc_out_of_memory": NVENC_SESSIONS,
    "metal_command_buffer_oom": [
        "llama.cpp: lower the context (-c) and batch (-b / -ub), or a smaller quantisation",
        "sudo sysctl iogpu.wired_limit_mb=<MiB>   # raise the GPU's share of unified memory (macOS 14+)",
    ],
}


def describe(process: LiveProcess) -> str:
    """``pid 4242 alice python train.py: 12.00 GiB, SM 0% now, running 3h05m``."""
    parts = [f"pid {process.pid}"]
    if process.user:
        parts.append(process.user)
    what = process.command or process.name
    if what:
        parts.append(what if len(what) <= 60 else what[:57] + "...")
    figures = []
    if process.used_bytes is not None:
        figures.append(format_size(process.used_bytes))
    if process.sm_ratio is not None:
        figures.append(f"SM {process.sm_ratio:.0%} now")
    if process.running_seconds is not None:
        figures.append(f"running {_duration(process.running_seconds)}")
    if process.jupyter_kernel:
        figures.append("Jupyter kernel")
    if process.orphaned:
        figures.append("orphaned")
    return " ".join(parts) + (": " + ", ".join(figures) if figures else "")


def reap_commands(live: LiveGpu, *, min_bytes: int, skip_pid: int | None = None) -> list[str]:
    """``gpuwatch reap`` / ``kill`` lines for each live holder of at least ``min_bytes``;
    none for the process that printed the message (``probably_this_process``)."""
    commands = []
    for process in live.processes:
        if process.pid == skip_pid or (process.used_bytes or 0) < min_bytes:
            continue
        commands.append(f"# {describe(process)}")
        if process.probably_this_process:
            # Stopping it is no fix for its own OOM; a notebook kernel keeps its memory.
            commands.append(
                "# probably the process that printed this message (its PID or memory matches "
                "the message's): not one to stop; if it is a notebook kernel, free its memory "
                "there (del ...; gc.collect(); torch.cuda.empty_cache()) or restart it"
            )
        elif process.uid == 0:
            # gpuwatch reap never stops root's processes (docs/reaper.md, protections).
            commands.append("# root's process: gpuwatch reap never stops it; ask the host's admin")
        elif process.sm_ratio:
            # gpuwatch reap stops only idle processes; this one is working.
            who = process.user or "its owner"
            mine = f" (if it is yours: kill {process.pid})" if live.confirmed else ""
            commands.append(f"# busy now: ask {who}{mine}")
        elif live.confirmed:
            commands.append(f"gpuwatch reap --pid {process.pid}   # or: kill {process.pid}")
        else:
            # Unconfirmed GPU: only the reaper, which checks idleness itself, not a kill.
            commands.append(f"gpuwatch reap --pid {process.pid}")
    return commands


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


# One allocation over a cap on a single block, whatever is free (diagnosis._per_allocation_limit).
# Intel GPUs without large-allocation support refuse one block over 4 GiB: IPEX checks it
# itself, and Level Zero does unless relaxed limits are asked for (unified-runtime#1245);
# PyTorch's native XPU backend lifted its own check in 2025 (torch-xpu-ops#1406).
PER_ALLOCATION_LIMIT_BY_KIND = {
    "xpu": [
        "split the work so no one tensor is over 4 GiB: a smaller batch per call, or the op "
        "in chunks (torch.split / torch.chunk; a tiled VAE decode in image pipelines)",
        "export UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1   # before python starts: lets Level "
        "Zero allocate blocks over the device's single-allocation size",
        "# IPEX checks the 4 GiB cap itself (intel-extension-for-pytorch#325): move to "
        "PyTorch's native XPU backend in a recent release (torch-xpu-ops#1406 lifted it), "
        "with that variable set",
    ],
    "metal": [
        "split the array so no one buffer is over the maximum: a smaller batch, or the op in "
        "chunks",
        'python -c "import mlx.core as mx; print(mx.metal.device_info())"   # '
        "max_buffer_length: the largest buffer this Mac's GPU allows",
    ],
}
PER_ALLOCATION_LIMIT_DEFAULT = [
    "split the work so no one allocation is over the cap: a smaller batch per call, or the "
    "op in chunks",
]

# cudaMallocAsync's pool: memory neither free nor held by this process's tensors, which
# the async backend does not report (diagnosis._async_pool).
ASYNC_POOL = [
    "torch.cuda.empty_cache()   # with backend:cudaMallocAsync it trims the pool: hands the "
    "memory it caches back to the driver",
    "export PYTORCH_CUDA_ALLOC_CONF=backend:native,expandable_segments:True   # before "
    "python starts: the native allocator, whose message says what it reserves",
    "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv   # this "
    "process's own total: well over its tensors means the pool holds the rest",
]

# CuPy's memory pool holding most of the card (diagnosis._cupy_pool).
CUPY_POOL = [
    "cupy.get_default_memory_pool().free_all_blocks()   # hand the pool's cached blocks back "
    "between phases",
    "pool = cupy.get_default_memory_pool(); print(pool.used_bytes(), pool.total_bytes())   "
    "# used is live arrays: if it climbs step after step, something keeps arrays alive",
    "cupy.get_default_memory_pool().set_limit(fraction=0.8)   # or CUPY_GPU_MEMORY_LIMIT=80%: "
    "cap the pool",
    "del the arrays a step no longer needs (and, with Chainer, their graph: "
    "loss.unchain_backward())",
]
# CuPy's working set, in CuPy's terms (no torch autocast for it).
CUPY_WORKING_SET = [
    "process the arrays in chunks, or a smaller batch",
    "float32 (or float16) instead of float64 where precision allows: half the memory",
]

# MPS: memory this process holds outside PyTorch's MPS allocator fills the limit
# (diagnosis._mps_other_allocations).
MPS_OTHER_ALLOCATIONS = [
    "torch.mps.empty_cache()   # hand back the Metal buffers PyTorch caches",
    "offload what is idle to the CPU: pipe.enable_model_cpu_offload() (diffusers), ComfyUI "
    "--lowvram, or load one model at a time",
    "export PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0   # the message's own advice: lifts the "
    "limit, and macOS may then swap or stall",
    *_UNIFIED_MEMORY,
]

# A Metal working set (MLX, llama.cpp's Metal backend): no torch autocast there.
METAL_WORKING_SET = [
    "reduce the batch, the context or the sequence length",
    "a smaller or more quantised model (4-bit), or a smaller dtype (float16)",
    "sudo sysctl iogpu.wired_limit_mb=<MiB>   # raise the GPU's share of unified memory (macOS 14+)",
]

# A working set in system RAM (a framework's CPU device): host advice, never the GPU's.
HOST_WORKING_SET = [
    "free -h   # what system RAM is left; the tensor was on the CPU, not a GPU",
    "reduce the batch size, or feed the data in chunks",
    "if the op should have run on the GPU: check the framework sees it "
    "(tf.config.list_physical_devices('GPU'), torch.cuda.is_available())",
    "sudo dmesg -T | grep -i -E 'killed process|out of memory'   # the OOM killer, if it came",
]


# The device type torch.autocast names, by the device the message is about: ROCm's
# PyTorch is "cuda" to torch; out-of-tree devices are their own.
_AUTOCAST_DEVICES = {"cuda", "xpu", "mps", "npu", "musa", "mlu", "hpu"}


def autocast_device(device_type: str | None) -> str:
    """``torch.autocast``'s ``device_type`` for a message about ``device_type``."""
    return device_type if device_type in _AUTOCAST_DEVICES else "cuda"


def held_across_steps(device: str = "cuda") -> list[str]:
    """:data:`HELD_ACROSS_STEPS` with the cache emptied on ``device``'s torch module."""
    return [line.replace("torch.cuda.", f"torch.{device}.") for line in HELD_ACROSS_STEPS]
