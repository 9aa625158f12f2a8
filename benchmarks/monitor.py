"""Machine load while a benchmark runs: the load average, the CPU that processes outside the
benchmark used, and the resident memory of the servers it watches. Linux only (/proc).

Sampled every second in a thread. The benchmark's own CPU is this process and all its
descendants (servers, bench clients, offline runs), each counted as utime + stime + cutime
+ cstime: when a child exits and is reaped its time moves into its parent's cutime, so the
sum stays exact. "Other" is /proc/stat's busy time (user, nice, system, irq, softirq; not
steal) minus that, in cores (1.0 = one core busy all the time).
"""

import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

PROC = Path("/proc")
CLK_TCK = os.sysconf("SC_CLK_TCK")
QUIET_CORES = 0.10  # other processes above this (mean, in cores): the stage was not quiet


def read_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(comm, ppid, own ticks, reaped children's ticks) of a process; None once it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    close = text.rindex(")")  # comm may hold spaces and parentheses
    fields = text[close + 2:].split()  # fields[0] is the state (field 3 of proc(5))
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return text[text.index("(") + 1:close], int(fields[1]), utime + stime, cutime + cstime


def busy_ticks() -> int:
    user, nice, system, _idle, _iowait, irq, softirq = (
        int(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:8])
    return user + nice + system + irq + softirq


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB ({} once it is gone)."""
    try:
        lines = (PROC / str(pid) / "status").read_text().splitlines()
    except OSError:
        return {}
    return {key: int(rest.split()[0]) for key, _, rest in (line.partition(":") for line in lines)
            if key in ("VmRSS", "VmHWM")}


class LoadMonitor:
    """`with LoadMonitor() as mon: ...` then `mon.summary()`; `mon.watch(pid)` for RSS."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.root = os.getpid()
        self.loads: list[float] = []
        self.other_cores: list[float] = []
        self.other_by_name: Counter[str] = Counter()  # CPU seconds per process name
        self.memory: dict[int, dict[str, int]] = {}  # pid -> max VmRSS, last VmHWM (KiB)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LoadMonitor":
        self._start = self._last_time = time.monotonic()
        self._last_busy = busy_ticks()
        self._last_own, self._last_procs, _ = self._snapshot()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._seconds = time.monotonic() - self._start

    def watch(self, pid: int) -> None:
        self.sample_memory(pid)

    def sample_memory(self, pid: int) -> dict[str, int]:
        """Read a watched process's memory now (also call it right before stopping it)."""
        now = memory_kib(pid)
        with self._lock:
            seen = self.memory.setdefault(pid, {"vm_rss_max_kib": 0, "vm_hwm_kib": 0})
            if now:
                seen["vm_rss_max_kib"] = max(seen["vm_rss_max_kib"], now["VmRSS"])
                seen["vm_hwm_kib"] = max(seen["vm_hwm_kib"], now["VmHWM"])
            return dict(seen)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _snapshot(self) -> tuple[int, dict[int, tuple[str, int, int, int]], set[int]]:
        """Ticks of this process tree, every process's stat, and the tree's pids."""
        procs = {int(p.name): s for p in PROC.iterdir() if p.name.isdigit()
                 if (s := read_stat(int(p.name))) is not None}
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        own, tree, todo = 0, set(), [self.root]
        while todo:
            pid = todo.pop()
            if pid in procs:
                own += procs[pid][2] + procs[pid][3]
                tree.add(pid)
                todo += children.get(pid, [])
        return own, procs, tree

    def _sample(self) -> None:
        now, busy = time.monotonic(), busy_ticks()
        own, procs, tree = self._snapshot()
        elapsed = now - self._last_time
        if elapsed > 0.2:
            other = max(0, (busy - self._last_busy) - (own - self._last_own))
            self.other_cores.append(other / CLK_TCK / elapsed)
            self.loads.append(os.getloadavg()[0])
            for pid, (name, _, ticks, _) in procs.items():
                before = self._last_procs.get(pid)
                if pid not in tree and before is not None and ticks > before[2]:
                    self.other_by_name[name] += (ticks - before[2]) / CLK_TCK
        self._last_time, self._last_busy, self._last_own, self._last_procs = now, busy, own, procs
        for pid in list(self.memory):
            self.sample_memory(pid)

    def summary(self) -> dict[str, Any]:
        """Mean and max of the load average and of other processes' CPU (cores) over the run."""
        def stats(xs: list[float]) -> dict[str, float | None]:
            return {"mean": sum(xs) / len(xs) if xs else None, "max": max(xs, default=None)}

        mean_other = stats(self.other_cores)["mean"] or 0.0
        return {"seconds": self._seconds, "samples": len(self.loads),
                "load_avg_1min": stats(self.loads), "other_cores": stats(self.other_cores),
                "busiest_other_cpu_s": {name: round(cpu_s, 1) for name, cpu_s
                                        in self.other_by_name.most_common(3) if cpu_s >= 0.1},
                "quiet": mean_other <= QUIET_CORES}


def warning(stage: str, summary: dict[str, Any]) -> str | None:
    """One line when other processes used more than QUIET_CORES of a core during `stage`."""
    if summary["quiet"]:
        return None
    other = summary["other_cores"]
    busiest = ", ".join(f"{name} {s:.1f} s" for name, s in summary["busiest_other_cpu_s"].items())
    return (f"WARNING: machine not quiet during {stage}: other processes used "
            f"{other['mean']:.2f} cores on average (max {other['max']:.2f}); busiest: "
            f"{busiest or 'short-lived processes'}. Rerun that stage on a quiet machine.")
