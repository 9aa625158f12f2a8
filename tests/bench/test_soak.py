"""`bench soak`: the RSS slope, the /proc sampler, and a 20-second run against a server it
starts on the default model (the JSON's fields, KV back at 0, hang-ups seen as aborts)."""

import json
import os
import subprocess
import sys

import matplotlib  # noqa: F401  (a test dependency: the plot must really be drawn)
import pytest

from llmserve import cpu_info
from llmserve.bench.procfs import (
    process_tree,
    rss_bytes,
    rss_source,
    tree_rss_bytes,
)
from llmserve.bench.soak import SoakConfig, parse_duration, parse_metrics
from llmserve.bench.soak_report import format_sample, least_squares_slope, rss_trend
from llmserve.cpu_info import load_average_1m
from llmserve.entrypoints.cli import main


def test_least_squares_slope_of_a_line_and_of_noise_around_it():
    xs = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert least_squares_slope(xs, [1 + 2 * x for x in xs]) == pytest.approx(2.0)
    # noise uncorrelated with x (symmetric about the middle) leaves the slope at -1
    noisy = [3 - x + e for x, e in zip(xs, [1, -1, 0, -1, 1], strict=True)]
    assert least_squares_slope(xs, noisy) == pytest.approx(-1.0)
    assert least_squares_slope([5.0], [1.0]) is None
    assert least_squares_slope([2.0, 2.0], [1.0, 3.0]) is None


def _sample(t_s: float, rss: float | None, phase: str = "load") -> dict:
    return {"t_s": t_s, "phase": phase, "rss_mib": rss}


def test_rss_trend_leaves_out_the_warm_up_and_the_run_down():
    # 300 MiB while compiling in the first minute, then +6 MiB per hour; the finishing
    # and end samples (a drop after the load) are not part of the fit
    samples = [_sample(0, 100.0), _sample(30, 300.0)]
    samples += [_sample(t, 400.0 + 6 * t / 3600) for t in range(60, 1860, 10)]
    samples += [_sample(1870, 390.0, "finishing"), _sample(1880, 380.0, "end")]
    trend = rss_trend(samples, warmup_s=60)
    assert trend["rss_slope_mib_per_hour"] == pytest.approx(6.0)
    assert trend["rss_fit_points"] == 180
    assert trend["rss_after_warmup_mib"] == pytest.approx(400.1)
    assert trend["rss_max_mib"] == pytest.approx(400.0 + 6 * 1850 / 3600)
    assert trend["rss_slope_last_half_mib_per_hour"] == pytest.approx(6.0)
    assert rss_trend([_sample(10, None)], 0)["rss_slope_mib_per_hour"] is None


def test_rss_that_settles_is_flat_over_the_second_half():
    # KV-cache pages written for the first time: +4 MiB/s for 10 minutes, then flat
    samples = [_sample(t, 1000.0 + 4 * min(t, 600)) for t in range(0, 1810, 10)]
    trend = rss_trend(samples, warmup_s=60)
    assert trend["rss_slope_mib_per_hour"] > 1000
    assert trend["rss_slope_last_half_mib_per_hour"] == pytest.approx(0.0, abs=1e-9)


def _fake_process(proc, pid: int, ppid: int, comm: str, rss_kb: int | None) -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    status = f"Name:\t{comm}\nPid:\t{pid}\n" + (f"VmRSS:\t{rss_kb} kB\n" if rss_kb else "")
    (proc / str(pid) / "status").write_text(status)


def test_tree_rss_sums_descendants_only(tmp_path):
    _fake_process(tmp_path, 1, 0, "init", 10)
    _fake_process(tmp_path, 50, 1, "llmserve serve", 1000)
    _fake_process(tmp_path, 51, 50, "worker (rank 1)", 300)  # a ')' and space in comm
    _fake_process(tmp_path, 52, 51, "compile", 20)
    _fake_process(tmp_path, 53, 50, "kthread", None)  # no VmRSS: not counted
    _fake_process(tmp_path, 60, 1, "bystander", 5000)
    (tmp_path / "self").mkdir()  # not a pid
    assert sorted(process_tree(50, tmp_path)) == [50, 51, 52, 53]
    assert rss_bytes(51, tmp_path) == 300 * 1024
    assert tree_rss_bytes(50, tmp_path) == ((1000 + 300 + 20) * 1024, 3)
    assert tree_rss_bytes(99, tmp_path) is None


