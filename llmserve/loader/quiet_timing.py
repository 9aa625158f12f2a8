"""Timings that a busy machine cannot turn into a decision: candidates timed in interleaved
rounds, on the wall clock and on this process's CPU clock, while the machine's load is
measured.

A round times every unit (a candidate at a batch size or phase, or one matrix of a
candidate's step) one after the other; the next round does it all again, so a neighbour that
starts or stops mid-way slows the candidates of a round alike. Rounds go on until every row's
best time as a ratio to the reference row's (the checkpoint's default format, the native
backend) moved by under STABLE in the last round, at least MIN_ROUNDS and at most
MAX_ROUNDS, and stop after MIN_ROUNDS where the machine is busy. A decision drawn from a
`Timing` must hold in every round on both clocks (`Timing.samples`), not only in the best
times: one lucky round cannot make it.

`Load` says what the machine did meanwhile: what the other processes used (its busy CPU
time less this process's), the share of the wall time this process's threads ran, and the
1-minute load average. Where `Load.busy_reason()` names one, the timing must not decide:
the caller keeps its default and caches nothing (kernel_choice.py).
"""

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmserve import cpu_info

Times = dict[str, dict]  # row (a candidate) -> column (a batch size, a phase) -> ms

MIN_ROUNDS = 3  # "in every round" means something; ~12 ms a unit in all, as before rounds
MAX_ROUNDS = 6  # an unsettled timing costs at most twice a settled one
STABLE = 0.03  # a ratio that moved less than this in a round has settled
MAX_CALLS = 50  # per unit and round

# Busy while timing, so that the timings must not decide (any one of):
# - the other processes used at least BUSY_OTHER_CORES, or BUSY_OTHER_SHARE of a larger
#   machine: a start beside a compile job has whole cores taken (the user's float32 pick).
#   Measured on a shared 2-core VM: 1.0-1.1 cores with its other tenants busy, and there
#   int4 timed 27 ms a step at batch 1 with 2 threads against 11 with 1; 1.8 beside 4
#   spinning processes.
BUSY_OTHER_CORES = 0.5
BUSY_OTHER_SHARE = 0.1
# - this process's threads ran less than this share of the wall time: descheduled, for
#   where /proc/stat cannot say why (no /proc: macOS, Windows). The kernels' pool spins
#   while it waits, so its threads run whenever they have a core: on that VM, 1 thread ran
#   87-100 % of the time beside the busy core, 2 threads 46-50 %.
BUSY_OWN_SHARE = 0.5
# - the 1-minute load average exceeded the cores: tasks queued for a core over the last
#   minute (this process counts ~1 of it while it loads the model).


@dataclass(frozen=True)
class Load:
    """What the machine did over a timing's wall time."""

    wall_s: float
    own_cpu_s: float  # this process's CPU time, its threads added up
    others_cpu_s: float | None  # the machine's busy CPU time less this process's; None: unknown
    cores: int
    threads: int  # the compute threads the process timed with
    load_1m: float | None

    @property
    def others_cores(self) -> float | None:
        if self.others_cpu_s is None:
            return None
        return max(0.0, self.others_cpu_s / max(self.wall_s, 1e-9))

    @property
    def own_share(self) -> float:
        return self.own_cpu_s / (max(self.wall_s, 1e-9) * self.threads)

    def busy_reason(self) -> str | None:
        """Why the machine counts as busy (the first reason, in the module's order); None:
        quiet."""
        others = self.others_cores
        if others is not None and others >= max(BUSY_OTHER_CORES, BUSY_OTHER_SHARE * self.cores):
            return f"others used {others:.1f} of {self.cores} cores"
        if self.own_share < BUSY_OWN_SHARE:
            return f"this process's {self.threads} threads ran {self.own_share:.0%} of the time"
        if self.load_1m is not None and self.load_1m > self.cores:
            return f"the load average was {self.load_1m:.1f} on {self.cores} cores"
        return None

    def describe(self) -> str:
        others = self.others_cores
        parts = [f"others used {others:.1f} of {self.cores} cores" if others is not None
                 else "others' use unknown",
                 f"this process's {self.threads} threads ran {self.own_share:.0%} of the time"]
        if self.load_1m is not None:
            parts.append(f"load average {self.load_1m:.1f}")
        return ", ".join(parts)


@dataclass(frozen=True)
class LoadMark:
    wall_s: float
    own_cpu_s: float
    machine_busy_s: float | None


def load_mark() -> LoadMark:
    return LoadMark(time.perf_counter(), time.process_time(), cpu_info.busy_cpu_seconds())


def load_since(mark: LoadMark) -> Load:
    """The machine's load from `mark` until now."""
    now = load_mark()
    own = now.own_cpu_s - mark.own_cpu_s
    others = None
    if now.machine_busy_s is not None and mark.machine_busy_s is not None:
        others = now.machine_busy_s - mark.machine_busy_s - own
    return Load(now.wall_s - mark.wall_s, own, others, os.cpu_count() or 1,
                torch.get_num_threads(), cpu_info.load_average_1m())


@dataclass(frozen=True)
class Unit:
    """One thing a round times: `call()`, counted `weight` times into row `row`'s time at
    `column` (a matrix that a step runs in every layer); `before()`, if any, runs untimed
    ahead of it in every round. A round counts the mean of the unit's calls, or with
    `fastest_call` the fastest one: for a unit of a few calls of ~10 ms each, which a
    neighbour's blip (a process started beside it) slows one at a time."""

    row: str
    column: int | str
    call: Callable[[], object]
    weight: float = 1.0
    before: Callable[[], object] | None = None
    fastest_call: bool = False


