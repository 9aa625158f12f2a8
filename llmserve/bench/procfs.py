"""Memory of a process tree and the machine's load, read from /proc (Linux only).

A server's resident memory is its own VmRSS plus that of every descendant (tensor-parallel
ranks, compile workers): pages shared between them count once per process, so the sum is an
upper bound, but it moves only when one of them grows or shrinks.
"""

import os
from pathlib import Path

PROC = Path("/proc")


def parent_pids(proc: Path = PROC) -> dict[int, int]:
    """pid -> parent pid of every process visible now."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # comm (field 2) may hold spaces and parentheses; the ppid is the 2nd field after it
        parents[int(entry.name)] = int(text[text.rindex(")") + 2:].split()[1])
    return parents


def process_tree(pid: int, proc: Path = PROC) -> list[int]:
    """`pid` and all its descendants, `pid` first ([] once it is gone)."""
    parents = parent_pids(proc)
    if pid not in parents:
        return []
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(sorted(children.get(current, ())))
    return tree


def rss_bytes(pid: int, proc: Path = PROC) -> int | None:
    """VmRSS of one process in bytes; None once it is gone (or a kernel thread: no VmRSS)."""
    try:
        lines = (proc / str(pid) / "status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"unexpected VmRSS unit {unit!r} in /proc/{pid}/status")
            return int(value) * 1024
    return None


def tree_rss_bytes(pid: int, proc: Path = PROC) -> tuple[int, int] | None:
    """(summed VmRSS of `pid` and its descendants, number of processes); None once `pid`
    is gone."""
    total, count = 0, 0
    for member in process_tree(pid, proc):
        rss = rss_bytes(member, proc)
        if rss is not None:
            total += rss
            count += 1
    return (total, count) if count else None


def load_average_1m() -> float:
    """The kernel's 1-minute load average (runnable + uninterruptible tasks)."""
    return os.getloadavg()[0]
