"""What ``gpuwatch demo`` shows while it runs: the server's view, read through its API.

:class:`Watch` reads ``/api/v1/hosts/{host}``, ``/api/v1/events`` and ``/api/v1/alerts``
(what a user of the server sees) and the demo's webhook sink, and remembers when each
event, firing alert and notification was first seen. :func:`render` draws that as a
rich table for the terminal; :meth:`Watch.refresh` also returns one JSON line per new
finding for ``--json``.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from gpuwatch.cli.demo_sink import Notification, WebhookSink

KINDS = ("orphaned", "idle", "runaway", "filling_up")
GIB = 2**30
_SHOWN_LINES = 8


@dataclass
class Seen:
    """What the demo has seen so far; ``at`` values are seconds since the demo started."""

    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    found: dict[int, float] = field(default_factory=dict)  # event id -> first seen
    fired: dict[int, float] = field(default_factory=dict)  # alert id -> first seen firing
    notifications: list[Notification] = field(default_factory=list)


class Watch:
    def __init__(self, server_url: str, sink: WebhookSink, hostnames: list[str], started: float):
        self.client = httpx.Client(base_url=server_url, timeout=5.0)
        self.sink = sink
        self.hostnames = hostnames
        self.started = started
        self.seen = Seen()

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str, **params: Any) -> Any:
        """The JSON answer, or None when the server does not give one (busy, stopping,
        or 404 for a host that has not pushed yet): the last view then stays."""
        try:
            response = self.client.get(path, params=params)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError):
            return None

    def refresh(self) -> list[dict[str, Any]]:
        """Read the server and the sink once; returns a JSON line for each new thing."""
        seen, now = self.seen, time.time() - self.started
        lines: list[dict[str, Any]] = []
        for name in self.hostnames:
            host = self._get(f"/api/v1/hosts/{quote(name, safe='')}")
            if host is not None:
                seen.hosts[name] = host
        events = self._get("/api/v1/events", limit=500)
        if events is not None:
            seen.events = events["items"]
        alerts = self._get("/api/v1/alerts", state="active")
        if alerts is not None:
            seen.alerts = alerts
        for event in sorted(seen.events, key=lambda e: e["id"]):
            if event["id"] not in seen.found:
                seen.found[event["id"]] = now
                host = seen.hosts.get(event["hostname"])
                lines.append({"event": "found", "at": round(now, 1), **_event_line(event, host)})
        for alert in seen.alerts:
            if alert["state"] == "firing" and alert["id"] not in seen.fired:
                seen.fired[alert["id"]] = now
                lines.append(
                    {
                        "event": "alert",
                        "at": round(now, 1),
                        "rule": alert["rule"],
                        "labels": alert["labels"],
                        "summary": alert["summary"],
                    }
                )
        received = self.sink.received()
        for notification in received[len(seen.notifications) :]:
            at = round(notification.received_at - self.started, 1)
            lines.append({"event": "notification", "at": at, **notification.to_json()})
        seen.notifications = received
        return lines

    def totals(self) -> dict[str, Any]:
        """Counts for the final JSON line and the closing printout."""
        seen = self.seen
        open_events = [e for e in seen.events if e["open"]]
        return {
            "hosts": len(seen.hosts),
            "open_events": {k: sum(e["kind"] == k for e in open_events) for k in KINDS},
            "events_seen": len(seen.found),
            "alerts_firing": sorted({a["rule"] for a in seen.alerts if a["state"] == "firing"}),
            "notifications_received": len(seen.notifications),
            "notifications_rejected": self.sink.rejected,
            "reaped": sum(e["kind"] == "reaped" for e in seen.events),
        }


def _event_line(event: dict[str, Any], host: dict[str, Any] | None) -> dict[str, Any]:
    keys = ("id", "kind", "reason", "hostname", "gpu_index", "pid", "user", "summary", "open")
    return {**{k: event.get(k) for k in keys}, "command": command_of(host, event.get("pid"))}


def command_of(host: dict[str, Any] | None, pid: int | None) -> str | None:
    """The command line of process ``pid`` in ``host``'s last view, None when it is not
    there (a dead PID, memory nobody accounts for, a host event): the demo exists to
    show *who* holds the memory, and an event carries the user but not the command."""
    if host is None or pid is None:
        return None
    for gpu in host.get("gpus") or ():
        for process in gpu.get("processes") or ():
            if process.get("pid") == pid:
                return process.get("command") or process.get("name")
    return None


def who(user: str | None, command: str | None, limit: int = 48) -> str:
    """``alice (python -m ipykernel_launcher …): `` for a line about a process; empty
    when neither is known."""
    said = " ".join(filter(None, [user, f"({_short(command, limit)})" if command else None]))
    return f"{said}: " if said else ""


def _short(text: str, limit: int = 96) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def _hosts_table(seen: Seen, stories: dict[str, str] | None) -> Table:
    """One row per host; ``stories`` None leaves out what each shows (a narrow terminal)."""
    table = Table(title="Hosts (simulated)", title_justify="left", expand=False)
    shows = ("shows",) if stories is not None else ()
    for column in ("host", *shows, "GPUs", "memory used", "users", *KINDS, "alerts"):
        # One line a host: a wrapped users list took three rows a host at 80 columns.
        table.add_column(
            column,
            justify="right" if column in KINDS else "left",
            no_wrap=column in ("host", "GPUs", "memory used", "users"),
            overflow="ellipsis",
        )
    open_events = [e for e in seen.events if e["open"]]
    firing = [a for a in seen.alerts if a["state"] == "firing"]
    names = stories if stories is not None else {name: "" for name in seen.hosts}
    for name, story in names.items():
        host = seen.hosts.get(name)
        gpus = host["gpus"] if host else []
        used = sum(g["memory_used_bytes"] or 0 for g in gpus)
        total = sum(g["memory_total_bytes"] or 0 for g in gpus)
        users = sorted({p["user"] for g in gpus for p in g["processes"] if p["user"]})
        counts = [sum(e["hostname"] == name and e["kind"] == k for e in open_events) for k in KINDS]
        alerts = sum(a["labels"].get("hostname") == name for a in firing)
        table.add_row(
            name,
            *((story,) if stories is not None else ()),
            str(len(gpus)) if host else "-",
            f"{used / GIB:.0f} / {total / GIB:.0f} GiB" if total else "-",
            ", ".join(users) or "-",
            *(Text(str(c), style="bold red" if c else "dim") for c in counts),
            Text(str(alerts), style="bold red" if alerts else "dim"),
        )
    return table


def _found_lines(seen: Seen, shown: int = _SHOWN_LINES) -> Text:
    # One row a line, cut at the terminal's width: a wrapped line took the rows the
    # view had counted for the newest ones, and an 80 x 24 terminal lost the webhook's.
    text = Text("Found\n", style="bold", no_wrap=True, overflow="ellipsis")
    by_id = {e["id"]: e for e in seen.events}
    recent = sorted(seen.found.items(), key=lambda item: item[1])[-shown:]
    for event_id, at in recent:
        e = by_id.get(event_id)
        if e is None:
            continue
        where = e["hostname"] + (f" GPU {e['gpu_index']}" if e["gpu_index"] is not None else "")
        state = "" if e["open"] else "  (ended)"
        verdict = f"{e['kind']}/{e['reason']}"
        whose = who(e.get("user"), command_of(seen.hosts.get(e["hostname"]), e.get("pid")), 32)
        text.append(f"  +{_clock(at)}  {where:<12} {verdict:<22} ", style="cyan")
        text.append(f"{whose}{_short(e['summary'])}{state}\n")
    if not recent:
        text.append("  nothing yet: agents push every few seconds\n", style="dim")
    return text


def _sent_lines(seen: Seen, started: float, rejected: int, shown: int = _SHOWN_LINES) -> Text:
    text = Text(
        "Sent to the webhook (signature checked)\n", style="bold", no_wrap=True, overflow="ellipsis"
    )
    for n in seen.notifications[-shown:]:
        rules = ", ".join(sorted({rule for rule, _, _ in n.alerts}))
        first = n.alerts[0][2] if n.alerts else ""
        more = f" (+{len(n.alerts) - 1} more)" if len(n.alerts) > 1 else ""
        text.append(f"  +{_clock(n.received_at - started)}  {n.status:<9}", style="magenta")
        text.append(f"{rules}: {_short(first)}{more}\n")
    if not seen.notifications:
        text.append("  nothing yet: alerts wait for their rule's `for`, then group_wait\n", "dim")
    if rejected:
        text.append(f"  {rejected} request(s) refused: bad signature\n", style="red")
    return text


# Rows of the live view besides the header, the hosts table (measured: its rows wrap at
# 80 columns, a host's users list the most) and the found and sent lines: the two
# section titles, a line of each section in reserve, and the cursor's line.
_FIXED_ROWS = 5
# Below this width the hosts table leaves out each host's story (the guide above says it).
_STORY_WIDTH = 140


def _rows(renderable: Group, width: int) -> int:
    """How many terminal rows ``renderable`` takes at ``width`` columns."""
    console = Console(width=width, file=io.StringIO(), color_system=None)
    return len(console.render_lines(renderable, console.options, pad=False))


def render(watch: Watch, *, stories: dict[str, str], width: int = 200, height: int = 50) -> Group:
    """The live view: hosts, what was found and what was sent, fitted to a terminal of
    ``width`` x ``height`` (newest lines kept), so that nothing is cut off."""
    seen = watch.seen
    elapsed = _clock(time.time() - watch.started)
    firing = sorted({a["rule"] for a in seen.alerts if a["state"] == "firing"})
    header = Text(f"gpuwatch demo  +{elapsed}   alerts firing: {', '.join(firing) or 'none'}")
    hosts = _hosts_table(seen, stories if width >= _STORY_WIDTH else None)
    above = _rows(Group(header, hosts), width)
    shown = max(1, min(_SHOWN_LINES, (height - above - _FIXED_ROWS) // 2))
    return Group(
        header,
        hosts,
        _found_lines(seen, shown),
        _sent_lines(seen, watch.started, watch.sink.rejected, shown),
    )
