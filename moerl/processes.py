"""This host's process tree, read from Linux's ``/proc``: descendants, command lines, whether a process
has exited. Used to clean up what a failed start left (``moerl.runtime.ray.local``) and by the test
harnesses; every function answers empty / "gone" where ``/proc`` is absent (not Linux)."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
HAS_PROC = (PROC / "self" / "stat").exists()
"""Whether this host has a Linux ``/proc`` (the functions below read it)."""


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``(comm)`` (state first, then ppid), or None when the
    process is gone. ``comm`` may hold spaces and parentheses, so the split is after the last ``)``."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def descendants(*pids: int) -> set[int]:
    """The pids of every descendant of ``pids`` (default: this process) that ``/proc`` lists, zombies
    included, from one reading of the process table; empty without ``/proc``."""
    if not HAS_PROC:
        return set()
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = list(pids or (os.getpid(),))
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` as its arguments (empty when it exited, or for a kernel thread)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a for a in raw.decode(errors="replace").split("\0") if a]


def is_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (absent, or a zombie waiting for its parent)."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X")
