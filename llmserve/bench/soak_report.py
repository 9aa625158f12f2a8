"""`bench soak`'s numbers from its samples: the RSS trend, the run's totals, the summary
text and the plot. Pure but for the plot's file; the samples are those `soak.py` takes.

A sample (one every `--sample-interval`)::

    {"t_s": 130.0, "phase": "load" | "finishing" | "end", "rss_mib": 812.5,
     "num_server_processes": 1, "load_1m": 2.4, "kv_usage": 0.31, "running": 32,
     "waiting": 0, "requests": {"sent", "completed", "disconnected", "errors"} (so far),
     "window": {"completed", "output_tokens", "ttft_ms", "tpot_ms", "e2el_ms"}}

"load": the clients were sending; "finishing": past the duration, the last requests
running out; "end": once the server reported nothing running or waiting.
"""

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmserve.bench.plot import save_figure
from llmserve.bench.stats import PERCENTILES, distribution_ms
from llmserve.errors import LLMServeError

KV_IDLE_TOLERANCE = 0.005  # KV usage at the end at or below this counts as "back to ~0"
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2E"))


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Slope of the least-squares line through (xs, ys); None with fewer than two
    distinct xs."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs but {len(ys)} ys")
    n = len(xs)
    if n < 2:
        return None
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx


def rss_trend(samples: Sequence[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """RSS slope in MiB per hour over the load phase after `warmup_s`, and over its second
    half (what a server settles to once caches and lazily touched memory, such as KV-cache
    pages written for the first time, have filled), with the RSS at the start and end of
    the fit and the maximum; None fields where RSS was not sampled."""
    points = _rss_points(samples, warmup_s)
    half = _rss_points(samples, max(warmup_s, _load_end_s(samples) / 2))
    all_rss = [s["rss_mib"] for s in samples if s["rss_mib"] is not None]
    return {
        "rss_slope_mib_per_hour": _slope_per_hour(points),
        "rss_slope_last_half_mib_per_hour": _slope_per_hour(half),
        "rss_fit_points": len(points),
        "rss_after_warmup_mib": points[0][1] if points else None,
        "rss_end_of_load_mib": points[-1][1] if points else None,
        "rss_max_mib": max(all_rss) if all_rss else None,
    }


def _rss_points(samples: Sequence[dict[str, Any]], from_s: float) -> list[tuple[float, float]]:
    """(t_s, rss_mib) of the load phase's samples from `from_s` on."""
    return [(s["t_s"], s["rss_mib"]) for s in samples
            if s["phase"] == "load" and s["t_s"] >= from_s and s["rss_mib"] is not None]


def _load_end_s(samples: Sequence[dict[str, Any]]) -> float:
    return max((s["t_s"] for s in samples if s["phase"] == "load"), default=0.0)


def _slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    return least_squares_slope([t / 3600 for t, _ in points], [m for _, m in points])


def summarize_soak(samples: Sequence[dict[str, Any]], latencies: dict[str, list[float]],
                   errors: dict[str, int], aborts_on_server: int | None,
                   warmup_s: float) -> dict[str, Any]:
    """The run's summary: request totals, RSS trend, KV usage at the end, load, and the
    latency distributions (ms) over every completed request (`latencies`: seconds)."""
    last = samples[-1]
    kv_end = last["kv_usage"]
    loads = [s["load_1m"] for s in samples if s["phase"] != "end" and s["load_1m"] is not None]
    return {
        **last["requests"],
        "errors_by_message": dict(errors),
        "server_aborts": aborts_on_server,
        **rss_trend(samples, warmup_s),
        "kv_usage_end": kv_end,
        "kv_returned_to_zero": kv_end is not None and kv_end <= KV_IDLE_TOLERANCE,
        "load_1m_mean": sum(loads) / len(loads) if loads else None,
        "load_1m_max": max(loads) if loads else None,
        **{name: latency_ms(latencies.get(name, [])) for name, _ in LATENCIES},
    }


def latency_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean and percentiles (ms) of `values` (seconds); None, not NaN, where there are no
    values (JSON has no NaN)."""
    return {k: None if math.isnan(v) else v for k, v in distribution_ms(values).items()}


# ---- text ----------------------------------------------------------------------------------


def format_sample(s: dict[str, Any]) -> str:
    """One progress line per sample."""
    r, w = s["requests"], s["window"]
    rss = "n/a" if s["rss_mib"] is None else f"{s['rss_mib']:.1f} MiB"
    kv = "n/a" if s["kv_usage"] is None else f"{100 * s['kv_usage']:.1f} %"
    load = "n/a" if s["load_1m"] is None else f"{s['load_1m']:.2f}"
    return (f"[{s['t_s']:>7.0f} s {s['phase']:>9}] RSS {rss}  KV {kv}  run {s['running']} "
            f"wait {s['waiting']}  load {load}  done {r['completed']} cut "
            f"{r['disconnected']} err {r['errors']}  TTFT p50 {_ms(w['ttft_ms']['p50'])}  "
            f"TPOT p50 {_ms(w['tpot_ms']['p50'])}")


def format_soak(report: dict[str, Any]) -> str:
    """The end-of-run summary: totals, RSS slope, KV at the end, load, latencies over
    the whole run and by time."""
    c, s = report["config"], report["summary"]
    slope = s["rss_slope_mib_per_hour"]
    lines = [
        f"soak: {c['duration_s']:g} s of load at {c['concurrency']} streams "
        f"({100 * c['disconnect_fraction']:g} % cut mid-stream), {report['elapsed_s']:.0f} s "
        f"until the last request ended, against {report['server']['url']} "
        f"({report['server']['model']})",
        f"requests: {s['sent']} sent, {s['completed']} completed, {s['disconnected']} "
        f"disconnected (server aborts: {_or_na(s['server_aborts'])}), {s['errors']} errors",
    ]
    lines += [f"  error x{n}: {message}" for message, n in s["errors_by_message"].items()]
    if slope is None:
        lines.append("RSS: not sampled (start the server here, or give --server-pid)"
                     if s["rss_max_mib"] is None else "RSS: too few samples after the warm-up "
                     "for a slope")
    else:
        lines.append(
            f"RSS: {s['rss_after_warmup_mib']:.1f} MiB after the warm-up -> "
            f"{s['rss_end_of_load_mib']:.1f} MiB at the end of the load (max "
            f"{s['rss_max_mib']:.1f}); slope {slope:+.2f} MiB/hour (least squares over "
            f"{s['rss_fit_points']} samples after the first {c['warmup_s']:g} s), "
            f"{_slope(s['rss_slope_last_half_mib_per_hour'])} over the second half")
    kv = s["kv_usage_end"]
    lines.append("KV usage at the end: n/a" if kv is None else
                 f"KV usage at the end: {100 * kv:.2f} % (back to ~0: "
                 f"{'yes' if s['kv_returned_to_zero'] else 'NO'})")
    if s["load_1m_mean"] is not None:
        lines.append(f"load average (1 min): mean {s['load_1m_mean']:.2f}, max "
                     f"{s['load_1m_max']:.2f}")
    header = "".join(f"{f'{title} p{q}':>11}" for _, title in LATENCIES for q in PERCENTILES)
    lines += ["latency (ms), completed requests:", f"{'':>10}{header}",
              f"{'whole run':>10}" + _latency_row(s)]
    for sample in report["samples"]:
        if sample["window"]["completed"]:
            lines.append(f"{sample['t_s']:>8.0f} s" + _latency_row(sample["window"]))
    return "\n".join(lines)


def _latency_row(d: dict[str, Any]) -> str:
    return "".join(f"{_ms(d[name][f'p{q}']):>11}" for name, _ in LATENCIES for q in PERCENTILES)


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0f}"


def _slope(mib_per_hour: float | None) -> str:
    return "n/a" if mib_per_hour is None else f"{mib_per_hour:+.2f} MiB/hour"


def _seconds(ms: float | None) -> float:
    return math.nan if ms is None else ms / 1000


def _or_na(value: object) -> str:
    return "n/a" if value is None else str(value)


# ---- plot ----------------------------------------------------------------------------------


def plot_soak(report: dict[str, Any], output: Path) -> None:
    """Four panels against time: RSS with its fitted line; KV usage and running/waiting;
    TTFT/TPOT/E2E p50 and p99 per window; load average and completions per window."""
    try:
        import matplotlib
    except ImportError:
        raise LLMServeError("plotting needs matplotlib: pip install 'llmserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, summary = report["samples"], report["summary"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    (ax_rss, ax_kv), (ax_lat, ax_load) = axes
    ax_rss.plot(minutes, [s["rss_mib"] for s in samples], ".-", label="server RSS")
    _plot_fit(ax_rss, samples, summary, report["config"]["warmup_s"])
    ax_rss.set(title="Server resident memory", ylabel="MiB")
    ax_kv.plot(minutes, [100 * (s["kv_usage"] or 0) for s in samples], ".-", label="KV usage %")
    ax_kv.plot(minutes, [s["running"] for s in samples], label="running")
    ax_kv.plot(minutes, [s["waiting"] for s in samples], label="waiting")
    ax_kv.set(title="KV cache and queue", ylabel="% / requests")
    for name, title in LATENCIES:
        for q, style in ((50, ".-"), (99, ".--")):
            line = [_seconds(s["window"][name][f"p{q}"]) for s in samples]
            ax_lat.plot(minutes, line, style, label=f"{title} p{q}")
    ax_lat.set(title="Latency of the requests completed per window", ylabel="seconds",
               yscale="log", xlabel="minutes")
    ax_load.plot(minutes, [s["load_1m"] for s in samples], label="load average (1 min)")
    twin = ax_load.twinx()
    twin.plot(minutes, [s["window"]["completed"] for s in samples], color="tab:green",
              alpha=0.6, label="completed per window")
    twin.set_ylabel("requests")
    twin.legend(fontsize=8, loc="lower right")
    ax_load.set(title="Machine load and completions", ylabel="load", xlabel="minutes")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, output)


def _plot_fit(ax: Any, samples: Sequence[dict[str, Any]], summary: dict[str, Any],
              warmup_s: float) -> None:
    """The fitted lines: after the warm-up, and over the second half of the load."""
    half_s = max(warmup_s, _load_end_s(samples) / 2)
    for from_s, key, style, what in (
            (warmup_s, "rss_slope_mib_per_hour", "k--", "after warm-up"),
            (half_s, "rss_slope_last_half_mib_per_hour", "r:", "second half")):
        points, slope = _rss_points(samples, from_s), summary.get(key)
        if slope is None or not points:
            continue
        mean_t = sum(t for t, _ in points) / len(points)
        mean_m = sum(m for _, m in points) / len(points)
        ends = [points[0][0], points[-1][0]]
        ax.plot([t / 60 for t in ends], [mean_m + slope * (t - mean_t) / 3600 for t in ends],
                style, linewidth=2, label=f"fit {what}: {slope:+.1f} MiB/h")