def test_tree_rss_of_this_process_counts_a_child():
    alone = tree_rss_bytes(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with_child = None
        for _ in range(100):  # until the child's interpreter has started
            with_child = tree_rss_bytes(os.getpid())
            if with_child[1] > alone[1] and rss_bytes(child.pid) > 4 * 2**20:
                break
        assert child.pid in process_tree(os.getpid())
        assert with_child[1] == alone[1] + 1
    finally:
        child.kill()
        child.wait()


def test_without_proc_the_rss_comes_from_psutil(tmp_path):
    pytest.importorskip("psutil")
    no_proc = tmp_path / "no-proc"
    assert rss_source() == "/proc" and rss_source(no_proc) == "psutil"
    from_proc = tree_rss_bytes(os.getpid())
    from_psutil = tree_rss_bytes(os.getpid(), no_proc)
    assert from_psutil[1] == from_proc[1]
    assert from_psutil[0] == pytest.approx(from_proc[0], rel=0.05)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert tree_rss_bytes(gone.pid, no_proc) is None


def test_without_proc_or_psutil_nothing_is_sampled_and_nothing_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_info, "psutil_module", lambda: None)
    no_proc = tmp_path / "no-proc"
    assert rss_source(no_proc) is None
    assert tree_rss_bytes(os.getpid(), no_proc) is None
    assert process_tree(os.getpid(), no_proc) == []
    monkeypatch.delattr(os, "getloadavg")  # as on Windows
    assert load_average_1m() is None
    sample = {"t_s": 10.0, "phase": "load", "rss_mib": None, "kv_usage": None, "running": 2,
              "waiting": 0, "load_1m": None,
              "requests": {"completed": 3, "disconnected": 0, "errors": 0},
              "window": {"ttft_ms": {"p50": None}, "tpot_ms": {"p50": None}}}
    assert "RSS n/a  KV n/a  run 2 wait 0  load n/a  done 3" in format_sample(sample)


def test_duration_and_config_checks():
    assert [parse_duration(t) for t in ("20", "20s", "30m", "1.5h")] == [20, 20, 1800, 5400]
    with pytest.raises(ValueError, match="duration like"):
        parse_duration("30 minutes")
    with pytest.raises(ValueError, match="LOW:HIGH"):
        SoakConfig(input_len=(10, 5))
    with pytest.raises(ValueError, match="--server-pid goes with --base-url"):
        SoakConfig(server_pid=1)


def test_parse_metrics_sums_replicas_and_reads_reasons():
    text = "\n".join([
        "# TYPE llmserve_kv_cache_usage_ratio gauge",
        'llmserve_kv_cache_usage_ratio{replica="0"} 0.25',
        'llmserve_kv_cache_usage_ratio{replica="1"} 0.5',
        "# TYPE llmserve_num_requests_running gauge",
        'llmserve_num_requests_running{replica="0"} 3.0',
        'llmserve_num_requests_running{replica="1"} 4.0',
        "# TYPE llmserve_request_success counter",
        'llmserve_request_success_total{finished_reason="abort"} 2.0',
        'llmserve_request_success_total{finished_reason="length"} 7.0', ""])
    found = parse_metrics(text)
    assert found == {"kv_usage": 0.5, "running": 7, "waiting": 0,
                     "finished": {"abort": 2, "length": 7}}


SAMPLE_FIELDS = {"t_s", "phase", "rss_mib", "num_server_processes", "load_1m", "kv_usage",
                 "running", "waiting", "finished_on_server", "requests", "window"}
SUMMARY_FIELDS = {"sent", "completed", "disconnected", "errors", "errors_by_message",
                  "server_aborts", "rss_slope_mib_per_hour",
                  "rss_slope_last_half_mib_per_hour", "rss_fit_points",
                  "rss_after_warmup_mib", "rss_end_of_load_mib", "rss_max_mib",
                  "kv_usage_end", "kv_returned_to_zero", "load_1m_mean", "load_1m_max",
                  "ttft_ms", "tpot_ms", "e2el_ms"}


@pytest.mark.slow
def test_a_20_second_soak_of_a_server_it_starts(smollm2_gguf, tmp_path, capsys):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    code = main(["bench", "soak", "--model", str(smollm2_gguf), "--duration", "20s",
                 "--sample-interval", "2s", "--warmup", "4s", "--concurrency", "4",
                 "--input-len", "8:32", "--output-len", "4:16", "--disconnect-fraction", "0.2",
                 "--server-args", "--kv-cache-memory 32MiB --threads 2",
                 "--output-json", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    samples, summary = report["samples"], report["summary"]
    assert [s["phase"] for s in samples if s["phase"] == "load"] == ["load"] * 10
    assert samples[-1]["phase"] == "end"
    for sample in samples:
        assert SAMPLE_FIELDS <= sample.keys()
        assert sample["rss_mib"] > 100  # the server's, not this process's
        assert sample["num_server_processes"] >= 1
    assert SUMMARY_FIELDS <= summary.keys()
    assert summary["errors"] == 0, summary["errors_by_message"]
    assert summary["completed"] > 0 and summary["disconnected"] > 0
    assert summary["sent"] == summary["completed"] + summary["disconnected"]
    # a hang-up is an abort on the server unless its last token was already on the way
    assert 1 <= summary["server_aborts"] <= summary["disconnected"]
    assert summary["kv_usage_end"] == 0.0 and summary["kv_returned_to_zero"] is True
    assert samples[-1]["running"] == samples[-1]["waiting"] == 0
    assert summary["rss_fit_points"] >= 8
    assert summary["ttft_ms"]["p50"] <= summary["e2el_ms"]["p50"]
    assert sum(s["window"]["completed"] for s in samples) == summary["completed"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "KV usage at the end: 0.00 % (back to ~0: yes)" in printed
    assert "slope" in printed and "MiB/hour" in printed
