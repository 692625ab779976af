"""OpenGL: the driver could not give the application the video memory it asked for.

* NVIDIA's OpenGL driver stops the program with a dialog: ``An application has requested
  more GPU memory than is available in the system. The application will now be closed.``
  then ``Error code: 6`` and ``(pid=93900 tid=38312 abuse.exe 64bit)``. It is NVIDIA's, so
  the device is an NVIDIA GPU, and its holders are listed by nvidia-smi.
* OpenGL's own error, ``GL_OUT_OF_MEMORY`` (0x0505), however the program prints it, and
  ``OpenGL error: out of memory``.

OpenGL has no kind of its own: kind ``device``, with categories that say which.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_NVIDIA_DIALOG = re.compile(
    r"(?:An\s+)?application\s+has\s+requested\s+more\s+GPU\s+memory\s+than\s+is\s+available"
    r"\s+in\s+the\s+system"
)
_GL = re.compile(r"\bGL_OUT_OF_MEMORY\b|\bOpenGL\s+(?:error:?\s+)?out\s+of\s+(?:video\s+)?memory")
# The dialog's last line: "(pid=93900 tid=38312 abuse.exe 64bit)".
_PID = re.compile(r"\(pid=(?P<pid>\d+)\s+tid=\d+")
DIALOG_CHARS = 400


def find(window: str) -> list[Found]:
    """The first NVIDIA dialog and the first OpenGL out-of-memory status in ``window``."""
    found = []
    for span in spans(window, _NVIDIA_DIALOG, limit=DIALOG_CHARS, needs=("requested",))[:1]:
        pid = _PID.search(window, span.start, span.end)
        facts = OomFacts(
            kind="device",
            category="nvidia_opengl_out_of_memory",
            exception=exception_before(window, span.start),
            device_type="cuda",
            pid=int(pid["pid"]) if pid else None,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    if found:
        return found
    for span in spans(window, _GL, limit=300, needs=("gl_out_of_memory", "opengl"))[:1]:
        begins = span.line_start
        facts = OomFacts(
            kind="device",
            category="opengl_out_of_memory",
            exception=exception_before(window, span.start),
            message=window[begins : span.end].strip()[:4000],
        )
        found.append(Found(begins, facts))
    return found
