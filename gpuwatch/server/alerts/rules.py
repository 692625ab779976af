"""The shipped rules: pure functions from :class:`Facts` to the alerts whose condition
holds now (:class:`Candidate`). The life cycle (``for``, ``keep_firing_for``) is not
here; :mod:`lifecycle` applies it.

Labels identify an alert: ``rule``, ``severity``, ``hostname``, ``gpu``, and for alerts
about one process ``pid``, ``user`` and ``team`` (from the user-to-team map). The
culprits, the figures and the text are not labels: they change while the alert fires.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpuwatch.containers import shown_container_id
from gpuwatch.detectors._format import format_bytes, format_seconds
from gpuwatch.server.alerts.config import (
    AlertSettings,
    FillingUpRule,
    HeldRule,
    ThrottleRule,
    XidRule,
)
from gpuwatch.server.alerts.facts import EventFact, Facts, GpuFact, GpuHealth, Holder
from gpuwatch.server.notifications.model import Culprit
from gpuwatch.server.notifications.receivers.text import short_name, shorten
from gpuwatch.terminal_text import printable


@dataclass(frozen=True)
class Candidate:
    """An alert whose condition holds at this evaluation."""

    rule: str
    severity: str
    labels: dict[str, str]
    summary: str
    description: str = ""
    culprits: list[Culprit] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The summary is one line, whatever an event's text held: an OOM message, a
        # command line, a container name come from ordinary users, and a newline in
        # one forged whole lines of a Slack alert (a fake alert, culprits on another
        # host). The description's lines are made so where they are built.
        object.__setattr__(self, "summary", printable(self.summary))  # frozen

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)


# What a summary predicts ("fills up in about 2 min", "full in 4 min at this rate"):
# said again in the resolved notification it read as if the GPU were still filling.
_PREDICTIONS = (
    (re.compile(r" is (\d+% full) and fills up in about [^;]*"), r" was \1 and filling up"),
    (re.compile(r"; the GPU is full in[^;]* at this rate"), ""),
)


def resolved_summary(summary: str) -> str:
    """``summary`` as a resolved alert keeps it: its predictions of when the GPU is
    full dropped, in the past tense where the sentence needs it."""
    for pattern, replacement in _PREDICTIONS:
        summary = pattern.sub(replacement, summary)
    return summary


def fingerprint(labels: dict[str, str]) -> str:
    """A stable id of an alert: the hash of its sorted labels (``rule`` included)."""
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:32]


def evaluate(facts: Facts, settings: AlertSettings, *, now: float) -> list[Candidate]:
    """Every enabled rule over ``facts``; each candidate once (by fingerprint)."""
    found: dict[str, Candidate] = {}
    for name, rule in _RULES.items():
        config = getattr(settings.rules, name)
        if not config.enabled:
            continue
        for candidate in rule(facts, settings, name, now):
            found.setdefault(candidate.fingerprint, candidate)
    return list(found.values())


def _labels(
    settings: AlertSettings, rule: str, hostname: str, gpu: int | None, **extra: object
) -> dict[str, str]:
    severity = getattr(settings.rules, rule).severity
    labels = {"rule": rule, "severity": severity, "hostname": hostname}
    if gpu is not None:
        labels["gpu"] = str(gpu)
    for key, value in extra.items():
        if value is not None:
            labels[key] = str(value)
    user = labels.get("user")
    if user is not None and user in settings.teams:
        labels["team"] = settings.teams[user]
    return labels


def culprit(holder: Holder, slope: float | None = None) -> Culprit:
    return Culprit(
        pid=holder.pid,
        user=holder.user,
        command=holder.command,
        memory_bytes=holder.memory_bytes,
        container_id=holder.container_id,
        pod_uid=holder.pod_uid,
        slurm_job_id=holder.slurm_job_id,
        slope_bytes_per_second=slope,
    )


def growth_rate(slope: float | None) -> float | None:
    """A culprit's growth rate as receivers may show it: only a floor that rose. A
    process that grew the GPU by arriving (a new worker at its full size) has a flat
    floor, slope 0: shown as "+0 B/min" under "growing" it read as a made-up figure."""
    return slope if slope is not None and slope > 0 else None


# Characters of a culprit's command in a description, as the dashboard's tables show a
# command (docs/dashboard.md); the whole command stays the culprit's own.
DESCRIBED_COMMAND_CHARS = 120


def describe(c: Culprit) -> str:
    """``alice's pid 4242 (python train.py, pod 1a2b) holds 20.0 GiB, +1.0 GiB/min``:
    one line, its user-given parts with control and bidi characters escaped, and the
    command cut (a 3,000-character command filled screens of the alerts page)."""
    where = [shorten(c.command or "?", DESCRIBED_COMMAND_CHARS)]
    if c.container_id:
        where.append(f"container {short_name(shown_container_id(c.container_id), '?')}")
    if c.pod_uid:
        where.append(f"pod {short_name(c.pod_uid, '?')}")
    if c.slurm_job_id:
        where.append(f"Slurm job {short_name(c.slurm_job_id, '?')}")
    text = f"{short_name(c.user, 'unknown user')}'s pid {c.pid} ({', '.join(where)})"
    if c.memory_bytes is not None:
        text += f" holds {format_bytes(c.memory_bytes)}"
    rate = growth_rate(c.slope_bytes_per_second)
    if rate is not None:
        text += f", +{format_bytes(rate * 60)}/min"
    return text


def _filling_up(
    facts: Facts, settings: AlertSettings, name: str, now: float
) -> Iterator[Candidate]:
    rule: FillingUpRule = getattr(settings.rules, name)
    gpus = {(g.hostname, g.gpu): g for g in facts.gpus}
    for event in facts.events:
        if event.kind != "filling_up" or event.gpu is None:
            continue
        gpu = gpus.get((event.hostname, event.gpu))
        ttf = event.evidence.get("time_to_full_seconds")
        ratio = None if gpu is None else gpu.used_ratio
        if gpu is None or ratio is None or not isinstance(ttf, int | float):
            continue
        if 1 - ratio >= rule.free_ratio or ttf > rule.within_seconds:
            continue
        culprits = [
            _filling_culprit(raw, gpu, event.seen_at) for raw in event.evidence.get("culprits", [])
        ]
        top = f"; growing: {describe(culprits[0])}" if culprits else ""
        yield Candidate(
            rule=name,
            severity=rule.severity,
            labels=_labels(settings, name, event.hostname, event.gpu),
            summary=(
                f"GPU {event.gpu} on {event.hostname} is {ratio:.0%} full and fills up "
                f"in about {format_seconds(ttf)}{top}"
            ),
            description="\n".join(describe(c) for c in culprits),
            culprits=culprits,
        )


def _filling_culprit(raw: dict[str, object], gpu: GpuFact, taken_at: float | None) -> Culprit:
    """The culprit the evidence names (taken at ``taken_at``), with its holder's current
    memory when that holder is the same process: a PID alone is not, once the grower
    exits and the kernel hands its PID to another process before the next bucket close
    recomputes the evidence (the new one took the blame, with the old one's rate)."""
    pid = int(raw["pid"])  # type: ignore[call-overload]
    slope = raw.get("slope_bytes_per_second")
    rate = growth_rate(float(slope) if isinstance(slope, int | float) else None)
    holder = next((h for h in gpu.holders if _same_process(raw, h, taken_at)), None)
    if holder is not None:
        return culprit(holder, rate)

    def text(name: str) -> str | None:
        value = raw.get(name)
        return value if isinstance(value, str) else None

    memory = raw.get("memory_bytes")
    return Culprit(
        pid=pid,
        user=text("user"),
        command=text("command"),
        memory_bytes=memory if isinstance(memory, int) else None,
        container_id=text("container_id"),
        pod_uid=text("pod_uid"),
        slurm_job_id=text("slurm_job_id"),
        slope_bytes_per_second=rate,
    )


def _same_process(raw: dict[str, object], holder: Holder, taken_at: float | None) -> bool:
    """Whether ``holder`` is the process an evidence culprit names: its lifetime where
    the evidence carries one; else its PID, a lifetime that had begun when the evidence
    was taken (a process first seen later cannot be what grew before), and no owner or
    command other than the one the evidence recorded."""
    lifetime_id = raw.get("lifetime_id")
    if isinstance(lifetime_id, int) and holder.lifetime_id is not None:
        return holder.lifetime_id == lifetime_id
    if holder.pid != raw.get("pid"):
        return False
    begun = holder.first_seen_at
    if taken_at is not None and begun is not None and begun > taken_at:
        return False
    recorded = ((raw.get("user"), holder.user), (raw.get("command"), holder.command))
    return not any(
        isinstance(then, str) and now is not None and then != now for then, now in recorded
    )


def _nearly_full(
    facts: Facts, settings: AlertSettings, name: str, now: float
) -> Iterator[Candidate]:
    rule = settings.rules.gpu_nearly_full
    for gpu in facts.gpus:
        ratio = gpu.used_ratio
        if ratio is None or ratio < rule.used_ratio or gpu.lowest_recent_bytes is None:
            continue
        assert gpu.total_bytes  # used_ratio is known
        was = gpu.lowest_recent_bytes / gpu.total_bytes
        if ratio - was < rule.jump_ratio:
            continue  # full and flat: nothing changed that anyone needs to hear about
        culprits = [culprit(h) for h in gpu.holders[:3]]
        top = f"; largest: {describe(culprits[0])}" if culprits else ""
        yield Candidate(
            rule=name,
            severity=rule.severity,
            labels=_labels(settings, name, gpu.hostname, gpu.gpu),
            summary=(
                f"GPU {gpu.gpu} on {gpu.hostname} jumped to {ratio:.0%} full "
                f"(from {was:.0%} within {format_seconds(rule.jump_within_seconds)}){top}"
            ),
            description="\n".join(describe(c) for c in culprits),
            culprits=culprits,
        )


def _held(kind: str, contended_only: bool) -> Callable[..., Iterator[Candidate]]:
    """Rules over per-process events held long enough (orphaned, idle)."""

    def rule_fn(
        facts: Facts, settings: AlertSettings, name: str, now: float
    ) -> Iterator[Candidate]:
        rule: HeldRule = getattr(settings.rules, name)
        gpus = {(g.hostname, g.gpu): g for g in facts.gpus}
        for event in facts.events:
            if event.kind != kind or now - event.started_at < rule.held_for_seconds:
                continue
            if (event.held_bytes or 0) < rule.min_memory_bytes:
                continue
            gpu = gpus.get((event.hostname, event.gpu)) if event.gpu is not None else None
            if contended_only and not _contended(event, gpu, settings):
                continue
            yield _event_candidate(event, settings, name, now)

    return rule_fn


def _contended(event: EventFact, gpu: GpuFact | None, settings: AlertSettings) -> bool:
    """Others need this GPU: it is fuller than the rule's share, or another user has
    a process on it."""
    if gpu is None:
        return False
    ratio = gpu.used_ratio
    if ratio is not None and ratio >= settings.rules.idle_holder.contended_ratio:
        return True
    return any(h.user is not None and h.user != event.user for h in gpu.holders)


def _event_candidate(event: EventFact, settings: AlertSettings, name: str, now: float) -> Candidate:
    culprits = [] if event.holder is None else [culprit(event.holder)]
    held_for = format_seconds(now - event.started_at)
    where = f"GPU {event.gpu} on {event.hostname}" if event.gpu is not None else event.hostname
    return Candidate(
        rule=name,
        severity=getattr(settings.rules, name).severity,
        labels=_labels(settings, name, event.hostname, event.gpu, pid=event.pid, user=event.user),
        summary=f"{where}: {event.summary} (for {held_for})",
        description="\n".join(describe(c) for c in culprits),
        culprits=culprits,
    )


def _open_event(kind: str) -> Callable[..., Iterator[Candidate]]:
    """Rules that alert while an event of ``kind`` is open (runaway, lost, silent)."""

    def rule_fn(
        facts: Facts, settings: AlertSettings, name: str, now: float
    ) -> Iterator[Candidate]:
        for event in facts.events:
            if event.kind == kind:
                yield _event_candidate(event, settings, name, now)

    return rule_fn


def _reaped(facts: Facts, settings: AlertSettings, name: str, now: float) -> Iterator[Candidate]:
    """Each recent ``reaped`` event of an announced stage: the owner and the channel
    hear of a warning before the stop, of a warning withdrawn, and of the stop."""
    rule = settings.rules.process_reaped
    for event in facts.reaped:
        stage = str(event.evidence.get("stage", "stopped"))
        age = now - event.started_at
        # A negative age is an event dated ahead of this clock (stored before events were
        # bounded, or a skewed agent): it would never age out, so it is not announced.
        if stage not in rule.stages or not 0 <= age < rule.announce_for_seconds:
            continue
        yield Candidate(
            rule=name,
            severity=rule.severity,
            labels=_labels(
                settings,
                name,
                event.hostname,
                event.gpu,
                pid=event.pid,
                user=event.user,
                stage=stage,
            ),
            summary=event.summary,
            description=printable(str(event.evidence.get("detail") or "")),
        )


def _job_ended(facts: Facts, settings: AlertSettings, name: str, now: float) -> Iterator[Candidate]:
    rule = settings.rules.job_ended
    gpus = {(g.hostname, g.gpu): g for g in facts.gpus}
    for ended in facts.ended:
        user = ended.holder.user
        wanted = user in rule.users or settings.teams.get(user or "") in rule.teams
        if not wanted or not ended.busy or now - ended.ended_at >= rule.announce_for_seconds:
            continue
        if (ended.peak_bytes or 0) < rule.min_memory_bytes:
            continue
        gpu = gpus.get((ended.hostname, ended.gpu))
        stranded = None if gpu is None else gpu.unattributed_bytes
        freed = (
            "its memory was freed"
            if stranded is not None and stranded < rule.min_memory_bytes
            else "its memory may not have been freed"
        )
        ran = format_seconds(ended.ended_at - ended.first_seen_at)
        yield Candidate(
            rule=name,
            severity=rule.severity,
            labels=_labels(
                settings, name, ended.hostname, ended.gpu, pid=ended.holder.pid, user=user
            ),
            summary=(
                f"pid {ended.holder.pid} ({shorten(ended.holder.command or '?', DESCRIBED_COMMAND_CHARS)})"
                f" on GPU {ended.gpu} of "
                f"{ended.hostname} ended after {ran}, peak {format_bytes(ended.peak_bytes or 0)}; "
                f"{freed}"
            ),
            culprits=[culprit(ended.holder)],
        )


def _health(facts: Facts, settings: AlertSettings, name: str, now: float) -> Iterator[Candidate]:
    """GPU health rules: one finding per GPU whose latest readings show the problem."""
    rule = getattr(settings.rules, name)
    for gpu in facts.gpus:
        if gpu.health is None or not gpu.current:
            continue
        problem = _HEALTH_CHECKS[name](gpu.health, rule, now)
        if problem is None:
            continue
        yield Candidate(
            rule=name,
            severity=rule.severity,
            labels=_labels(settings, name, gpu.hostname, gpu.gpu),
            summary=f"GPU {gpu.gpu} on {gpu.hostname}: {problem}",
            culprits=[culprit(h) for h in gpu.holders[:3]],
        )


def _ecc(health: GpuHealth, rule: object, now: float) -> str | None:
    count = health.ecc_uncorrected_volatile
    if not count:
        return None
    return f"{count} uncorrected ECC error(s) since the driver loaded; drain it and reset the GPU"


def _xid(health: GpuHealth, rule: XidRule, now: float) -> str | None:
    if health.xid_seen_at is None or now - health.xid_seen_at > rule.within_seconds:
        return None
    code = "" if health.xid_last_code is None else f" (last: Xid {health.xid_last_code})"
    return f"new Xid error{code} {format_seconds(now - health.xid_seen_at)} ago"


def _throttled(health: GpuHealth, rule: ThrottleRule, now: float) -> str | None:
    slowed = sorted(health.throttle_reasons & set(rule.reasons))
    return None if not slowed else "slowed down: " + ", ".join(slowed)


def _repair(health: GpuHealth, rule: object, now: float) -> str | None:
    if health.remap_failure:
        return "a row remapping failed: the GPU needs service"
    if health.remap_pending:
        return "memory rows wait to be remapped: reset the GPU when it is free"
    return None


_HEALTH_CHECKS: dict[str, Callable[..., str | None]] = {
    "gpu_ecc_uncorrected": _ecc,
    "gpu_xid": _xid,
    "gpu_throttled": _throttled,
    "gpu_memory_repair": _repair,
}


_RULES: dict[str, Callable[[Facts, AlertSettings, str, float], Iterator[Candidate]]] = {
    "gpu_filling_up_critical": _filling_up,
    "gpu_filling_up_warning": _filling_up,
    "gpu_nearly_full": _nearly_full,
    "orphaned_memory": _held("orphaned", contended_only=False),
    "idle_holder": _held("idle", contended_only=True),
    "runaway_process": _open_event("runaway"),
    "gpu_lost": _open_event("gpu_lost"),
    "gpu_ecc_uncorrected": _health,
    "gpu_xid": _health,
    "gpu_throttled": _health,
    "gpu_memory_repair": _health,
    "agent_silent": _open_event("agent_silent"),
    "process_reaped": _reaped,
    "job_ended": _job_ended,
}
