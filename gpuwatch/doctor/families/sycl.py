"""SYCL and oneAPI: the runtime's status when an allocation failed (Intel GPUs, mostly).

A SYCL program (llama.cpp's and stable-diffusion.cpp's SYCL backends, IPEX, oneDNN) reports
the backend's status through the SYCL runtime: ``Native API failed. Native API returns: 40
(UR_RESULT_ERROR_OUT_OF_RESOURCES)`` (the Unified Runtime, 2024 on), ``-5
(PI_ERROR_OUT_OF_RESOURCES)`` (its Plugin Interface before), ``-5 (CL_OUT_OF_RESOURCES)``
(an OpenCL backend), or Level Zero's own ``ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY``.

* ``*_OUT_OF_DEVICE_MEMORY``: the device's memory ran out.
* ``*_OUT_OF_HOST_MEMORY``: system RAM, not the GPU (kind ``host``).
* ``*_OUT_OF_RESOURCES``: the Level Zero and CUDA adapters return it for a device allocation
  that failed (and PI had no other status for it), so it is read as the device's memory,
  unless the text around it names a launch resource instead (work-group size, local
  memory, registers): then it is another error.

In a ggml program (a ``ggml`` word near it) it is kind ``ggml``, whose fixes (fewer
layers, a smaller context) apply; elsewhere kind ``device``, or ``host``.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import (
    Found,
    exception_before,
    line_end,
    line_lookback,
    line_start,
    spans,
)

_STATUS = re.compile(
    r"\b(?P<name>(?:UR_RESULT_ERROR|PI_ERROR|ZE_RESULT_ERROR)_OUT_OF_"
    r"(?P<what>DEVICE_MEMORY|HOST_MEMORY|RESOURCES))\b"
    # OpenCL's status only through SYCL's wrapper: the OpenCL family reads OpenCL's own.
    r"|(?<=\()(?P<cl>CL_OUT_OF_(?P<cl_what>HOST_MEMORY|RESOURCES))(?=\))"
)
_NATIVE_API = re.compile(r"Native\s+API\s+returns:\s*(?P<code>-?\d+)\s*\($")
# Out of resources that are not memory: a kernel's launch limits.
_LAUNCH_RESOURCE = re.compile(
    r"work[-_\s]?group|local\s+memory|\bSLM\b|registers?\b|private\s+memory|sub[-_\s]?group",
    re.IGNORECASE,
)
# ggml's own names (not a model's: IPEX runs "Llama-2-7b" too).
_GGML = re.compile(
    r"ggml|llama[._]cpp|\bllama_\w|whisper\.cpp|stable-diffusion\.cpp", re.IGNORECASE
)
GGML_CONTEXT_CHARS = 1500
CONTEXT_LINES_CHARS = 400


def find(window: str) -> list[Found]:
    """The first SYCL out-of-memory status in ``window`` (one failure prints it on every
    level it passes through)."""
    for span in spans(window, _STATUS, limit=400, needs=("_out_of_",)):
        facts = _facts(window, span.start)
        if facts is not None:
            return [Found(span.start, facts)]
    return []


def _facts(window: str, start: int) -> OomFacts | None:
    match = _STATUS.match(window, start)
    assert match is not None
    what = match["what"] or match["cl_what"]
    begins = line_start(window, start)
    reads = line_lookback(window, start)  # where patterns read the line from
    around = window[max(0, reads - CONTEXT_LINES_CHARS) : start + CONTEXT_LINES_CHARS]
    if what == "RESOURCES" and _LAUNCH_RESOURCE.search(around):
        return None
    code = _NATIVE_API.search(window, reads, start)
    status = match["name"] or match["cl"]
    message = window[begins : line_end(window, start)].strip()[:4000]
    if what == "HOST_MEMORY":
        return OomFacts(
            kind="host",
            category="sycl_out_of_host_memory",
            exception=exception_before(window, begins),
            device_type="host",
            cuda_error=status,
            cuda_error_code=int(code["code"]) if code else None,
            message=message,
        )
    low = max(0, start - GGML_CONTEXT_CHARS)
    ggml = _GGML.search(window, low, start + GGML_CONTEXT_CHARS) is not None
    category = "out_of_device_memory" if what == "DEVICE_MEMORY" else "out_of_resources"
    return OomFacts(
        kind="ggml" if ggml else "device",
        category=f"ggml_sycl_{category}" if ggml else f"sycl_{category}",
        exception=exception_before(window, begins),
        device_type="sycl",
        cuda_error=status,
        cuda_error_code=int(code["code"]) if code else None,
        message=message,
    )
