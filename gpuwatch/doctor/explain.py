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

from gpuwatch.doctor.diagnosis import FREE_COVER_MARGIN_BYTES, Diagnosis, diagnose
from gpuwatch.doctor.facts import Kind, OomFacts
from gpuwatch.doctor.figures import Figures, read_figures
from gpuwatch.doctor.history import PastEvent
from gpuwatch.doctor.live import (
    LiveGpu,
    LiveMatch,
    MessageProcesses,
    match_live_gpu,
    relate_to_message,
    room_now,
    same_host,
)
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
    match = _live_match(facts, figures, snapshot, now)
    live = match.gpu
    notes = figures.notes + ([match.note] if match.note else [])
    if live is not None:
        live = relate_to_message(live, _message_processes(facts, figures))
        room = room_now(live, figures.requested, margin=FREE_COVER_MARGIN_BYTES)
        notes += [room] if room else []
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
                pid=p.pid,
                used_bytes=p.used_bytes,
                probably_this_process=p.pid in figures.self_candidates,
            )
            for p in facts.other_processes
        ],
        diagnoses=diagnose(facts, figures, live=live, growth=growth),
        notes=notes,
        live=live,
        live_note=match.note,
        printed=facts,
    )


def _live_match(
    facts: OomFacts, figures: Figures, snapshot: HostSnapshot | None, now: float | None
) -> LiveMatch:
    """The local GPU the message is about, unless the message names another host."""
    if snapshot is None:
        return LiveMatch(None)
    if facts.host is not None and not same_host(facts.host, snapshot.hostname):
        # Its GPUs are not this host's: this host's holders are nobody's answer.
        return LiveMatch(None, other_host_note(facts.host, snapshot.hostname))
    return match_live_gpu(
        snapshot,
        facts.device_index,
        total_bytes=figures.total,
        device_type=facts.device_type,
        now=now,
    )


def other_host_note(message_host: str, hostname: str) -> str:
    """Why nothing of this host (live view, server history) is attached."""
    return (
        f"the message is from {message_host}; this agent is on {hostname}: live context and "
        f"server history not attached (run gpuwatch explain on {message_host})"
    )


def _message_processes(facts: OomFacts, figures: Figures) -> MessageProcesses:
    ours = set(figures.self_candidates)
    if facts.pid is not None:
        ours.add(facts.pid)  # NCCL's prefix names the process that printed it
    return MessageProcesses(
        listed=tuple(p.pid for p in facts.other_processes),
        this_process_pids=frozenset(ours),
        this_process_bytes=figures.this_process,
        reserved_bytes=figures.reserved,
    )
