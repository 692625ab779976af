"""wgpu (Rust's WebGPU: Burn, Ruffle, Bevy, ...) and WebGPU: a device allocation failed.

wgpu reports an error through its error sink with the call it happened in on a line of
its own, and the cause further down::

    wgpu error: Validation Error

    Caused by:
        In Device::create_buffer
          note: label = `Buffer Src`
        Not enough memory left

``Not enough memory left`` (wgpu-core's ``DeviceError::OutOfMemory``) is read only inside
such a report: after a ``wgpu`` word or an ``In Device::...`` / ``In Queue::...`` line a
few lines up. Also wgpu's own error kind, ``wgpu error: Out of Memory``, the debug print
``Device(OutOfMemory)`` in a wgpu report, and WebGPU's ``GPUOutOfMemoryError``. wgpu runs
on Vulkan, Metal, DirectX 12 or OpenGL, so the device type is left unknown: kind ``device``.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, line_start, spans

_OOM = re.compile(
    r"\bNot\s+enough\s+memory\s+left\b"
    r"|\bwgpu\s+error:\s+Out\s+of\s+Memory\b"
    r"|\b(?:Device|DeviceError)\((?:DeviceError::)?OutOfMemory\)"
    r"|\bGPUOutOfMemoryError\b"
)
# What makes the match wgpu's: its name, or its "In Device::create_buffer" context line.
_CONTEXT = re.compile(
    r"\bwgpu|\bwebgpu|^\s*In\s+(?:Device|Queue)::\w+", re.IGNORECASE | re.MULTILINE
)
# The call wgpu names: "In Device::create_buffer".
_CALL = re.compile(r"\bIn\s+(?P<call>(?:Device|Queue|CommandEncoder)::\w+)")
CONTEXT_CHARS = 400


def find(window: str) -> list[Found]:
    """The first wgpu out-of-memory in ``window`` (its error sink repeats the report)."""
    for span in spans(window, _OOM, limit=300, needs=("enough", "wgpu", "outofmemory")):
        low = max(0, span.start - CONTEXT_CHARS)
        if "GPUOutOfMemoryError" not in window[span.start : span.start + 20] and not (
            _CONTEXT.search(window, low, span.end)
        ):
            continue
        # The last "In Device::..." line before it names the call.
        calls = list(_CALL.finditer(window, low, span.start))
        call = calls[-1] if calls else None
        facts = OomFacts(
            kind="device",
            category="wgpu_out_of_memory",
            exception=exception_before(window, span.start),
            api_call=call["call"] if call else None,
            message=window[
                line_start(window, call.start()) if call else span.start : span.end
            ].strip()[:4000],
        )
        return [Found(span.start, facts)]
    return []
