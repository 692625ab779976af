"""NVENC, NVIDIA's hardware video encoder: a call returned ``NV_ENC_ERR_OUT_OF_MEMORY`` (10).

The encoder's status 10 says it "was unable to allocate enough memory to perform the
requested operation". Programs print it in their own ways:

* FFmpeg (``h264_nvenc``, ``hevc_nvenc``, ``av1_nvenc``): ``[h264_nvenc @ 0x55d...]
  OpenEncodeSessionEx failed: out of memory (10): (no details)``, and the same for any
  other call it reports (``InitializeEncoder failed: out of memory (10)``).
* NVEncC: ``Error on nvEncOpenEncodeSessionEx: 10 (NVENC indicates that the API call failed
  because it was unable to allocate enough memory ...)``; the Video Codec SDK's NvEncoder:
  ``m_nvenc.nvEncOpenEncodeSessionEx(&params, &hEncoder) returned error 10``.
* The status by name (OBS, Sunshine, GStreamer, the SDK's samples): ``NV_ENC_ERR_OUT_OF_MEMORY``.

It is not always memory. On GeForce (and some workstation) cards the driver caps how many
encode sessions may be open at once, and opening one more fails with this same status:
the remedy then is to count the sessions (other encoders, OBS, ShadowPlay, a second
transcode), not to free video memory. Other NVENC statuses (no encode device, 1;
unsupported device, 2; invalid parameter, 8; invalid version, 15; ...) are other errors
and are not read.
"""

from __future__ import annotations

import itertools
import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import (
    Found,
    exception_before,
    line_end,
    line_start,
    mentions,
)

_STATUS = re.compile(
    # The status by name.
    r"\bNV_ENC_ERR_OUT_OF_MEMORY\b"
    # FFmpeg's nvenc_print_error: "<what failed>: out of memory (10)", where <what failed>
    # is "OpenEncodeSessionEx failed", "InitializeEncoder failed", ... (FFmpeg's own text
    # for status 10, the number after it). Only on the encoder's line: see _NVENC_LINE.
    r"|(?P<ffmpeg>(?:(?P<ffcall>[A-Z]\w{2,60})\s+failed)?:\s*out\s+of\s+memory\s*\(10\))"
    # An NVENC API call with the number after it: NVEncC's "nvEncOpenEncodeSessionEx: 10 (",
    # "NvEncOpenEncodeSessionEx(device_type=NV_ENC_DEVICE_TYPE_CUDA): 10", the SDK's
    # "nvEncOpenEncodeSessionEx(&params, &hEncoder) returned error 10", "... failed: 10".
    # A separator or a word must come before the number ("nvEncEncodePicture 10 frames" is
    # not a status), and only 10: the API's other statuses are other errors.
    r"|(?<![\w.])(?:m_nvenc\.)?(?P<call>[Nn]v[Ee]nc[A-Z]\w{2,60})(?:\([^()\n]{0,160}\))?"
    r"(?:\s*[:=]|\s+returned\s+error[:=]?|\s+failed(?:\s+with\s+(?:error|status))?[:=]?"
    r"|\s+status[:=]?)\s*10\b(?![\d.])"
    # NVEncC's words for the status, which name the encoder.
    r"|NVENC\s+indicates\s+that\s+the\s+API\s+call\s+failed\s+because\s+it\s+was\s+unable\s+to"
    r"\s+allocate\s+enough\s+memory"
)
# FFmpeg's line names the encoder ("[hevc_nvenc @ 0x...]"): "...: out of memory (10)" from
# anything else is not NVENC's, unless the call that failed is one of the encoder API's
# (a title or a paste that dropped the "[h264_nvenc @ ...]" prefix).
_NVENC_LINE = re.compile(r"nvenc", re.IGNORECASE)
_API_CALLS = frozenset(
    name.lower()
    for name in (
        "OpenEncodeSession", "OpenEncodeSessionEx", "InitializeEncoder", "ReconfigureEncoder",
        "CreateBitstreamBuffer", "CreateInputBuffer", "CreateMVBuffer", "RegisterResource",
        "MapInputResource", "EncodePicture", "LockBitstream", "LockInputBuffer",
        "GetEncodeCaps", "GetEncodePresetConfig", "GetEncodePresetConfigEx", "GetSequenceParams",
    )
)  # fmt: skip
# What may come before the call on its line: a list marker or a quote, not a sentence.
_LINE_HEAD = re.compile(r"\W{0,4}")
# Matches looked at before giving up: each costs a look along its line.
MAX_TRIES = 16


def find(window: str) -> list[Found]:
    """The first NVENC out-of-memory status in ``window`` (programs print one failure on
    several lines: NVEncC three times)."""
    if not mentions(window, ("nvenc", "nv_enc", "(10)")):
        return []
    for match in itertools.islice(_STATUS.finditer(window), MAX_TRIES):
        begins = line_start(window, match.start())
        line = window[begins : line_end(window, match.end())]
        if match["ffmpeg"] and not _NVENC_LINE.search(line) and not _api_call(match, line, begins):
            continue  # "...: out of memory (10)" from something other than the encoder
        facts = OomFacts(
            kind="nvenc",
            category="nvenc_out_of_memory",
            exception=exception_before(window, begins),
            device_type="cuda",
            cuda_error="NV_ENC_ERR_OUT_OF_MEMORY",
            cuda_error_code=10,
            api_call=_call(match),
            message=line.strip()[:4000],
        )
        return [Found(begins, facts)]
    return []


def _api_call(match: re.Match[str], line: str, begins: int) -> bool:
    """Whether FFmpeg's failed call is one of the NVENC API's, by its name, and starts its
    line (a title, or a log line that lost its prefix; one quoted inside a sentence is
    talk about the error)."""
    call = match["ffcall"]
    if call is None or call.lower().removeprefix("nvenc") not in _API_CALLS:
        return False
    return _LINE_HEAD.fullmatch(line[: match.start("ffcall") - begins]) is not None


def _call(match: re.Match[str]) -> str | None:
    """The NVENC call that failed, by its API name where the text gives it."""
    call = match["call"] or match["ffcall"]
    if call is None:
        return None
    # FFmpeg drops the API's "nvEnc" prefix ("OpenEncodeSessionEx"); the API has it.
    return call if call.lower().startswith("nvenc") else f"nvEnc{call}"
