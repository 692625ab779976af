"""The host page and the GPU page: memory over time stacked by process, with the
host's events marked on the same time axis, then who holds memory now and what
happened."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape as e
from urllib.parse import quote

from gpuwatch.server.events.schemas import EventOut
from gpuwatch.server.hosts.schemas import GpuOut, HostDetail
from gpuwatch.server.processes.schemas import ProcessOut
from gpuwatch.server.web.charts import Mark, memory_chart, user_colour
from gpuwatch.server.web.format import ago, duration, host_path, ratio, size, when
from gpuwatch.server.web.service import History
from gpuwatch.server.web.templates.events import events_table
from gpuwatch.server.web.templates.layout import (
    Chrome,
    cell_text,
    command_text,
    page,
    ranges,
    table,
    text,
)


def host_page(
    chrome: Chrome,
    host: HostDetail,
    charts: dict[str, History],
    events: Sequence[EventOut],
    *,
    range_key: str,
) -> str:
    """``charts`` by GPU UUID; ``events`` of the host in the range, newest first."""
    base = host_path(chrome.root, host.hostname)
    cards = []
    for gpu in host.gpus:
        history = charts.get(gpu.uuid)
        chart = (
            memory_chart(
                history,
                _marks(events, gpu.index),
                width=560,
                height=190,
                label=f"GPU {gpu.index} memory by process",
                now=chrome.now,
            )
            if history is not None
            else ""
        )
        href = host_path(chrome.root, host.hostname, gpu.index)
        cards.append(
            f'<section class="card gpu"><h2><a href="{href}">GPU {gpu.index}</a> '
            f"<small>{text(gpu.name or '')}</small></h2>{_gpu_line(chrome, host, gpu)}{chart}"
            "</section>"
        )
    # The host's largest holders: each GPU's are at most MAX_PROCESSES_SHOWN already.
    every = [p for gpu in host.gpus for p in gpu.processes]
    processes = sorted(every, key=_largest_first)[:HOST_TABLE_ROWS]
    total = sum(gpu.processes_total for gpu in host.gpus)
    stale = {gpu.uuid: _stale(host, gpu) for gpu in host.gpus}
    body = (
        f'<nav class="crumbs"><a href="{e(chrome.root)}/">Fleet</a> / {text(host.hostname)}'
        f"</nav><h1>{text(host.hostname)}{_state_badge(chrome, host)}</h1>"
        f"{_retired_notice(chrome, host)}{_host_line(chrome, host)}"
        f"{ranges(chrome, base, range_key)}"
        f'<div class="cards">{"".join(cards) or _no_gpus()}</div>'
        f"<h2>{_processes_heading(chrome, host)}</h2>"
        f"{_shown(chrome, host, len(processes), total)}"
        f"{process_table(chrome, processes, with_gpu=True, stale=stale)}"
        f"<h2>Events in the range</h2>{events_table(chrome, events, with_host=False)}"
    )
    return page(chrome, title=host.hostname, active="", body=body)


# Rows of the host page's process table: its largest holders, across its GPUs.
HOST_TABLE_ROWS = 100


def _largest_first(process: ProcessOut) -> tuple[int, int]:
    return (-(process.current_bytes if process.current_bytes is not None else -1), process.id)


def _shown(chrome: Chrome, host: HostDetail, shown: int, total: int, gpu: int | None = None) -> str:
    """Says when a table lists only the largest holders, and where the rest are."""
    if shown >= total:
        return ""
    query = f"host={quote(host.hostname, safe='')}&open=true" + (
        "" if gpu is None else f"&gpu={gpu}"
    )
    href = f"{chrome.root}/api/v1/processes?{query}"
    return (
        f'<p class="meta">The {shown} largest of {total} open processes; all of them:'
        f' <a href="{e(href)}">the processes API</a>.</p>'
    )


def gpu_page(
    chrome: Chrome,
    host: HostDetail,
    gpu: GpuOut,
    history: History,
    events: Sequence[EventOut],
    *,
    range_key: str,
) -> str:
    base = host_path(chrome.root, host.hostname, gpu.index)
    host_href = host_path(chrome.root, host.hostname)
    chart = memory_chart(
        history,
        _marks(events, gpu.index),
        width=1000,
        height=340,
        label=f"{host.hostname} GPU {gpu.index} memory by process",
        now=chrome.now,
    )
    gpu_events = [ev for ev in events if ev.gpu_index in (gpu.index, None)]
    stale = {gpu.uuid: _stale(host, gpu)}
    body = (
        f'<nav class="crumbs"><a href="{e(chrome.root)}/">Fleet</a> / '
        f'<a href="{host_href}">{text(host.hostname)}</a> / GPU {gpu.index}</nav>'
        f"<h1>{text(host.hostname)} · GPU {gpu.index} <small>{text(gpu.name or '')}</small>"
        f"{_state_badge(chrome, host)}</h1>{_retired_notice(chrome, host)}"
        f"{_gpu_line(chrome, host, gpu)}"
        f'<p class="meta">UUID <code>{text(gpu.uuid)}</code> · last reading '
        f"{ago(gpu.last_seen_at, chrome.now)}</p>"
        f'{ranges(chrome, base, range_key)}<section class="card wide">{chart}'
        f"{_legend(history)}</section>"
        f"<h2>{_processes_heading(chrome, host)}</h2>"
        f"{_shown(chrome, host, len(gpu.processes), gpu.processes_total, gpu.index)}"
        f"{process_table(chrome, gpu.processes, with_gpu=False, stale=stale)}"
        f"<h2>Events in the range</h2>{events_table(chrome, gpu_events, with_host=False)}"
    )
    return page(chrome, title=f"{host.hostname} GPU {gpu.index}", active="", body=body)


def _marks(events: Sequence[EventOut], gpu_index: int) -> list[Mark]:
    """The events drawn on one GPU's chart: its own and the host's (no GPU named)."""
    return [
        Mark(ev.kind, ev.started_at, ev.ended_at, ev.summary, ev.pid)
        for ev in events
        if ev.gpu_index in (gpu_index, None)
    ]


# An open orphaned event's reason -> what the flag adds to "orphaned".
ORPHAN_WORDS = {
    "dead_pid": "process gone",
    "job_ended": "job ended",
    "jupyter_server_gone": "notebook server gone",
    "reparented": "parent gone",
}


def _orphaned_flag(reason: str | None) -> str:
    """The flag of an orphaned process: its memory will not be freed by its owner, so
    it is never also called idle (orphaned takes precedence, as for events)."""
    words = ORPHAN_WORDS.get(reason or "")
    return f'<span class="kind orphaned">orphaned{": " + words if words else ""}</span>'


def _stale(host: HostDetail, gpu: GpuOut) -> str | None:
    """Why ``gpu`` has no current reading (its figures are its last known ones), or
    None when it has one."""
    if host.retired_at is not None:
        return "host retired"
    if gpu.lost:
        return "GPU lost"
    if host.silent:
        return "host silent"
    return None


def _processes_heading(chrome: Chrome, host: HostDetail) -> str:
    if host.silent or host.retired_at is not None:
        return f"Processes at the last report ({ago(host.last_received_at, chrome.now)})"
    return "Processes holding memory now"


def _gpu_line(chrome: Chrome, host: HostDetail, gpu: GpuOut) -> str:
    """The GPU's memory now; for a lost GPU or a silent host, said to be no current
    reading, with the last known figures named as such (the API keeps them)."""
    stale = _stale(host, gpu)
    state = ""
    if stale is not None:
        state = f'<span class="badge silent">no current reading: {stale}</span> last known: '
    elif gpu.read_error:
        state = f'<span class="badge silent">read error: {text(gpu.read_error)}</span> '
    users = sorted({p.user or "?" for p in gpu.processes})
    utilisation = "–" if gpu.utilization_ratio is None else f"{gpu.utilization_ratio:.0%}"
    # Users of the processes listed (the largest holders, when not all are).
    holders = (
        f"{gpu.processes_total} process{'' if gpu.processes_total == 1 else 'es'}"
        f"{': ' + ', '.join(text(u) for u in users) if users else ''}"
        f"{', …' if users and gpu.processes_truncated else ''}"
    )
    return (
        f'<p class="meta{" stale" if stale else ""}">{state}<b>{size(gpu.memory_used_bytes)}</b>'
        f" of {size(gpu.memory_total_bytes)} used"
        f" ({ratio(gpu.memory_used_bytes, gpu.memory_total_bytes)})"
        f" · unattributed {size(gpu.unattributed_bytes)} · utilisation {utilisation}"
        f" · {holders}</p>"
    )


def _host_line(chrome: Chrome, host: HostDetail) -> str:
    dropped = (
        f' · <span class="warn">{host.spool_dropped_total} snapshots dropped by its spool</span>'
        if host.spool_dropped_total
        else ""
    )
    return (
        f'<p class="meta">driver {text(host.driver_version or "–")} · CUDA '
        f"{text(host.cuda_driver_version or '–')} · agent <code>{text(host.agent_id or '–')}</code>"
        f" · last report {ago(host.last_received_at, chrome.now)}"
        f"{' · simulated GPUs' if host.fake else ''}{dropped}</p>"
    )


def _state_badge(chrome: Chrome, host: HostDetail) -> str:
    """ "retired" (with when) for a retired host, "silent" for a silent one."""
    if host.retired_at is not None:
        return (
            f' <span class="badge silent retired" title="{when(host.retired_at)}">'
            f"retired {ago(host.retired_at, chrome.now)}</span>"
        )
    return ' <span class="badge silent">silent</span>' if host.silent else ""


def _retired_notice(chrome: Chrome, host: HostDetail) -> str:
    """What retiring meant for a retired host's page (hosts/retire.py): its figures are
    those of its last report, not current ones."""
    if host.retired_at is None:
        return ""
    return (
        f'<p class="meta stale retired">Retired {when(host.retired_at)}'
        f" ({ago(host.retired_at, chrome.now)}): its tokens are revoked and it is no longer"
        " watched. The figures below are from its last report"
        f" ({ago(host.last_received_at, chrome.now)}), not current;"
        " a new token (<code>gpuwatch token create</code>) brings it back.</p>"
    )


def _no_gpus() -> str:
    return '<p class="empty">This host has not reported any GPU yet.</p>'


def _legend(history: History) -> str:
    rows = []
    for layer in history.layers:
        colour = "#bab0ac" if layer.lifetime_id is None else user_colour(layer.user)
        swatch = f'<svg width="12" height="12" aria-hidden="true"><rect width="12" height="12" fill="{colour}"/></svg>'
        if layer.lifetime_id is None:
            rows.append(
                [swatch, "", f"{layer.processes} smaller processes", size(layer.peak_bytes), ""]
            )
            continue
        rows.append(
            [
                swatch,
                str(layer.pid),
                cell_text(layer.user or "?"),
                size(layer.peak_bytes),
                command_text(layer.command),
            ]
        )
    return table(
        ["", "PID", "User", "Peak in range", "Command"],
        rows,
        empty="No process held memory on this GPU in this range.",
        css="legend-table",
    )


def process_table(
    chrome: Chrome,
    processes: Sequence[ProcessOut],
    *,
    with_gpu: bool,
    stale: dict[str, str | None] | None = None,
) -> str:
    """``stale``: GPU UUID -> why its processes' figures are not current (see
    :func:`_stale`); those rows say so and how long ago they were seen, and hold
    "for" until then, not until now."""
    rows = []
    for p in processes:
        flags = []
        why = (stale or {}).get(p.gpu_uuid)
        if why is not None:
            flags.append(
                f'<span class="kind stale">{why}: seen {ago(p.last_seen_at, chrome.now)}</span>'
            )
        held_until = chrome.now if why is None else p.last_seen_at
        if p.orphaned:
            flags.append(_orphaned_flag(p.orphan_reason))
        elif p.idle_seconds:
            flags.append(f'<span class="kind idle">idle {duration(p.idle_seconds)}</span>')
        job = p.slurm_job_id or p.pod_uid or p.container_id
        row = [
            str(p.pid),
            cell_text(p.user or "?"),
            size(p.current_bytes),
            size(p.peak_bytes),
            "–" if p.sm_ratio is None else f"{p.sm_ratio:.0%}",
            f'<span title="{when(p.first_seen_at)}">{duration(held_until - p.first_seen_at)}</span>',
            " ".join(flags),
            command_text(p.command),
            cell_text(job or ""),
        ]
        if with_gpu:
            href = host_path(chrome.root, p.hostname, p.gpu_index)
            row.insert(0, f'<a href="{href}">{p.gpu_index}</a>')
        rows.append(row)
    headers = ["PID", "User", "Memory", "Peak", "SM", "Holding for", "Flags", "Command", "Job"]
    if with_gpu:
        headers.insert(0, "GPU")
    return table(headers, rows, empty="No process holds memory now.", css="processes")
