"""`bench spec`'s figures: with repeats the speedup is the median of the run-by-run
ratios of methods that took turns, not the ratio of medians."""

import json

from llmserve.bench.spec import SpecResult, format_report, speedup


def _row(method: str, runs: list[float] | None, seconds: float) -> SpecResult:
    return SpecResult("float32", method, "chat", 1, 512, seconds, 8, 4, 4,
                      None if method == "none" else True, runs)


def test_repeated_runs_give_the_median_of_the_pairs_ratios():
    # the machine slows down halfway: the second pair is slower on both sides
    none = _row("none", [10.0, 20.0, 10.5], 10.5)
    eagle = _row("eagle", [8.0, 16.0, 7.0], 8.0)
    assert speedup(eagle, none) == 1.25  # the ratios 1.25, 1.25, 1.5
    # a ratio of medians would read 10.5 / 8.0 = 1.31
    assert speedup(_row("eagle", None, 8.0), _row("none", None, 10.0)) == 1.25


def test_the_report_reads_repeated_runs_back_from_json():
    data = {"machine": {}, "results": [
        dict(vars(r)) for r in (_row("none", [10.0, 20.0, 10.5], 10.5),
                                _row("eagle", [8.0, 16.0, 7.0], 8.0))]}
    report = format_report(json.loads(json.dumps(data)))
    eagle = next(line for line in report.splitlines() if " eagle " in line)
    assert " 1.25x " in eagle and " yes" in eagle
