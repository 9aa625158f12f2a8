"""`llmserve bench startup`: what a user gets from each way of installing and first starting
llmserve, side by side in one run.

For every model, every install and every kind of first start, one row:

* installs: this one (an editable install: a C++ compiler builds the kernels it lacks) and,
  with `--wheel-dir`, the package built as a wheel and installed in a fresh virtual
  environment there, run with no compiler on PATH (`CXX` empty), as a user without build
  tools runs it;
* first starts: on the quiet machine, and beside `--busy` spinning processes (the machine
  busy installing or compiling), killed once the server is healthy.

Each row starts `llmserve serve` on a cache of its own (the models and built kernels of this
machine's cache linked in, no cached kernel decisions or kept weights: a first start) and
takes the time to healthy and the format "auto" picked (and why, from the log). The quiet
and the busy first start of a model and install are kept serving together and their
streamed output tokens a second measured in turn, at 1 and at 32 concurrent streams,
`--repeats` times; then each is started again for the warm start's time (as often). A
busy row's speed is set against the quiet row's run by run (the first run, the fresh
server's warm-up, left out), with the runs' spread as the noise. The same format in every row,
at the same speed within noise, is what the busy-machine-proof choice and the shipped
kernels promise.
"""

import os
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmserve import cpu_info
from llmserve.bench.serve import ServeBenchConfig, run_serve_bench
from llmserve.bench.soak import ServerProcess
from llmserve.config.paths import cache_root
from llmserve.errors import LLMServeError

CHOICE_LINE = re.compile(r"auto runs .*")
QUIET_CORES = 0.3  # the machine counts as quiet below this many busy cores (a second's)
QUIET_WAIT_S = 180.0
NATIVE_LINE = re.compile(r"native CPU kernels (loaded: .*|unavailable.*)")
FIRST_START_EXCLUDES = ("kernels", "weights")  # decisions, kept weights: a first has none


@dataclass(frozen=True)
class Install:
    label: str
    python: str
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment


@dataclass(frozen=True)
class StartupConfig:
    models: tuple[str, ...]
    installs: tuple[Install, ...]
    busy: int = 4  # spinning processes beside a busy first start
    server_args: tuple[str, ...] = ()
    single_prompts: int = 8  # requests at one stream
    repeats: int = 3  # speed runs (1 and 32 streams, in turn) and warm starts per row
    input_len: int = 128
    output_len: int = 64


def this_install() -> Install:
    return Install("this install (C++ compiler present)", sys.executable)


def wheel_install(directory: Path) -> Install:
    """The package built as a wheel from this (editable) install's source tree and installed
    in a virtual environment at `directory` (made once; reused when there); the test and
    bench dependencies come from this interpreter's site-packages. Run with no compiler."""
    venv = directory / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        source = Path(__file__).resolve().parents[2]
        if not (source / "setup.py").exists():
            raise LLMServeError(f"--wheel-dir builds the wheel from the source tree; {source} "
                                "is not one (an installed wheel: pass its venv's python)")
        dist = directory / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w",
                        str(dist), str(source)], check=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                               "get_paths()['purelib'])"], check=True, capture_output=True,
                              text=True).stdout.strip()
        Path(site, "llmserve-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        wheel = next(dist.glob("llmserve-*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                        "--quiet", "--no-deps", str(wheel)], check=True)
    return Install("wheel, no compiler", str(python),
                   {"PATH": str(venv / "bin"), "CXX": "", "PYTHONPATH": ""})


def first_start_cache(root: Path) -> Path:
    """A cache folder at `root` with this machine's models and kernel libraries linked in,
    no kernel decisions and no kept weights: a server started on it decides and loads
    afresh."""
    root.mkdir(parents=True)
    for entry in cache_root().iterdir():
        if entry.name not in FIRST_START_EXCLUDES:
            (root / entry.name).symlink_to(entry)
    (root / "kernels").mkdir()
    suffixes = (".so", ".dylib")
    for library in (cache_root() / "kernels").glob("cpu_kernels-*"):
        if library.suffix in suffixes:
            (root / "kernels" / library.name).symlink_to(library)
    return root


