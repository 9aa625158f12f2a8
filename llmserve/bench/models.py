"""`llmserve bench models`: what serving several models behind one endpoint costs.

Two figures, side by side in one run:

* **A request for a model not loaded**, to its first token: each model of the folder in turn
  on a fresh `llmserve serve --models-dir` (none loaded), a streamed completion timed from
  its sending to its first token (the model's engine started and loaded in between).
* **The cost of routing**: the first model served alone (`llmserve serve --model FILE`) and
  the same model loaded behind the many-model server, both running, measured in turn at 1
  and at 16 concurrent streams `--repeats` times (each repeat's prompts new to both
  servers, so neither answers from its prefix cache); the TTFT p50 and the output tokens a
  second of each, and the routed figure over the alone one per repeat (median).
"""

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from llmserve.bench.serve import ServeBenchConfig, run_serve_bench
from llmserve.bench.soak import ServerProcess
from llmserve.errors import LLMServeError

STREAMS = (1, 16)
COLD_PROMPT = "The capital of France is"


@dataclass(frozen=True)
class ModelsBenchConfig:
    models: tuple[str, ...]  # catalog names or files; the first is measured routed vs alone
    server_args: tuple[str, ...] = ()
    repeats: int = 3
    prompts_per_stream: int = 4  # requests a level sends: this many per stream
    input_len: int = 128
    output_len: int = 64

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("bench models needs at least one --model")
        if self.repeats < 1 or self.prompts_per_stream < 1:
            raise ValueError("--repeats and --prompts-per-stream must be at least 1")


def model_file(spec: str) -> Path:
    """A catalog name's cached file (fetched if missing), or the file or folder given."""
    from llmserve.loader.catalog import resolve_model

    return Path(resolve_model(spec).path)


def models_folder(files: list[Path], root: Path) -> list[str]:
    """A --models-dir at `root` with a link to each file; the names the server gives them."""
    names = []
    for path in files:
        link = root / path.name
        if link.exists():
            raise LLMServeError(f"two models are named {path.name}")
        link.symlink_to(path.resolve())
        names.append(path.stem if path.is_file() else path.name)
    return names


def first_token_s(url: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": model, "prompt": COLD_PROMPT, "max_tokens": 8, "stream": True,
            "temperature": 0}
    start = time.monotonic()
    with httpx.Client(timeout=900) as http, http.stream(
            "POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise LLMServeError(f"{model}: {response.status_code} {response.read()!r}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                return time.monotonic() - start
    raise LLMServeError(f"{model}: no token came back")


def one_level(url: str, model: str, tokenizer: Path, streams: int, seed: int,
              config: ModelsBenchConfig) -> dict[str, float]:
    bench = ServeBenchConfig(url, model, concurrencies=(streams,),
                             num_prompts=streams * config.prompts_per_stream,
                             input_len=config.input_len, output_len=config.output_len,
                             tokenizer_model=str(tokenizer), seed=seed,
                             label=f"{streams} streams")
    run = run_serve_bench(bench, use_tqdm=False)["runs"][0]
    return {"ttft_p50_ms": run["p50_ttft_ms"], "tok_s": run["output_throughput"]}


def run_models_bench(config: ModelsBenchConfig) -> dict[str, Any]:
    files = [model_file(spec) for spec in config.models]
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-models-") as root:
        names = models_folder(files, Path(root))
        cold = _cold_starts(Path(root), names, config)
        routing = _routing(Path(root), files[0], names[0], config)
    return {"config": {"models": [str(f) for f in files], "names": names,
                       "server_args": list(config.server_args), "repeats": config.repeats,
                       "prompts_per_stream": config.prompts_per_stream,
                       "input_len": config.input_len, "output_len": config.output_len},
            "cold_first_token_s": cold, "routing": routing}


def _cold_starts(root: Path, names: list[str], config: ModelsBenchConfig
                 ) -> dict[str, float]:
    server = ServerProcess(None, ("--models-dir", str(root), "--max-loaded-models",
                                  str(len(names)), *config.server_args))
    try:
        url = server.wait_until_serving()
        return {name: first_token_s(url, name) for name in names}
    finally:
        server.stop()


def _routing(root: Path, file: Path, name: str, config: ModelsBenchConfig
             ) -> dict[str, Any]:
    alone = ServerProcess(str(file), ("--served-model-name", name, *config.server_args))
    routed = ServerProcess(None, ("--models-dir", str(root), "--pin", name,
                                  *config.server_args))
    try:
        urls = {"alone": alone.wait_until_serving(), "routed": routed.wait_until_serving()}
        runs: dict[str, dict[int, list[dict[str, float]]]] = {
            kind: {s: [] for s in STREAMS} for kind in urls}
        for repeat in range(config.repeats + 1):  # the first: both servers' warm-up
            for streams in STREAMS:
                for kind, url in urls.items():
                    figures = one_level(url, name, file, streams, repeat, config)
                    if repeat > 0:
                        runs[kind][streams].append(figures)
    finally:
        routed.stop()
        alone.stop()
    return {str(s): _compared(runs["alone"][s], runs["routed"][s]) for s in STREAMS}


def _compared(alone: list[dict[str, float]], routed: list[dict[str, float]]
              ) -> dict[str, Any]:
    out: dict[str, Any] = {"alone": alone, "routed": routed}
    for key in ("ttft_p50_ms", "tok_s"):
        ratios = [r[key] / a[key] for a, r in zip(alone, routed, strict=True) if a[key]]
        out[key] = {"alone": statistics.median(a[key] for a in alone),
                    "routed": statistics.median(r[key] for r in routed),
                    "ratio": statistics.median(ratios) if ratios else None,
                    "ratios": ratios}
    return out


def format_models_bench(report: dict[str, Any]) -> str:
    names = report["config"]["names"]
    lines = ["A request for a model not loaded, to its first token (streamed completion):"]
    for name in names:
        lines.append(f"  {name:<40} {report['cold_first_token_s'][name]:7.2f} s")
    lines.append(f"\nRouting cost: {names[0]} alone vs loaded behind the many-model server "
                 f"(median of {report['config']['repeats']} repeats; ratio routed/alone "
                 "per repeat, median):")
    lines.append(f"  {'streams':>7}  {'measure':<14}{'alone':>10}{'routed':>10}{'ratio':>8}"
                 f"  runs")
    for streams, row in report["routing"].items():
        for key, label in (("ttft_p50_ms", "TTFT p50 ms"), ("tok_s", "output tok/s")):
            figure = row[key]
            runs = " ".join(f"{r:.3f}" for r in figure["ratios"])
            ratio = "-" if figure["ratio"] is None else f"{figure['ratio']:.3f}"
            lines.append(f"  {streams:>7}  {label:<14}{figure['alone']:>10.1f}"
                         f"{figure['routed']:>10.1f}{ratio:>8}  {runs}")
    return "\n".join(lines)
