"""`llmserve bench plot`: TTFT (p50, p99) and output tokens/s against concurrency.

One line per result file (one server each), so several `bench serve --output-json` files
compare side by side. matplotlib comes with the `bench` extra.
"""

import json
from pathlib import Path
from typing import Any

from llmserve.errors import LLMServeError


def load_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise LLMServeError(f"cannot read {path}: {e}") from None
    if not isinstance(report, dict) or not report.get("runs"):
        raise LLMServeError(f"{path} is not a `llmserve bench serve` result (no runs)")
    return report


def plot_reports(paths: list[Path], output: Path) -> None:
    """Two panels (TTFT; output tokens/s) against concurrency, one line per file."""
    try:
        import matplotlib
    except ImportError:
        raise LLMServeError("plotting needs matplotlib: pip install 'llmserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    ticks: set[int] = set()
    for path in paths:
        report = load_report(path)
        label = report.get("label") or path.stem
        runs = sorted(report["runs"], key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in runs]
        ticks.update(x)
        line, = ax_ttft.plot(x, [r["p50_ttft_ms"] / 1000 for r in runs], "o-",
                             label=f"{label} p50")
        ax_ttft.plot(x, [r["p99_ttft_ms"] / 1000 for r in runs], "s--", color=line.get_color(),
                     label=f"{label} p99")
        ax_tput.plot(x, [r["output_throughput"] for r in runs], "o-", label=label)
    for ax, title, unit in ((ax_ttft, "Time to first token", "seconds"),
                            (ax_tput, "Output throughput", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, output)


def save_figure(fig: Any, output: Path) -> None:
    """Lay out, write and close a matplotlib figure; an unwritable path is an LLMServeError."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(output, dpi=110)
    except OSError as e:
        raise LLMServeError(f"cannot write {output}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
