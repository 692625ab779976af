"""How ``gpuwatch demo`` talks: a live table on a terminal, plain lines in a pipe, or
JSON lines with ``--json`` (one document per line: ``ready``, then ``found``, ``alert``
and ``notification`` as they happen, then ``stopped``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.live import Live

from gpuwatch.cli.demo_watch import Watch, render, who


def json_line(document: dict[str, Any]) -> None:
    """One JSON document on one line of stdout, flushed."""
    sys.stdout.write(json.dumps(document, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _guide(info: dict[str, Any]) -> str:
    t = info["timings"]
    server = info["server_url"]
    expect_alert = t["leak_window"] + t["bucket"] + t["alert_for"] + t["evaluation"]
    expect_alert += t["group_wait"] + 5
    hosts = "\n".join(
        f"  {'hosts' if i == 0 else '':<10} {h['hostname']}  {h['shows']}  (agent {h['agent_url']})"
        for i, h in enumerate(info["hosts"])
    )
    return (
        f"gpuwatch demo: a server and {len(info['hosts'])} simulated hosts, speed {t['speed']:g}x\n"
        f"  dashboard  {info['dashboard_url']}\n"
        f"  API        {server}/api/v1/events  {server}/api/v1/alerts  {server}/docs\n"
        f"  alerts to  {info['sink_url']} (a signed webhook in this process)\n"
        f"{hosts}\n"
        f"  windows    idle after {t['idle_window']:g} s, a leak after {t['leak_window']:g} s "
        f"of growth (so only periods up to {t['leak_window']:g} s are ruled out, not 30 min),\n"
        f"             alert rules after {t['alert_for']:g} s, group_wait {t['group_wait']:g} s\n"
        # Latest times ("by"): a verdict waits for its window, then up to two buckets.
        f"  expect     orphans in seconds, the idle notebook by ~{t['idle_window'] + 2 * t['bucket']:.0f} s, "
        f"the leak and the filling GPU by ~{t['leak_window'] + 2 * t['bucket']:.0f} s,\n"
        f"             the filling-up alert at the webhook by ~{expect_alert:.0f} s\n"
        f"  reap       {info['reap_command']}\n"
        f"             (stops alice's notebook on gpu-b once idle {t['reap_idle']:g} s)\n"
        "Ctrl-C stops this run's server, agents and stand-ins, and nothing else."
    )


def _plain(line: dict[str, Any]) -> str:
    at = f"+{line['at']:>6.1f}s"
    if line["event"] == "found":
        where = line["hostname"] + (
            f" GPU {line['gpu_index']}" if line["gpu_index"] is not None else ""
        )
        whose = who(line.get("user"), line.get("command"))
        return f"{at}  found  {where}  {line['kind']}/{line['reason']}: {whose}{line['summary']}"
    if line["event"] == "alert":
        # A process alert's user is a label; the filling-up summary names its growers.
        user = line["labels"].get("user")
        whose = f"{user}: " if user and user not in line["summary"] else ""
        return f"{at}  firing {line['rule']}: {whose}{line['summary']}"
    rules = ", ".join(sorted({a["rule"] for a in line["alerts"]}))
    return f"{at}  sent   {line['status']} {rules} to the webhook (signature checked)"


class Output:
    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self.console = Console(highlight=False)
        self.live: Live | None = None
        self.footer = ""
        self.stories: dict[str, str] = {}

    def ready(self, info: dict[str, Any], watch: Watch) -> None:
        if self.as_json:
            json_line({"event": "ready", **info})
            return
        self.stories = {h["hostname"]: h["shows"] for h in info["hosts"]}
        self.footer = _guide(info)
        # The guide (where to look, what to expect, the reap command) is printed once,
        # above the live view: inside it, a terminal of ordinary height cut it off.
        typer.echo(self.footer)
        if self.console.is_terminal:
            self.live = Live(self._view(watch), console=self.console, auto_refresh=False)
            self.live.start()

    def _view(self, watch: Watch) -> Any:
        size = self.console.size
        return render(watch, stories=self.stories, width=size.width, height=size.height)

    def update(self, lines: list[dict[str, Any]], watch: Watch) -> None:
        if self.as_json:
            for line in lines:
                json_line(line)
        elif self.live is not None:
            self.live.update(self._view(watch), refresh=True)
        else:
            for line in lines:
                typer.echo(_plain(line))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def closing(self, watch: Watch) -> None:
        """What the server concluded (its database goes with the demo), on stderr."""
        self.close()
        events = sorted(
            watch.seen.events, key=lambda e: (e["hostname"], e["gpu_index"] or -1, e["id"])
        )
        typer.echo(f"\nthe server recorded {len(events)} event(s):", err=True)
        for e in events:
            where = f"GPU {e['gpu_index']}" if e["gpu_index"] is not None else "host"
            state = "open " if e["open"] else "ended"
            typer.echo(
                f"  {e['hostname']} {where}  {state} {e['kind']}/{e['reason']}: {e['summary']}",
                err=True,
            )
        sent = len(watch.seen.notifications)
        typer.echo(f"and sent {sent} notification(s) to the webhook.", err=True)

    def stopped(self, reason: str, watch: Watch, stopped: list[int]) -> None:
        if self.as_json:
            json_line(
                {
                    "event": "stopped",
                    "reason": reason,
                    "totals": watch.totals(),
                    "stopped_pids": stopped,
                }
            )
        else:
            typer.echo(
                f"stopped this run's agents and server, and its {len(stopped)} stand-in and "
                "supervisor processes; nothing else.",
                err=True,
            )