def spin(count: int) -> list[subprocess.Popen]:
    """`count` processes each keeping a core busy."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.send_signal(signal.SIGKILL)
        process.wait()


def started(install: Install, model: str, cache: Path, server_args: tuple[str, ...]
            ) -> tuple[ServerProcess, str, float]:
    env = {**install.env, "LLMSERVE_CACHE": str(cache)}
    start = time.monotonic()
    server = ServerProcess(model, server_args, python=install.python, env=env)
    url = server.wait_until_serving()
    return server, url, time.monotonic() - start


def tokens_per_second(url: str, model: str, concurrency: int, prompts: int,
                      config: StartupConfig) -> float:
    bench = ServeBenchConfig(url, model, concurrencies=(concurrency,), num_prompts=prompts,
                             input_len=config.input_len, output_len=config.output_len,
                             label=f"{concurrency} streams")
    return run_serve_bench(bench, use_tqdm=False)["runs"][0]["output_throughput"]


def machine_cores_busy(seconds: float = 1.0) -> float | None:
    """The cores the whole machine kept busy over the next `seconds` (None: unknown)."""
    before = cpu_info.busy_cpu_seconds()
    time.sleep(seconds)
    after = cpu_info.busy_cpu_seconds()
    return None if before is None or after is None else (after - before) / seconds


def wait_until_quiet(limit_s: float = QUIET_WAIT_S) -> float | None:
    """Waits (up to `limit_s`) until the machine keeps under QUIET_CORES busy for a second
    and its 1-minute load average is under half its cores (a start judges the machine busy
    above its cores, and the average lags a busy row by a minute or two); the last second's
    busy cores."""
    deadline = time.monotonic() + limit_s
    cores = os.cpu_count() or 1
    while True:
        busy = machine_cores_busy()
        quiet = (busy is None or busy < QUIET_CORES) and os.getloadavg()[0] < cores / 2
        if quiet or time.monotonic() >= deadline:
            return busy


@dataclass
class FirstStart:
    """A server as one first start left it, and what that start took."""

    busy: bool
    cache: Path
    server: ServerProcess
    url: str
    seconds: float
    load_before: float
    cores_busy_before: float | None
    single: list[float] = field(default_factory=list)
    many: list[float] = field(default_factory=list)


def first_start(install: Install, model: str, busy: bool, config: StartupConfig,
                scratch: Path) -> FirstStart:
    """A first start on a cache of its own, on the quiet machine or beside the spinners
    (stopped once it serves)."""
    cache = first_start_cache(scratch / f"cache-{len(list(scratch.iterdir()))}")
    quiet_before = wait_until_quiet()
    load_before = os.getloadavg()[0]
    spinners = spin(config.busy) if busy else []
    try:
        server, url, seconds = started(install, model, cache, config.server_args)
    finally:
        stop(spinners)
    return FirstStart(busy, cache, server, url, seconds, load_before, quiet_before)


def run_pair(install: Install, model: str, config: StartupConfig,
             scratch: Path) -> list[dict[str, Any]]:
    """The quiet and the busy first start of `model` from `install`, both servers kept
    until their speed is measured in turn (1 stream on each, then 32 streams on each, each
    repeat): the machine's own drift (a VM slower by a third for minutes) lands on both
    alike. Then each cache's warm starts. One row each."""
    starts: list[FirstStart] = []
    try:
        for busy in (False, True):
            starts.append(first_start(install, model, busy, config, scratch))
        quiet_after_start = wait_until_quiet()  # the spinners gone before the speed runs
        start_busy = cpu_info.busy_cpu_seconds()
        start_wall = time.monotonic()
        for _ in range(config.repeats):
            for start in starts:
                start.single.append(tokens_per_second(
                    start.url, start.server.model_name or model, 1, config.single_prompts,
                    config))
            for start in starts:
                start.many.append(tokens_per_second(
                    start.url, start.server.model_name or model, 32, 32, config))
        speed_busy = (None if start_busy is None else (cpu_info.busy_cpu_seconds() - start_busy)
                      / (time.monotonic() - start_wall))
    finally:
        for start in starts:
            start.server.stop()
    return [_row(install, model, start, config, quiet_after_start, speed_busy)
            for start in starts]


def _row(install: Install, model: str, start: FirstStart, config: StartupConfig,
         quiet_after_start: float | None, speed_busy: float | None) -> dict[str, Any]:
    log = "\n".join(start.server.startup_log)
    choice = CHOICE_LINE.search(log)
    native = NATIVE_LINE.search(log)
    warm_s = []
    for _ in range(config.repeats):
        warm, _, seconds = started(install, model, start.cache, config.server_args)
        warm_log = "\n".join(warm.startup_log)
        warm.stop()
        warm_s.append(seconds)
    warm_choice = CHOICE_LINE.search(warm_log)
    busy = start.busy
    return {"model": model, "install": install.label, "first_start": "busy" if busy else "quiet",
            "busy_processes": config.busy if busy else 0, "load_average_before": start.load_before,
            "cores_busy_before": start.cores_busy_before,
            "cores_busy_before_speed": quiet_after_start,
            "cores_busy_during_speed": speed_busy,
            "choice": choice.group(0) if choice else None,
            "format": _format(choice.group(0)) if choice else None,
            "kernels": native.group(0) if native else None,
            "first_start_s": start.seconds, "warm_start_s": statistics.median(warm_s),
            "warm_start_runs": warm_s,
            "warm_choice": warm_choice.group(0) if warm_choice else None,
            "tok_s_1": statistics.median(judged(start.single)), "tok_s_1_runs": start.single,
            "tok_s_32": statistics.median(judged(start.many)), "tok_s_32_runs": start.many}


