"""Out-of-memory reported by CUDA itself or a CUDA library, outside PyTorch's allocator.

These messages carry no sizes (or only the one failed request), so what they tell is
*where* memory ran out: a plain ``CUDA error: out of memory`` (often the CUDA context
or a kernel's own allocation; the same from HIP, CuPy, Numba, RMM, MXNet), cuBLAS/cuDNN
handle or workspace creation, the other CUDA libraries' allocation statuses (cuFFT,
cuSOLVER, cuSPARSE, cuRAND, cuTENSOR, nvJPEG), bitsandbytes' managed (paged-optimizer)
memory, RAPIDS Memory Manager's pool, OpenCV's CUDA modules (its -217 error with the
runtime's text), NPP's statuses, and the driver API's status by its number (2). NCCL has its
own module (:mod:`~gpuwatch.doctor.families.nccl`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import (
    Found,
    Span,
    compile_clause,
    exception_before,
    line_lookback,
    size_of,
    spans,
)
from gpuwatch.doctor.units import SIZE_PATTERN, size_to_bytes

# The runtime's own wording, in every form it reaches a log: PyTorch's "CUDA error: out of
# memory" (1.10 printed "error:out" with no space), ROCm's "HIP error: out of memory",
# c10's driver-API check "CUDA driver error: out of memory", and the enum names that
# CuPy, RMM and IREE print ("cudaErrorMemoryAllocation: out of memory", "HIP driver error
# 'hipErrorOutOfMemory' (2): out of memory"). Newer PyTorch adds "Search for
# `cudaErrorMemoryAllocation' in ...", which alone (the first line cut off) still says it.
_RUNTIME = re.compile(
    # "CUDA driver API error out of memory" (LuxCore), "CUDA error: Out of memory in
    # cuMemAlloc(...)" (Blender's Cycles, which capitalises the driver's text), "CUDA error
    # at cuCtxCreate: Out of memory" (older Cycles).
    # "CUDA runtime error in ::cudaMallocAsync(ptr, n, stream): out of memory" (a wrapper
    # naming the call), Paddle's "Cuda error(2), out of memory.", nvidia-container-cli's
    # "initialization error: cuda error: out of memory".
    # Glog's wrappers in Paddle 0.x capitalise it: "Cuda Error: out of memory".
    # ggml's CUDA_CHECK names the backend it was built for, so its HIP build prints "ROCm
    # error: out of memory" (then "current device: 0, in function ... at ...common.cuh").
    r"(?P<api>(?i:cuda|hip|rocm))\s+(?i:driver\s+|runtime\s+)?(?i:API\s+)?(?i:error)"
    # A check may print the status's number before its text: "CUDA error 2: out of memory"
    # (2 is the runtime's cudaErrorMemoryAllocation and HIP's hipErrorOutOfMemory).
    r"(?:\s+(?:code\s+)?2\b)?"
    # A check naming the function and line: 'Cuda error in func "cuda_init_device" at line
    # 33: out of memory.' (and "in ::call(...):" above).
    r"(?::|\s*\(2\),|\s+at\s+(?P<at>\w+):"
    r"|\s+in\s+(?:func(?:tion)?\s+)?\"?(?:::)?(?P<in>\w+)(?:\([^)]{0,200}\))?\"?(?:\s+at\s+line\s+\d+)?:)?"
    r"\s*(?i:out\s+of\s+memory)"
    # Cycles names the driver call after the driver's text: "Out of memory in
    # cuStreamCreate(&cuda_stream_, ...) (.../queue.cpp:21)".
    r"|(?i:out\s+of\s+memory)\s+in\s+(?P<call>(?:cu|hip)[A-Z]\w*)\("
    # The enum name is the error itself, with or without its text after it: "'hipErrorOutOfMemory'(2)
    # at square.cpp:76", or quoted in a sentence. Older HIP (ROCm 2.3 in one report) spelt
    # it like CUDA's, "hipErrorMemoryAllocation", a name newer HIP keeps as an alias.
    r"|(?P<enum>\b(?:cuda|hip)ErrorMemoryAllocation|\bhipErrorOutOfMemory)\b'?(?:\s*\(\d+\))?(?::?\s+out\s+of\s+memory)?"
    r"|Search\s+for\s+`(?P<hint>(?:cuda|hip)ErrorMemoryAllocation|hipErrorOutOfMemory)'"
    # CTranslate2 (faster-whisper, whisperX): "RuntimeError: CUDA failed with error out of memory".
    # cumm/spconv's TensorStorage: "cuda failed with error 2 out of memory".
    r"|(?P<ct2>CUDA|HIP|cuda|hip)\s+failed\s+with\s+error\s+(?:2\s+)?out\s+of\s+memory"
    # Thrust's algorithms (cuDF, XGBoost): "parallel_for failed: out of memory"; its
    # thrust::system::detail::bad_alloc puts CUDA's text after the name of the C++
    # exception it derives from: "std::bad_alloc: out of memory" (newer ones with the
    # enum first). A plain C++ std::bad_alloc (host RAM) prints no text after its name.
    r"|(?P<thrust>parallel_for\s+failed|std::bad_alloc):\s*(?:cudaErrorMemoryAllocation:\s*)?"
    r"out\s+of\s+memory"
    # MindSpore's CUDA wrappers: "The cudaStreamCreateWithFlags failed, ret[2], out of memory"
    # (a host allocation, cudaHostAlloc, is pinned system RAM: see _HOST_CALL).
    r"|(?P<ms>(?:cuda|cu|hip)[A-Z]\w*)\s+failed,\s*ret\[2\],?\s*out\s+of\s+memory"
    # A custom op's own allocator (TensorFlow's permutohedral lattice and others): "GPU
    # memory allocation failed (might be due to insufficient memory)".
    r"|(?P<generic>GPU\s+memory\s+allocation\s+failed)"
    # The copied gpuErrchk macro: "GPUassert: out of memory mean.cu 377".
    r"|(?P<gpuassert>GPUassert):\s*out\s+of\s+memory"
    # A binding's debug print of a driver error, its text quoted: Rust cudarc's
    # 'DriverError(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")'.
    r"|(?P<quoted>Driver|Cuda|CUDA)Error\(\s*[^,()\n]{1,60},\s*\"out\s+of\s+memory\"\)"
    # Cycles' own summary: "System is out of GPU memory", "... out of GPU and shared host memory".
    r"|(?P<cycles>System\s+is\s+out\s+of\s+GPU)(?:\s+and\s+shared\s+host)?\s+memory"
)
# Allocations of pinned host memory: their "out of memory" is system RAM's.
_HOST_CALL = re.compile(r"HostAlloc|MallocHost|HostRegister")
# TensorRT-LLM wraps the runtime's error in its own: that family explains it.
_TRT_LLM_BEFORE = re.compile(r"\[TensorRT-LLM\]")
# XGBoost's allocator adds the figures on lines of their own after the error.
_RUNTIME_FREE = re.compile(r"Free\s+memory:\s*(\d+)\b")
_RUNTIME_REQUESTED = re.compile(r"Requested\s+memory:\s*(\d+)\b")
# A framework's own report of a failed cudaMalloc/hipMalloc: MXNet's pooled storage
# manager ("cudaMalloc failed: out of memory", "cudaMalloc retry failed: out of memory"),
# and ONNX Runtime's and CNTK's CUDA_CALL ("CUDA failure 2: out of memory ; GPU=0 ;
# ... expr=cudaMalloc(...)"). llama.cpp prints the same after "allocating N MiB on device
# N:", which is its family's (:mod:`~gpuwatch.doctor.families.llama_cpp`).
_MALLOC = re.compile(
    # Faiss: "... (cudaMalloc error out of memory [2])".
    r"(?P<call>cuda|hip)Malloc(?:\s+retry)?\s+(?:failed:|error)\s*out\s+of\s+memory"
    # Any project's check that names the runtime call and then prints the runtime's text,
    # on the same line or wrapped once: "cudaMalloc dev_pos failed: out of memory.",
    # dlib's "Error while calling cudaMalloc(&data, n) in file gpu_data.cpp:221. code: 2,
    # reason: out of memory", tiny-cuda-nn's "cudaMalloc(&rawptr, n) failed with error out
    # of memory". The call's name starts the match (the lookbehind keeps it from being tried
    # inside a longer word), and the gap is bounded.
    r"|(?<![\w.])(?P<named>(?:cuda|hip)(?!Error|Success|GetError|GetLastError)[A-Z]\w{2,40})\b"
    r"(?:[^\n]{0,300}?|[^\n]{0,300}\n[^\n]{0,40}?)\bout\s+of\s+memory"
    # PyCUDA names the driver call: "MemoryError: cuMemAlloc failed: out of memory".
    r"|(?P<driver>cuMem\w+)\s+failed:\s*out\s+of\s+memory"
    r"|(?P<api>CUDA|HIP)\s+failure\s+2:\s*out\s+of\s+memory"
    # MXNet's GPU pool before 0.9: "pooled_storage_manager.h:62: Memory allocation failed."
    r"|(?P<pool>pooled_storage_manager)\.h:\d+:\s*Memory\s+allocation\s+failed"
    # Theano's CUDA back end: "Error allocating 33554432 bytes of device memory (out of
    # memory). Driver report 21364736 bytes free and 11715084288 bytes total".
    r"|Error\s+allocating\s+(?P<bytes>\d+)\s+bytes\s+of\s+device\s+memory"
)
# A tool's own report of a device allocation that failed, with its size: "GPU-0: Failed to
# allocate 16.00 GB GPU memory (0.00 GB available)" (GrabGPU), "failed to allocate 2 GiB of
# device memory". TensorFlow's "failed to allocate N (M bytes) from device" is its family's.
_GPU_ALLOC = compile_clause(
    r"(?i:failed\s+to\s+allocate)\s+",
    r"\s+(?:of\s+)?(?i:GPU|device|VRAM|video)\s+memory"
    r"(?:\s*\((?:only\s+)?(?P<free>[\d.]+\s?[KMGT]i?B)\s+(?:available|free)\))?",
)
_SIZE = re.compile(SIZE_PATTERN)
_GPU_DASH_INDEX = re.compile(r"\bGPU[-\s#]?(\d+)\s*:\s*$")
_DRIVER_REPORT = re.compile(
    r"Driver\s+report\s+(?P<free>\d+)\s+bytes\s+free\s+and\s+(?P<total>\d+)\s+bytes\s+total"
)
_GGML_BEFORE = re.compile(r"on\s+device\s+\d+:\s*$")
# The CUDA_CHECK macro many C++ projects copy: "CUDA error 2 at ggml-cuda.cu:359: out of
# memory" (llama.cpp before 2024, and others); 2 is cudaErrorMemoryAllocation.
_CHECK_MACRO = re.compile(
    # The same check may say "in file F line N" (AMReX's: "CUDA error 2 in file
    # .../AMReX_Arena.cpp line 169: out of memory !!!"), and a HIP build "HIP error 2".
    r"(?P<api0>CUDA|HIP)\s+error\s+2\s+(?:at|in)\s+(?:file\s+)?(?P<file>[\w./-]+?)"
    r"(?::(?P<line>\d+)|,?\s+(?:at\s+)?line\s+(?P<line0>\d+))\s*:\s*out\s+of\s+memory"
    # "CUDA by Example"'s HANDLE_ERROR, copied as widely: "out of memory in FILE at line N".
    r"|out\s+of\s+memory\s+in\s+(?P<file2>[\w./-]+\.(?:cu|cuh|cpp|cc|c|h))\s+at\s+line\s+(?P<line2>\d+)"
    # Caffe2's CUDA_ENFORCE and others: "context_gpu.cu:415: out of memory" (a CUDA source file).
    # A path is matched from its first character only (the lookbehind): tried from every
    # character of a long token, the pattern would cost the token's length squared.
    r"|(?<![\w./-])(?P<file3>[\w./-]+\.cuh?):(?P<line3>\d+):\s*out\s+of\s+memory"
    # The same with the line in parentheses (XGBoost's and Thrust's errors, mallocMC's
    # CUDA::error): "device_helpers.cuh(456): out of memory", "...hpp(42):\nerror: out of
    # memory". A C++ file's own "out of memory" could be the host's: only a CUDA source
    # file, or one whose path or line names CUDA (see _cuda_location).
    r"|(?<![\w./-])(?P<file4>[\w./-]+\.(?:cuh?|hpp|cpp|cc|cxx|h))\((?P<line4>\d+)\):\s*(?:error:\s*)?out\s+of\s+memory"
    # glog's CHECK in Caffe and its forks: "syncedmem.cpp:56] Check failed: error ==
    # cudaSuccess (2 vs. 0)  out of memory"; 2 is the runtime's cudaErrorMemoryAllocation.
    # Either side may be cudaSuccess (Paddle 0.x: "Check failed: cudaSuccess == cudaStat
    # (0 vs. 2)"), and Caffe2's CAFFE_ENFORCE prints it without the parentheses:
    # "[enforce fail at event_gpu.cc:17] error == cudaSuccess. 2 vs 0.".
    r"|(?:Check\s+failed:\s*)?(?<!\w)\w+\s*==\s*(?P<check>cuda|hip)Success\.?\s*\(?2\s+vs\.?\s+0\b"
    r"|(?:Check\s+failed:\s*)?(?<!\w)(?P<check2>cuda|hip)Success\s*==\s*\w+\.?\s*\(?0\s+vs\.?\s+2\b"
)
_CUDA_CONTEXT = re.compile(r"cuda|thrust|\bhip", re.IGNORECASE)
# OpenCV's CUDA modules raise cv::Exception with code -217 (cv::Error::GpuApiCallError) and
# the CUDA runtime's own text: "cuda_info.cpp:74: error: (-217:Gpu API call) out of memory in
# function 'setDevice'" (OpenCV 4), "error: (-217) out of memory in function allocate"
# (OpenCV 3), "OpenCV Error: Gpu API call (out of memory) in allocate, file ..., line N" (2.4).
_OPENCV = re.compile(
    r"\(-217(?::Gpu\s+API\s+call)?\)\s*out\s+of\s+memory(?:\s+in\s+function\s+'?(?P<function>\w+))?"
    r"|Gpu\s+API\s+call\s+\(out\s+of\s+memory\)(?:\s+in\s+(?P<function2>\w+))?"
)
# Where OpenCV threw it: "cuda_info.cpp:74: error:" before, or ", file PATH, line N" after.
_OPENCV_SOURCE = re.compile(r"(?P<file>[\w.-]+\.(?:cpp|cu|hpp)):(?P<line>\d+):\s*error:")
_OPENCV_SOURCE_AFTER = re.compile(
    r"file\s+\S*?(?P<file>[\w.-]+\.(?:cpp|cu|hpp)),\s+line\s+(?P<line>\d+)"
)
# cv::cuda::HostMem (cuda_host_mem.cpp) allocates page-locked host memory: system RAM.
_OPENCV_HOST = re.compile(r"host_mem")
# The driver API's status by its number: CUDA_ERROR_OUT_OF_MEMORY is 2 (as the runtime's
# cudaErrorMemoryAllocation is). torch_memory_saver (SGLang): "CUresult error  result=2
# file=csrc/torch_memory_saver.cpp func=cu_mem_create line=103"; Numba: "CudaAPIError: [2]
# Call to cuMemAlloc results in ..."; NVIDIA's samples' checkCudaErrors: "Driver API error =
# 0002". Only 2: the driver's other statuses are other errors.
_DRIVER_CODE = re.compile(
    r"\bCUresult(?:\s+error)?\s*(?:result|code|status)?\s*[=:(]?\s*(?P<code>2)\b(?![.\d])"
    r"|\[2\]\s+Call\s+to\s+(?P<numba>cu[A-Z]\w*)"
    r"|\bDriver\s+API\s+error\s*=\s*0*2\b"
)
_DRIVER_CODE_FUNC = re.compile(r"\bfunc(?:tion)?\s*[=:]\s*(?P<func>\w+)")
# "file=csrc/torch_memory_saver.cpp ... line=103", "from file <simpleDrvRuntime.cpp>, line 53".
_DRIVER_CODE_FILE = re.compile(r"\bfile\s*[=:]?\s*<?[^\s<>]*?(?P<file>[\w.-]+\.\w+)>?")
_DRIVER_CODE_LINE = re.compile(r"\bline\s*[=:]?\s*(?P<line>\d+)")
_GLOG_LOCATION = re.compile(r"\b(\w+\.(?:cpp|cu|cc|hpp)):(\d+)\]\s*$")
# The driver API's name. TensorFlow's stream executor prints it too, after "failed to
# alloc(ate) ... from device/on host:"; that wording is the tensorflow family's, and
# XLA's "cuMemAllocAsync failed to allocate ... RESOURCE_EXHAUSTED" is the xla family's.
_DRIVER = re.compile(r"CUDA_ERROR_OUT_OF_MEMORY")
_OTHER_FAMILY_BEFORE = re.compile(r"failed\s+to\s+alloc|RESOURCE_EXHAUSTED")
_DRIVER_CALL = re.compile(r"\b(cu[A-Z]\w*)\b")
_CUBLAS = re.compile(r"CUBLAS_STATUS_(?P<status>ALLOC_FAILED|NOT_INITIALIZED)")
# The other CUDA libraries' "could not allocate" statuses, by their enum names (cuFFT's
# has no STATUS_, cuRAND's says ALLOCATION, nvJPEG's ALLOCATOR_FAILURE).
_LIBRARY_ALLOC = re.compile(
    r"\b(?P<status>(?P<lib>CUSOLVER|CUSPARSE|CUTENSOR)_STATUS_ALLOC_FAILED"
    r"|(?P<fft>CUFFT)_ALLOC_FAILED|(?P<rand>CURAND)_STATUS_ALLOCATION_FAILED"
    r"|(?P<jpeg>NVJPEG)_STATUS_ALLOCATOR_FAILURE)\b"
    # cuFFT's status by its number (2) or its documented text, as CUDA.jl prints it:
    # "CUFFTError(code 2, cuFFT failed to allocate GPU or CPU memory)".
    r"|\b(?P<fft_code>CUFFT)(?:Error)?\(code\s+2\b|(?P<fft_text>cuFFT)\s+failed\s+to\s+allocate\s+GPU\s+or\s+CPU\s+memory"
    # glog's check that got the allocation status (2 for each of these) for success:
    # "Check failed: (cufftPlanMany(...)) == CUFFT_SUCCESS (2 vs. 0)".
    r"|\b(?P<check>CUFFT|CUSOLVER|CUSPARSE)_(?:STATUS_)?SUCCESS\s*\(\s*2\s+vs\.?\s+0\s*\)"
    # NPP's statuses: NPP_MEMORY_ALLOCATION_ERR (-9; older headers' NPP_MEM_ALLOC_ERR, whose
    # text some wrappers print as NPP_MEMORY_ALLOCATION_ERROR) and NPP_NO_MEMORY_ERROR; and
    # ManagedCuda's NPPException when nppiMalloc returned no pointer: "Device allocation error".
    r"|\b(?P<npp_status>(?P<npp>NPP)_(?:MEMORY_ALLOCATION_ERR(?:OR)?|MEM_ALLOC_ERR|NO_MEMORY_ERROR))\b"
    r"|\b(?P<npp_managed>NPP)Exception\W{0,4}Device\s+allocation\s+error"
)
# NOT_INITIALIZED means cuBLAS could not create its handle; when that failed in handle
# creation (cublasCreate, TF's "failed to create cublas handle", CuPy's cublas.create),
# the GPU was nearly always full. Elsewhere it is a setup error, not an OOM.
_CUBLAS_HANDLE = re.compile(r"cublasCreate|create\s+cublas\s+handle|cublas\.create")
CUBLAS_HANDLE_LOOKBACK_CHARS = 600
_CALLING = re.compile(r"(?:when\s+calling\s+`?|expr=)(\w+\([^)`\n]{0,80}\))")
# cuDNN statuses that, in practice, mostly mean cuDNN could not get memory for its
# handle or workspace; ALLOC_FAILED (and cuDNN 9's *_ALLOCATION_FAILED) say so outright.
# In any case: "RuntimeError cudnn error cudnn_status_alloc_failed", as some print it.
_CUDNN_STATUS = re.compile(
    r"CUDNN_STATUS_(ALLOC_FAILED|INTERNAL_ERROR_(?:DEVICE|HOST)_ALLOCATION_FAILED"
    r"|NOT_INITIALIZED|EXECUTION_FAILED|INTERNAL_ERROR)",
    re.IGNORECASE,
)
# The same status by its number right after the cuDNN call that returned it, as
# cudnn.torch's find.lua prints it: "cudnnFindConvolutionForwardAlgorithm failed:    2".
# cudnnStatus_t's 2 is CUDNN_STATUS_ALLOC_FAILED (1 NOT_INITIALIZED, 3 BAD_PARAM, ...).
_CUDNN_STATUS_NUMBER = re.compile(r"\b(?P<call>cudnn[A-Z]\w{2,80})(?:\s+failed)?:\s+2\b(?![.\d])")
_CUDNN_CALL = re.compile(r"\((cudnn\w+)\)")
# CNTK and similar wrappers: "... ; GPU=1 ; hostname=... ; expr=cublasCreate(&cuHandle)".
_GPU_FIELD = re.compile(r";\s*GPU=(\d+)\s*;")
_CUDNN_NO_ALGORITHM = re.compile(r"Unable\s+to\s+find\s+a\s+valid\s+cuDNN\s+algorithm")
_CPP_LOCATION = re.compile(r"\bat\s+\S*?(\w+\.cpp:\d+)")
_CPP_LOCATION_COLON = re.compile(r"(\w+\.cpp:\d+):")
_WORKSPACE = re.compile(
    r"Minimum\s+workspace\s+size:\s*(?P<need>\d+)\s*Bytes\s+Given:\s*(?P<given>\d+)\s*Bytes"
)
# MIOpen (ROCm's DNN library) could not get a buffer: "MIOpen Error: .../handlehip.cpp:70:
# Memory not available to allocate buffer: 655360000".
_MIOPEN = re.compile(r"Memory\s+not\s+available\s+to\s+allocate\s+buffer:\s*(?P<bytes>\d+)")
# RAPIDS Memory Manager (cuDF, Spark RAPIDS, dask-cuda): its exception's text, "std::bad_alloc:
# out_of_memory: CUDA error at: .../rmm/..." (the upstream cudaMalloc failed) or "out_of_memory:
# RMM failure at:.../pool_memory_resource.hpp:196: Maximum pool size exceeded" (the pool or
# arena reached the maximum size it was created with; older releases print it without the
# "out_of_memory: "), the exception type alone ("terminate called after throwing an instance
# of 'rmm::out_of_memory'"), and the RMM releases before 0.12: "RMMError: RMM_ERROR_OUT_OF_MEMORY".
# RMM's own error log ("[FAILURE maximum pool size exceeded]") is not read: Spark RAPIDS logs
# it for every tryAlloc that then goes on.
_RMM = re.compile(
    r"(?:rmm::)?out_of_memory:\s+(?:CUDA\s+error|RMM\s+failure)\s+at"
    r"|\bRMM\s+failure\s+at:?\s*\S{0,300}?:\s*Maximum\s+pool\s+size\s+exceeded"
    r"|\brmm::out_of_memory\b|RMM_ERROR_OUT_OF_MEMORY"
)
_RMM_POOL_FULL = re.compile(r"Maximum\s+pool\s+size\s+exceeded")
# The memory resource that failed, from the path RMM prints: "pool_memory_resource.hpp:182".
_RMM_RESOURCE = re.compile(r"\b(?P<resource>\w+_memory_resource)\.hpp:(?P<line>\d+)")
# A pool over pinned host memory (Spark RAPIDS' host allocations): system RAM, not the GPU.
_RMM_HOST_RESOURCE = re.compile(r"pinned|host")
# Newer RMM adds the request: "Maximum pool size exceeded (failed to allocate 1.00 GiB)".
_RMM_REQUESTED = compile_clause(r"\(failed\s+to\s+allocate\s+")
RMM_CONTEXT_CHARS = 800
_BNB = re.compile(
    r"Error\s+out\s+of\s+memory\s+at\s+line\s+(?P<line>\d+)\s+in\s+file\s+(?P<file>\S+)"
)


# What ggml's CUDA_CHECK prints after the runtime's text: "current device: 0, in function
# ggml_cuda_pool_malloc_vmm at .../ggml-cuda.cu:8583" (HIP builds: ".../common.cuh").
_GGML_CHECK = re.compile(
    r"current\s+device:\s*(?P<device>\d+),\s+in\s+function\s+(?P<function>\w+)\s+at\s+"
    r"(?P<file>\S*(?:ggml|llama\.cpp|common\.cuh)\S*)"
)


def find(window: str) -> list[Found]:
    """Every CUDA runtime/driver/library OOM in ``window``."""
    found: list[Found] = []
    for header, build in _BUILDERS:
        for span in spans(window, header, limit=800, needs=_NEEDS.get(header, ())):
            facts = build(span)
            if facts is not None:
                found.append(Found(span.start, facts))
    return found


def _runtime(span: Span) -> OomFacts | None:
    match = _RUNTIME.match(span.text, span.start)
    assert match is not None
    if _TRT_LLM_BEFORE.search(span.text, span.line_lookback, span.start):
        return None
    call = match["at"] or match["in"] or match["call"] or match["ms"]
    name = match["api"] or match["enum"] or match["hint"] or match["ct2"] or call or ""
    hip = name.upper().startswith(("HIP", "ROCM"))
    host = call is not None and _HOST_CALL.search(call) is not None
    cuda_error = (
        "hipErrorOutOfMemory"
        if hip
        else "CUDA_ERROR_OUT_OF_MEMORY"
        if match["quoted"] == "Driver"
        else "cudaErrorMemoryAllocation"
    )
    # ggml's CUDA_CHECK (llama.cpp, Ollama): llama.cpp's own fixes apply.
    ggml = _GGML_CHECK.search(span.text, span.start, span.end)
    if ggml is not None and not host:
        return OomFacts(
            kind="ggml",
            category="ggml_cuda_check_oom",
            exception=exception_before(span.text, span.start),
            device_type="hip" if hip else "cuda",
            device_index=int(ggml["device"]),
            cuda_error=cuda_error,
            api_call=ggml["function"],
            source_location=ggml["file"],
            message=span.snippet,
        )
    return OomFacts(
        kind="driver",
        category="host_pinned_memory_oom"
        if host
        else _device_category(span, "cuda_runtime_error_oom"),
        exception=exception_before(span.text, span.start),
        device_type="host" if host else "hip" if hip else "cuda",
        requested_bytes=span.integer(_RUNTIME_REQUESTED),
        free_bytes=span.integer(_RUNTIME_FREE),
        cuda_error=cuda_error,
        api_call=call,
        message=span.snippet,
    )


def _malloc(span: Span) -> OomFacts | None:
    match = _MALLOC.match(span.text, span.start)
    assert match is not None
    if _GGML_BEFORE.search(span.text, span.line_lookback, span.start):
        return None
    named = match["named"]
    if named and _RUNTIME.search(span.text, span.start, match.end()):
        # "... cudaMallocAsync(...): out of memory" and the like: the runtime's own wording,
        # which that builder reads.
        return None
    hip = (match["call"] or match["api"] or named or "").upper().startswith("HIP")
    call = named or match["driver"] or ("hipMalloc" if hip else "cudaMalloc")
    host = named is not None and _HOST_CALL.search(named) is not None
    report = _DRIVER_REPORT.search(span.text, span.start, span.end)
    return OomFacts(
        kind="driver",
        category="host_pinned_memory_oom" if host else "cuda_malloc_failed",
        exception=exception_before(span.text, span.start),
        device_type="host" if host else "hip" if hip else "cuda",
        device_index=span.integer(_GPU_FIELD),
        requested_bytes=int(match["bytes"]) if match["bytes"] else None,
        free_bytes=int(report["free"]) if report else None,
        total_bytes=int(report["total"]) if report else None,
        cuda_error="hipErrorOutOfMemory" if hip else "cudaErrorMemoryAllocation",
        api_call=call,
        message=span.snippet,
    )


def _gpu_alloc(span: Span) -> OomFacts:
    match = _GPU_ALLOC.match(span.text, span.start)
    assert match is not None
    index = _GPU_DASH_INDEX.search(span.text, span.line_lookback, span.start)
    free = _SIZE.fullmatch(match["free"]) if match["free"] else None
    return OomFacts(
        kind="driver",
        category="gpu_alloc_failed",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        device_index=int(index[1]) if index else None,
        requested_bytes=size_of(match),
        free_bytes=size_to_bytes(free["num"], free["unit"]) if free else None,
        message=span.snippet,
    )


def _library_alloc(span: Span) -> OomFacts:
    match = _LIBRARY_ALLOC.match(span.text, span.start)
    assert match is not None
    library = match["lib"] or match["fft"] or match["rand"] or match["jpeg"] or match["check"]
    library = library or match["npp"] or match["npp_managed"] or "CUFFT"
    status = match["status"] or match["npp_status"]
    if status is None:
        status = {"CUFFT": "CUFFT_ALLOC_FAILED", "NPP": "NPP_MEMORY_ALLOCATION_ERR"}.get(
            library, f"{library}_STATUS_ALLOC_FAILED"
        )
    return OomFacts(
        kind="cuda_library",
        category=f"{library.lower()}_alloc_failed",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        library_status=status,
        api_call=span.group(_CALLING),
        message=span.snippet,
    )


def _check_macro(span: Span) -> OomFacts | None:
    match = _CHECK_MACRO.match(span.text, span.start)
    assert match is not None
    begins = span.line_lookback
    check = match["check"] or match["check2"]
    if check:
        glog = _GLOG_LOCATION.search(span.text, begins, span.start)
        file, line = (glog[1], glog[2]) if glog else ("", "")
    else:
        file = match["file"] or match["file2"] or match["file3"] or match["file4"]
        line = match["line"] or match["line0"] or match["line2"] or match["line3"] or match["line4"]
    host_file = match["file4"] and not file.endswith((".cu", ".cuh"))
    if host_file and not _cuda_location(span, match.end()):
        return None
    ggml = "ggml" in file
    hip = check == "hip" or match["api0"] == "HIP"
    return OomFacts(
        kind="ggml" if ggml else "driver",
        category="ggml_cuda_alloc_failed" if ggml else "cuda_runtime_error_oom",
        exception=exception_before(span.text, span.start),
        device_type="hip" if hip else "cuda",
        cuda_error="hipErrorOutOfMemory" if hip else "cudaErrorMemoryAllocation",
        cuda_error_code=2,
        source_location=f"{file.rsplit('/', 1)[-1]}:{line}" if file else None,
        message=span.snippet,
    )


def _opencv(span: Span) -> OomFacts:
    match = _OPENCV.match(span.text, span.start)
    assert match is not None
    line_end = span.text.find("\n", span.start, span.end)
    line_end = span.end if line_end == -1 else line_end
    source = _OPENCV_SOURCE.search(span.text, span.line_lookback, span.start) or (
        _OPENCV_SOURCE_AFTER.search(span.text, span.start, line_end)
    )
    file = source["file"] if source else ""
    host = _OPENCV_HOST.search(file) is not None
    return OomFacts(
        kind="driver",
        category="host_pinned_memory_oom" if host else "opencv_cuda_oom",
        exception=exception_before(span.text, span.start),
        device_type="host" if host else "cuda",
        cuda_error="cudaErrorMemoryAllocation",
        api_call=match["function"] or match["function2"],
        source_location=f"{file}:{source['line']}" if source else None,
        message=span.snippet,
    )


def _driver_code(span: Span) -> OomFacts:
    match = _DRIVER_CODE.match(span.text, span.start)
    assert match is not None
    line_end = span.text.find("\n", span.start, span.end)
    line_end = span.end if line_end == -1 else line_end
    func = _DRIVER_CODE_FUNC.search(span.text, span.start, line_end)
    file = _DRIVER_CODE_FILE.search(span.text, span.start, line_end)
    line = _DRIVER_CODE_LINE.search(span.text, file.end(), line_end) if file else None
    return OomFacts(
        kind="driver",
        category="cuda_driver_error_oom",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        cuda_error="CUDA_ERROR_OUT_OF_MEMORY",
        cuda_error_code=2,
        api_call=match["numba"] or (func["func"] if func else None),
        source_location=f"{file['file']}:{line['line']}" if file and line else None,
        message=span.snippet,
    )


def _cuda_location(span: Span, end: int) -> bool:
    """Whether a C++ file's "(N): out of memory" (ending at ``end``) is CUDA's: the file's
    path, its line, or the line before it ("terminate called after throwing an instance
    of 'CUDA::error'") names CUDA, Thrust or HIP."""
    begins = span.line_lookback
    # The line before only where the match's own line is read from its start.
    previous = line_lookback(span.text, max(0, begins - 1)) if begins == span.line_start else begins
    return _CUDA_CONTEXT.search(span.text, previous, end) is not None


def _driver(span: Span) -> OomFacts | None:
    begins = span.line_lookback
    if _OTHER_FAMILY_BEFORE.search(span.text, begins, span.start):
        return None
    call = _DRIVER_CALL.search(span.text, begins, span.start)
    return OomFacts(
        kind="driver",
        category="cuda_driver_error_oom",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        cuda_error="CUDA_ERROR_OUT_OF_MEMORY",
        api_call=call[1] if call else span.group(_DRIVER_CALL),
        message=span.snippet,
    )


def _cublas(span: Span) -> OomFacts | None:
    status = span.group(_CUBLAS, "status")
    category = "cublas_alloc_failed"
    if status == "NOT_INITIALIZED":
        around = span.text[max(0, span.start - CUBLAS_HANDLE_LOOKBACK_CHARS) : span.end]
        if not _CUBLAS_HANDLE.search(around):
            return None
        category = "cublas_handle_oom_suspect"
    return OomFacts(
        kind="cublas",
        category=category,
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        device_index=span.integer(_GPU_FIELD),
        library_status=f"CUBLAS_STATUS_{status}",
        api_call=span.group(_CALLING),
        message=span.snippet,
    )


def _cudnn_status(span: Span) -> OomFacts:
    status = (span.group(_CUDNN_STATUS) or "").upper()
    return OomFacts(
        kind="cudnn",
        category="cudnn_alloc_failed" if "ALLOC" in status else "cudnn_status_oom_suspect",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        device_index=span.integer(_GPU_FIELD),
        library_status=f"CUDNN_STATUS_{status}",
        api_call=span.group(_CUDNN_CALL) or span.group(_CALLING),
        message=span.snippet,
    )


def _cudnn_status_number(span: Span) -> OomFacts:
    match = _CUDNN_STATUS_NUMBER.match(span.text, span.start)
    return OomFacts(
        kind="cudnn",
        category="cudnn_alloc_failed",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        library_status="CUDNN_STATUS_ALLOC_FAILED",
        api_call=match["call"] if match else None,
        message=span.snippet,
    )


def _cudnn_no_algorithm(span: Span) -> OomFacts:
    return OomFacts(
        kind="cudnn",
        category="cudnn_no_algorithm_oom",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        source_location=span.group(_CPP_LOCATION),
        message=span.snippet,
    )


def _workspace(span: Span) -> OomFacts:
    return OomFacts(
        kind="cudnn",
        category="conv_workspace_insufficient",
        device_type="cuda",
        workspace_required_bytes=span.integer(_WORKSPACE, "need"),
        workspace_given_bytes=span.integer(_WORKSPACE, "given"),
        message=span.snippet,
    )


def _miopen(span: Span) -> OomFacts:
    return OomFacts(
        kind="driver",
        category="miopen_alloc_failed",
        exception=exception_before(span.text, span.start),
        device_type="hip",
        requested_bytes=span.integer(_MIOPEN, "bytes"),
        source_location=span.group(_CPP_LOCATION_COLON),
        message=span.snippet,
    )


# CUDA managed (unified) memory: RMM's managed_memory_resource, cudaMallocManaged. On
# Linux it can outgrow the GPU and page to system RAM; under WSL2 and Windows it cannot.
_MANAGED = re.compile(
    r"managed_memory_resource|cudaMallocManaged|cuMemAllocManaged|\bmanaged\s+memory\b",
    re.IGNORECASE,
)
MANAGED_CATEGORY = "cuda_managed_memory_oom"


def _device_category(span: Span, category: str) -> str:
    """``category``, or the managed-memory one where the message's line allocates
    managed memory."""
    end = span.text.find("\n", span.start, span.end)
    managed = _MANAGED.search(span.text, span.line_lookback, end if end != -1 else span.end)
    return MANAGED_CATEGORY if managed else category


def _rmm(span: Span) -> OomFacts:
    # The type's name may open the message, its text (with the resource) on the next line
    # (what() after "terminate called ..."): read to the end of that line.
    bound = min(len(span.text), span.start + RMM_CONTEXT_CHARS)
    line_end = span.text.find("\n", span.start, bound)
    after = -1 if line_end == -1 else span.text.find("\n", line_end + 1, bound)
    reach = bound if after == -1 else after
    resource = _RMM_RESOURCE.search(span.text, span.start, reach)
    pool_full = _RMM_POOL_FULL.search(span.text, span.start, reach) is not None
    host = resource is not None and _RMM_HOST_RESOURCE.search(resource["resource"]) is not None
    category = "rmm_pool_exhausted" if pool_full else _device_category(span, "rmm_out_of_memory")
    requested = _RMM_REQUESTED.search(span.text, span.start, reach)
    return OomFacts(
        kind="driver",
        category="host_pinned_memory_oom" if host else category,
        exception=exception_before(span.text, span.start),
        device_type="host" if host else "cuda",
        requested_bytes=size_of(requested) if requested else None,
        cuda_error=None if pool_full or host else "cudaErrorMemoryAllocation",
        source_location=f"{resource['resource']}.hpp:{resource['line']}" if resource else None,
        message=span.snippet,
    )


def _bitsandbytes(span: Span) -> OomFacts:
    path = span.group(_BNB, "file") or ""
    # Keep the path inside the bitsandbytes tree ("csrc/pythonInterface.c"), not the
    # reporter's home directory.
    source = path[path.rfind("csrc/") :] if "csrc/" in path else path.rsplit("/", 1)[-1]
    return OomFacts(
        kind="bitsandbytes",
        category="bitsandbytes_cuda_error_oom",
        device_type="cuda",
        source_location=source or None,
        source_line=span.integer(_BNB, "line"),
        message=span.snippet,
    )


# A word of every branch of a builder's pattern (clauses.mentions), for the patterns
# that would otherwise be tried at every position of a window.
_NEEDS: dict[re.Pattern[str], tuple[str, ...]] = {
    _RMM: ("rmm", "out_of_memory"),
    _OPENCV: ("-217", "(out"),
    _DRIVER_CODE: ("curesult", "[2]", "driver"),
    _CUDNN_STATUS_NUMBER: ("cudnn",),
}

_BUILDERS: tuple[tuple[re.Pattern[str], Callable[[Span], OomFacts | None]], ...] = (
    (_RUNTIME, _runtime),
    (_MALLOC, _malloc),
    (_GPU_ALLOC, _gpu_alloc),
    (_CHECK_MACRO, _check_macro),
    (_DRIVER, _driver),
    (_CUBLAS, _cublas),
    (_LIBRARY_ALLOC, _library_alloc),
    (_CUDNN_STATUS, _cudnn_status),
    (_CUDNN_STATUS_NUMBER, _cudnn_status_number),
    (_CUDNN_NO_ALGORITHM, _cudnn_no_algorithm),
    (_WORKSPACE, _workspace),
    (_MIOPEN, _miopen),
    (_RMM, _rmm),
    (_OPENCV, _opencv),
    (_DRIVER_CODE, _driver_code),
    (_BNB, _bitsandbytes),
)
