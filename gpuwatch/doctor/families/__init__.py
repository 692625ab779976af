"""One module per family of OOM wording; each exposes ``find(window) -> list[Found]``.

The families' header patterns are disjoint (each needs its own wording), so every
family runs on every window and the results are ordered by position. The
:data:`FALLBACKS` run only on a window where no family found anything, in order, until
one finds something: a first line that other families' messages begin with, a line in
any other wording that says a GPU's memory ran out (generic.py), and a worker killed by
SIGKILL (where a GPU out-of-memory message is there too, it is the one to explain).
"""

from __future__ import annotations

from collections.abc import Callable

from gpuwatch.doctor.families import (
    accelerate,
    accelerators,
    catboost,
    compute_apis,
    cuda_libraries,
    cupy,
    exllama,
    generic,
    hami,
    host,
    llama_cpp,
    metal,
    mindspore,
    mps,
    nccl,
    nvenc,
    onnxruntime,
    opengl,
    paddle,
    pytorch,
    sglang,
    sycl,
    tensorflow,
    tensorrt,
    tgi,
    vllm,
    wgpu,
    xla,
)
from gpuwatch.doctor.families.clauses import Found

FAMILIES: tuple[Callable[[str], list[Found]], ...] = (
    pytorch.find,
    mps.find,
    metal.find,
    vllm.find,
    cuda_libraries.find,
    nccl.find,
    tensorflow.find,
    xla.find,
    llama_cpp.find,
    cupy.find,
    paddle.find,
    onnxruntime.find,
    tensorrt.find,
    tgi.find,
    hami.find,
    compute_apis.find,
    accelerators.find,
    catboost.find,
    exllama.find,
    host.find_cpu_allocator,
    host.find_applications,
    mindspore.find,
    sycl.find,
    opengl.find,
    wgpu.find,
    sglang.find,
    nvenc.find,
    accelerate.find,
)

FALLBACKS: tuple[Callable[[str], list[Found]], ...] = (
    pytorch.find_first_line,
    generic.find,
    host.find,
    host.find_told,
)

__all__ = ["FALLBACKS", "FAMILIES", "Found"]
