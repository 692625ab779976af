"""What the procfs mount says about this reader's view: whether ``proc_root`` is this
process's own procfs, and whether ``hidepid=`` hides other users' processes from it."""

from __future__ import annotations

import os
import re
from pathlib import Path


def is_own_procfs(proc_root: Path) -> bool:
    """True when ``proc_root`` is a procfs of this process's PID namespace: its ``self``
    link names this process (a fixture tree's ``self`` is a directory)."""
    try:
        return os.readlink(proc_root / "self") == str(os.getpid())
    except OSError:
        return False


def hiding_mount_option(proc_root: Path) -> str | None:
    """``hidepid=<value>`` when ``proc_root`` is a procfs mounted so that it hides other
    users' processes from this reader (not root, not in the mount's ``gid=`` group), else
    ``None``. Read from ``<proc_root>/self/mountinfo``; the last mount on the path counts."""
    try:
        text = (proc_root / "self" / "mountinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    target = os.path.realpath(proc_root)
    options: str | None = None
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        is_proc = sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] == "proc"
        if is_proc and _unescape_mount_path(fields[4]) == target:
            options = tail[2]
    if options is None:
        return None
    settings = dict(opt.partition("=")[::2] for opt in options.split(","))
    hidepid = settings.get("hidepid")
    if hidepid in (None, "0", "off"):
        return None
    gid = settings.get("gid", "")
    if os.geteuid() == 0 or (gid.isdigit() and int(gid) in {os.getegid(), *os.getgroups()}):
        return None
    return f"hidepid={hidepid}"


def _unescape_mount_path(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash in a path as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)
