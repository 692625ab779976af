"""``gpuwatch explain`` as a library call: OOM text in, :class:`Explanation` out.

The explanation is the JSON contract of ``gpuwatch explain --json`` and of the OOM
incidents ``gpuwatch.torch`` posts to the agent: sizes in bytes (``None`` when the
message does not say, or said something meaningless such as 2**64), the message's own
process list, ordered diagnoses with evidence, notes on every figure set aside or
derived, and what the local agent sees on that GPU right now.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from gpuwatch.doctor.diagnosis import Diagnosis, diagnose
from gpuwatch.doctor.facts import Kind, OomFacts
from gpuwatch.doctor.figures import read_figures
from gpuwatch.doctor.history import PastEvent
from gpuwatch.doctor.live import LiveGpu, LiveMatch, match_live_gpu
from gpuwatch.doctor.parse import parse_oom
from gpuwatch.snapshot import HostSnapshot


class OtherProcess(BaseModel):
    """A ``Process N has X memory in use`` entry of the message."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    used_bytes: int
    # True when it is judged to be this process seen under its host PID from inside a
    # container: its size matches PyTorch's own reserve, or the card could not hold it
    # beside that reserve (see figures.py).
    probably_this_process: bool = False


class Explanation(BaseModel):
    """What an OOM message means and what to do about it (``explain --json``)."""

    model_config = ConfigDict(extra="forbid")

    recognized: bool
    kind: Kind | None = None
    category: str | None = None
    exception: str | None = None
    device: str | None = None  # "cuda:0"
    device_type: str | None = None
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_in_use_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    allowed_bytes: int | None = None
    other_processes_bytes: int | None = None  # held by everything but this process
    other_processes: list[OtherProcess] = Field(default_factory=list)
    diagnoses: list[Diagnosis] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    # The central server's events on this GPU over the last hour (None: not asked or
    # no answer; see gpuwatch.doctor.history).
    history: list[PastEvent] | None = None
    live: LiveGpu | None = None  # the agent's view of that GPU now, if an agent answered
    # Why the live view is absent or is another local GPU than the message's index (the
    # message is from a card of another size: another machine, or CUDA_VISIBLE_DEVICES).
    live_note: str | None = None
    printed: OomFacts | None = None  # the message's figures exactly as printed

    @classmethod
    def not_recognized(cls) -> Explanation:
        """The answer for text that holds no OOM message."""
        return cls(recognized=False)


def explain(
    text: str,
    *,
    snapshot: HostSnapshot | None = None,
    growth: Sequence[int] | None = None,
    now: float | None = None,
) -> Explanation:
    """Parse ``text`` and diagnose its first OOM message.

    ``snapshot`` is the local agent's view (adds who is on that GPU now); ``growth``
    is this process's PyTorch allocated bytes per report, oldest first (enables the
    memory-held-across-steps diagnosis); ``now`` (epoch seconds) ages the live
    processes. Raises :class:`~gpuwatch.errors.NotRecognized` for non-OOM text.
    """
    return explain_facts(parse_oom(text), snapshot=snapshot, growth=growth, now=now)


def explain_facts(
    facts: OomFacts,
    *,
    snapshot: HostSnapshot | None = None,
    growth: Sequence[int] | None = None,
    now: float | None = None,
) -> Explanation:
    """:func:`explain` for an already parsed message."""
    figures = read_figures(facts)
    match = (
        match_live_gpu(
            snapshot,
            facts.device_index,
            total_bytes=figures.total,
            device_type=facts.device_type,
            now=now,
        )
        if snapshot is not None
        else LiveMatch(None)
    )
    live = match.gpu
    notes = figures.notes + ([match.note] if match.note else [])
    return Explanation(
        recognized=True,
        kind=facts.kind,
        category=facts.category,
        exception=facts.exception,
        device=facts.device,
        device_type=facts.device_type,
        requested_bytes=figures.requested,
        total_bytes=figures.total,
        free_bytes=figures.free,
        process_in_use_bytes=figures.this_process if figures.self_pid is None else None,
        allocated_bytes=figures.allocated,
        reserved_bytes=figures.reserved,
        reserved_unallocated_bytes=figures.reserved_unallocated,
        allowed_bytes=figures.limit,
        other_processes_bytes=figures.others_bytes,
        other_processes=[
            OtherProcess(
                pid=p.pid, used_bytes=p.used_bytes, probably_this_process=p.pid == figures.self_pid
            )
            for p in facts.other_processes
        ],
        diagnoses=diagnose(facts, figures, live=live, growth=growth),
        notes=notes,
        live=live,
        live_note=match.note,
        printed=facts,
    )
