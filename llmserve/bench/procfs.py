"""Memory of a process tree, read from /proc (Linux), else from psutil where it is installed
(macOS, Windows), else not at all (`rss_source()` is None and `tree_rss_bytes` None: the soak
says so and samples the rest). The machine's load is `cpu_info.load_average_1m`.

A server's resident memory is its own VmRSS plus that of every descendant (tensor-parallel
ranks, compile workers): pages shared between them count once per process, so the sum is an
upper bound, but it moves only when one of them grows or shrinks.
"""

from pathlib import Path

from llmserve import cpu_info

PROC = Path("/proc")
NO_RSS_SOURCE = ("this system has no /proc and psutil is not installed, so the server's RSS "
                 "is not sampled (pip install psutil to sample it)")


def rss_source(proc: Path = PROC) -> str | None:
    """Where `tree_rss_bytes` reads from here: "/proc", "psutil", or None (nowhere)."""
    if proc.is_dir():
        return "/proc"
    return "psutil" if cpu_info.psutil_module() is not None else None


def parent_pids(proc: Path = PROC) -> dict[int, int]:
    """pid -> parent pid of every process visible now."""
    parents = {}
    try:
        entries = list(proc.iterdir())
    except OSError:  # no /proc here
        return {}
    for entry in entries:
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
    is gone, or where `rss_source()` is None."""
    source = rss_source(proc)
    if source != "/proc":
        return _psutil_tree_rss_bytes(pid) if source == "psutil" else None
    total, count = 0, 0
    for member in process_tree(pid, proc):
        rss = rss_bytes(member, proc)
        if rss is not None:
            total += rss
            count += 1
    return (total, count) if count else None


def _psutil_tree_rss_bytes(pid: int) -> tuple[int, int] | None:
    psutil = cpu_info.psutil_module()
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.Error:  # gone, or not ours to see
        return None
    total, count = 0, 0
    for member in members:
        try:
            total += member.memory_info().rss
            count += 1
        except psutil.Error:
            continue
    return (total, count) if count else None