def judged(runs: list[float]) -> list[float]:
    """The runs a row's speed is judged on: all but the first, the fresh server's warm-up
    (its first requests ran at 0.5-0.7x the later ones' speed in every row measured),
    where there are more."""
    return runs[1:] if len(runs) > 1 else runs


def spread(runs: list[float]) -> float:
    """How far a row's judged runs lie apart: (largest - smallest) / median."""
    runs = judged(runs)
    return (max(runs) - min(runs)) / statistics.median(runs) if len(runs) > 1 else 0.0


def same_speed(quiet: dict[str, Any], busy: dict[str, Any]) -> list[str]:
    """Per stream count, the busy-started server's speed against the quiet-started one's,
    run by run (the two measured in turn): the median ratio, and whether the gap lies
    within the noise: the ratios fall on both sides of 1, or the gap is within the larger
    of the two rows' spreads (fewer than two judged runs: no verdict)."""
    lines = []
    for key, label in (("tok_s_1", "1 stream"), ("tok_s_32", "32 streams")):
        pairs = list(zip(judged(quiet.get(f"{key}_runs", [])),
                         judged(busy.get(f"{key}_runs", [])), strict=False))
        if len(pairs) < 2:
            lines.append(f"{label} {busy[key] / quiet[key]:.2f}x: too few runs for a verdict")
            continue
        ratios = [b / q for q, b in pairs]
        ratio = statistics.median(ratios)
        noise = max(spread(quiet[f"{key}_runs"]), spread(busy[f"{key}_runs"]))
        within = min(ratios) <= 1 <= max(ratios) or abs(ratio - 1) <= noise
        lines.append(f"{label} {ratio:.2f}x (runs {min(ratios):.2f}-{max(ratios):.2f}x; "
                     f"runs' spread {noise:.0%}): "
                     + ("the same speed within noise" if within
                        else "**a different speed**: outside the noise"))
    return lines


def _format(choice: str) -> str:
    return choice.removeprefix("auto runs ").split()[0].rstrip(":;,")


def run_startup(config: StartupConfig) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmserve-startup-") as tmp:
        for model in config.models:
            for install in config.installs:
                for row in run_pair(install, model, config, Path(tmp)):
                    rows.append(row)
                    print(format_row(row), flush=True)
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows,
            "config": {"busy": config.busy, "single_prompts": config.single_prompts,
                       "repeats": config.repeats,
                       "input_len": config.input_len, "output_len": config.output_len,
                       "server_args": list(config.server_args)}}


HEADER = (f"{'model':<28}{'install':<38}{'first start':<13}{'format':<9}{'first s':>8}"
          f"{'warm s':>8}{'1 stream':>10}{'32 streams':>11}")


def format_row(row: dict[str, Any]) -> str:
    return (f"{Path(row['model']).name[:27]:<28}{row['install'][:37]:<38}"
            f"{row['first_start']:<13}{row['format'] or '-':<9}{row['first_start_s']:>8.1f}"
            f"{row['warm_start_s']:>8.1f}{row['tok_s_1']:>10.1f}{row['tok_s_32']:>11.1f}")


def format_startup(report: dict[str, Any]) -> str:
    lines = [HEADER, *map(format_row, report["rows"]),
             "(seconds to healthy, warm the median of the row's starts; output tokens a "
             "second, streamed, the median of the row's runs after the first, the fresh "
             "server's warm-up)", "",
             "a busy first start against a quiet one (same model and install), speed by "
             "speed:"]
    rows = report["rows"]
    for quiet, busy in zip(rows, rows[1:], strict=False):
        if (quiet["first_start"], busy["first_start"]) == ("quiet", "busy") and \
                (quiet["model"], quiet["install"]) == (busy["model"], busy["install"]):
            same_format = "same format" if quiet["format"] == busy["format"] else \
                f"**another format** ({quiet['format']} vs {busy['format']})"
            lines.append(f"  {Path(quiet['model']).name} / {quiet['install']}: {same_format}; "
                         + "; ".join(same_speed(quiet, busy)))
    lines += ["", "why, per row:"]
    for row in report["rows"]:
        during = row.get("cores_busy_during_speed")
        lines.append(f"  {Path(row['model']).name} / {row['install']} / {row['first_start']}: "
                     f"{row['kernels'] or 'no native kernels line'}; {row['choice']}; "
                     f"machine busy during the speed runs: "
                     f"{'unknown' if during is None else f'{during:.2f} cores'} "
                     "(the server and the client included)")
    return "\n".join(lines)
