"""Interleaved rounds, and what the rest of the machine did while they ran."""

import time
from dataclasses import replace

import pytest

from llmserve import cpu_info
from llmserve.loader import quiet_timing
from llmserve.loader.quiet_timing import (
    MAX_ROUNDS,
    MIN_ROUNDS,
    Load,
    LoadMark,
    Unit,
    load_since,
    time_rounds,
)

QUIET = Load(wall_s=1.0, own_cpu_s=1.9, others_cpu_s=0.1, cores=2, threads=2, load_1m=0.4)


def test_a_quiet_machine_and_the_three_ways_to_be_busy():
    assert QUIET.busy_reason() is None
    assert replace(QUIET, others_cpu_s=1.3).busy_reason() == "others used 1.3 of 2 cores"
    big = replace(QUIET, cores=64, threads=64, own_cpu_s=60.0, others_cpu_s=3.0)
    assert big.busy_reason() is None  # 3 of 64 cores: under a tenth of the machine
    assert replace(big, others_cpu_s=8.0).busy_reason() == "others used 8.0 of 64 cores"
    # no /proc/stat (macOS, Windows): this process's threads waited for a core
    starved = replace(QUIET, others_cpu_s=None, own_cpu_s=0.8)
    assert starved.busy_reason() == "this process's 2 threads ran 40% of the time"
    assert replace(QUIET, load_1m=3.5).busy_reason() == "the load average was 3.5 on 2 cores"
    assert QUIET.describe() == ("others used 0.1 of 2 cores, this process's 2 threads ran "
                                "95% of the time, load average 0.4")


def test_what_others_used_is_the_machines_busy_time_less_this_process(monkeypatch):
    monkeypatch.setattr(cpu_info, "busy_cpu_seconds", lambda: 1000.0)
    monkeypatch.setattr(cpu_info, "load_average_1m", lambda: 0.5)
    # 2 s ago: the machine has been busy 3 CPU seconds since, this process 1 of them
    mark = LoadMark(wall_s=time.perf_counter() - 2.0, own_cpu_s=time.process_time() - 1.0,
                    machine_busy_s=997.0)
    load = load_since(mark)
    assert load.others_cpu_s == pytest.approx(2.0, abs=0.05)
    assert load.others_cores == pytest.approx(1.0, abs=0.05)
    assert load.load_1m == 0.5


def test_a_busy_machine_ends_the_rounds_at_the_minimum(monkeypatch):
    monkeypatch.setattr(quiet_timing, "load_since",
                        lambda mark: replace(QUIET, others_cpu_s=1.5))
    timing = time_rounds([Unit("a", 1, lambda: None), Unit("b", 1, lambda: None)], "a", 0.0)
    assert len(timing.wall) == len(timing.cpu) == MIN_ROUNDS
    assert timing.busy_reason() == "others used 1.5 of 2 cores"


def test_rounds_go_on_while_the_ratios_move(monkeypatch):
    monkeypatch.setattr(quiet_timing, "load_since", lambda mark: QUIET)
    sleep_s = [0.064]

    def halve():  # untimed, before every round's call (and the first, untimed one)
        sleep_s[0] /= 2

    units = [Unit("a", "x", lambda: time.sleep(0.001)),
             Unit("b", "x", lambda: time.sleep(sleep_s[0]), weight=2.0, before=halve)]
    timing = time_rounds(units, "a", 0.0)
    assert len(timing.wall) == MAX_ROUNDS  # b's ratio to a halved every round
    # a round's figure: one call (target 0 s) of at least 16 ms in the first, counted twice
    assert timing.wall[0]["b"]["x"] >= 2 * 16.0
    assert timing.best()["b"]["x"] == min(r["b"]["x"] for r in timing.wall)
    assert timing.lead("a", "b", "x") == min(s["b"]["x"] / s["a"]["x"] for s in timing.samples())


def test_a_unit_may_count_its_fastest_call(monkeypatch):
    monkeypatch.setattr(quiet_timing, "load_since", lambda mark: QUIET)
    calls = []

    def blip_first():  # the first call of every round slowed by a neighbour
        time.sleep(0.03 if len(calls) % 4 == 0 else 0.002)
        calls.append(1)

    mean = time_rounds([Unit("a", "x", blip_first)], "a", 0.0)
    calls.clear()
    fastest = time_rounds([Unit("a", "x", blip_first, fastest_call=True)], "a", 0.015)
    assert all(r["a"]["x"] < 10.0 for r in fastest.wall)  # the 30 ms blip is never counted
    assert all(r["a"]["x"] >= 2.0 for r in fastest.wall + mean.wall)


def test_the_median_lead_is_not_one_rounds():
    from llmserve.loader.quiet_timing import Timing

    def sample(nt_ms, cached_ms):
        return {"non-temporal": {"pass": nt_ms}, "cached": {"pass": cached_ms}}

    # one round on each clock that a neighbour slowed: the cached pass's 1.8x read 1.07x
    rounds = [sample(17.4, 9.6), sample(17.9, 9.9), sample(17.6, 16.5)]
    timing = Timing(rounds, [sample(35.0, 19.5), sample(35.4, 20.0), sample(35.1, 27.2)])
    assert timing.lead("cached", "non-temporal", "pass") == pytest.approx(17.6 / 16.5)
    # the six samples' middle two: 35.4 / 20.0 and 35.0 / 19.5 (the cpu clock's)
    assert timing.median_lead("cached", "non-temporal", "pass") == pytest.approx(
        (35.4 / 20.0 + 35.0 / 19.5) / 2)