@dataclass(frozen=True)
class Timing:
    """Each round's ms per row and column on the wall clock and on this process's CPU clock
    (its threads added up: the kernels' pool is in the process), and the machine's load
    while the rounds ran (None: recorded figures)."""

    wall: list[Times]
    cpu: list[Times] = field(default_factory=list)
    load: Load | None = None

    def best(self) -> Times:
        """Each cell's fastest round on the wall clock."""
        return fastest(self.wall)

    def bests(self) -> list[Times]:
        """Each cell's fastest round, on each clock measured."""
        return [fastest(self.wall), *([fastest(self.cpu)] if self.cpu else [])]

    def samples(self) -> list[Times]:
        """What a decision must hold in: every round, on both clocks."""
        return [*self.wall, *self.cpu]

    def lead(self, row: str, reference: str, column: int | str) -> float:
        """How many times as fast as `reference` `row` ran at `column` in its worst round
        (either clock): what held in every round."""
        return min(sample[reference][column] / max(sample[row][column], 1e-12)
                   for sample in self.samples())

    def median_lead(self, row: str, reference: str, column: int | str) -> float:
        """How many times as fast as `reference` `row` ran at `column` in the median round
        (both clocks' rounds together): for a choice between two ways where neither is the
        safe one, which a blip in one round must not decide either way."""
        return statistics.median(sample[reference][column] / max(sample[row][column], 1e-12)
                                 for sample in self.samples())

    def busy_reason(self) -> str | None:
        return None if self.load is None else self.load.busy_reason()

    def summary(self) -> str:
        """The rounds and the load, for the log."""
        load = "" if self.load is None else f" in {self.load.wall_s:.1f} s; {self.load.describe()}"
        return f"{len(self.wall)} rounds{load}"


def fastest(rounds: list[Times]) -> Times:
    return {row: {column: min(r[row][column] for r in rounds) for column in columns}
            for row, columns in rounds[0].items()}


def time_rounds(units: list[Unit], reference: str, target_s: float) -> Timing:
    """`units` timed in rounds (see the module docstring), each unit as many calls a round
    as take about `target_s` (at least one, judged from a first untimed call); `reference`
    is the row the others' ratios are taken to."""
    calls = [_calls_per_round(unit, target_s) for unit in units]
    start = load_mark()
    wall: list[Times] = []
    cpu: list[Times] = []
    while True:
        round_wall, round_cpu = _one_round(units, calls)
        wall.append(round_wall)
        cpu.append(round_cpu)
        timing = Timing(wall, cpu, load_since(start))
        if len(wall) >= MAX_ROUNDS or (len(wall) >= MIN_ROUNDS and (
                timing.busy_reason() is not None or _settled(wall, reference))):
            return timing


def _calls_per_round(unit: Unit, target_s: float) -> int:
    if unit.before is not None:
        unit.before()
    start = time.perf_counter()
    unit.call()
    once = time.perf_counter() - start
    return max(1, min(MAX_CALLS, round(target_s / max(once, 1e-6))))


def _one_round(units: list[Unit], calls: list[int]) -> tuple[Times, Times]:
    wall: Times = {}
    cpu: Times = {}
    for unit, n in zip(units, calls, strict=True):
        if unit.before is not None:
            unit.before()
        taken_wall, taken_cpu = _calls_taken(unit, n)
        for times, taken in ((wall, taken_wall), (cpu, taken_cpu)):
            row = times.setdefault(unit.row, {})
            row[unit.column] = row.get(unit.column, 0.0) + taken * unit.weight * 1e3
    return wall, cpu


def _calls_taken(unit: Unit, n: int) -> tuple[float, float]:
    """Seconds a call of `unit` took, on the wall and CPU clocks, over `n` calls: their mean,
    or each clock's fastest call (`Unit.fastest_call`)."""
    if not unit.fastest_call:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(n):
            unit.call()
        return (time.perf_counter() - wall_start) / n, (time.process_time() - cpu_start) / n
    wall = cpu = float("inf")
    for _ in range(n):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        unit.call()
        wall = min(wall, time.perf_counter() - wall_start)
        cpu = min(cpu, time.process_time() - cpu_start)
    return wall, cpu


def _settled(wall: list[Times], reference: str) -> bool:
    before, now = _ratios(fastest(wall[:-1]), reference), _ratios(fastest(wall), reference)
    return all(abs(now[cell] / before[cell] - 1) < STABLE for cell in now)


def _ratios(best: Times, reference: str) -> dict[tuple, float]:
    return {(row, column): ms / max(best[reference][column], 1e-12)
            for row, columns in best.items() for column, ms in columns.items()}


def best_seconds(call: Callable[[], object], budget_s: float, max_calls: int = 20,
                 repeats: int = 3) -> float:
    """Seconds one `call()` takes: the best of `repeats` loops of as many calls as fit
    `budget_s` in all (after one warm-up call). For reports (`llmserve bench kernels`);
    a decision times in rounds (`time_rounds`)."""
    call()
    once = time.perf_counter()
    call()
    once = time.perf_counter() - once
    calls = max(1, min(max_calls, int(budget_s / repeats / max(once, 1e-6))))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best
