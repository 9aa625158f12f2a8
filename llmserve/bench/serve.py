"""`llmserve bench serve`: load-test any OpenAI-compatible server over streaming HTTP.

One asyncio loop drives every request (the client must not steal CPU from a server on the
same machine). Each request streams (SSE) and the time of every token-bearing chunk is kept;
`stats.summarize` turns the timelines into TTFT / TPOT / ITL / E2E and throughputs. Load is
a fixed concurrency (a semaphore) or Poisson arrivals at `--request-rate` with gamma
`--burstiness` (1 = Poisson; < 1 burstier), capped by the concurrency; several
concurrencies make a sweep, and every level gets fresh prompts (its own seed; the warm-up
request its own too), so no level runs on prefixes an earlier one left in the server's
cache. Token counts are exact where the server allows: prompts encode to `input_len` tokens
and requests ask for `max_tokens = min_tokens = output_len` with `ignore_eos`.
"""

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm.auto import tqdm

from llmserve.bench.machine import format_machine, machine_info
from llmserve.bench.stats import SLO, RequestRecord, summarize
from llmserve.bench.workloads import (
    BenchRequest,
    LocalTokenizer,
    PromptTokenizer,
    ServerTokenizer,
    jsonl_workload,
    random_workload,
    shared_prefix_workload,
)
from llmserve.errors import LLMServeError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
WORKLOADS = ("random", "shared-prefix", "jsonl")
# --structured: what every request of the run is constrained to (as users send it: OpenAI's
# response_format, or vLLM's structured_outputs); the outputs can be long, so that the
# comparison with free text covers many constrained tokens per request
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40},
                           "count": {"type": "integer", "minimum": 0},
                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
            "required": ["name", "count", "tags"]}},
    },
    "required": ["title", "items"],
}
STRUCTURED = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "inventory", "schema": STRUCTURED_SCHEMA, "strict": True}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"structured_outputs": {"regex": r"(([a-z]{1,12} ){1,20}[a-z]{1,12}\. )+"}},
    "choice": {"structured_outputs": {"choice": ["yes", "no", "it depends"]}},
}
_WARMUP_TOKENS = 4


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str
    model: str
    concurrencies: tuple[int, ...] = (1,)
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    workload: str = "random"
    dataset: str | None = None
    shared_prefix_len: int = 512
    slo: SLO = SLO()
    api_key: str | None = None
    endpoint: str = "completions"
    tokenizer_model: str | None = None
    label: str | None = None
    seed: int = 0
    structured: str | None = None  # a key of STRUCTURED

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", self.base_url.rstrip("/").removesuffix("/v1"))
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError("--concurrency takes positive integers, e.g. 1,4,16")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("--request-rate and --burstiness must be positive")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}")
        if self.workload == "jsonl" and not self.dataset:
            raise ValueError("--workload jsonl needs --dataset FILE.jsonl")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        if self.structured is not None and self.structured not in STRUCTURED:
            raise ValueError(f"--structured must be one of {', '.join(STRUCTURED)}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return data


def run_serve_bench(config: ServeBenchConfig, use_tqdm: bool = True) -> dict[str, Any]:
    """Build the prompts, warm the server up, run every concurrency; the JSON report."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    with httpx.Client(base_url=config.base_url, headers=headers, timeout=60) as client:
        tokenizer = pick_tokenizer(config, client)
        warmup_request = random_workload(tokenizer, 1, config.input_len, config.output_len,
                                         level_seed(config.seed, None))[0]
        levels = [build_workload(config, tokenizer, level)
                  for level in range(len(config.concurrencies))]
    warmup, runs = asyncio.run(_run_all(config, warmup_request, levels, headers, use_tqdm))
    return {"label": config.label or config.base_url, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": machine_info(), "config": config.to_dict(), "warmup": warmup.to_dict(),
            "runs": runs}


def pick_tokenizer(config: ServeBenchConfig, client: httpx.Client) -> PromptTokenizer:
    """Prompts are built with, in order: `--tokenizer-model`; the model's own tokenizer when
    `--model` is a catalog name or a local file or folder; the server's /tokenize."""
    if config.tokenizer_model is not None:
        return LocalTokenizer(config.tokenizer_model)
    if LocalTokenizer.can_load(config.model):
        return LocalTokenizer(config.model)
    server = ServerTokenizer.probe(client, config.model)
    if server is None:
        raise LLMServeError(f"{config.base_url} has no /tokenize llmserve understands and "
                            f"{config.model!r} is not a model llmserve knows; pass "
                            "--tokenizer-model (a catalog name, .gguf file or Hugging Face "
                            "folder)")
    return server


def level_seed(seed: int, level: int | None) -> int:
    """The prompt seed of sweep level `level` (0, 1, ...); None: the warm-up request's."""
    return seed * 1_000_003 + (0 if level is None else level + 1)


def build_workload(config: ServeBenchConfig, tokenizer: PromptTokenizer,
                   level: int = 0) -> list[BenchRequest]:
    """The requests of sweep level `level`: prompts of its own, none shared with another
    level (jsonl: the next `num_prompts` lines of the file)."""
    c = config
    seed = level_seed(c.seed, level)
    if c.workload == "shared-prefix":  # each level pays for its own prefix once
        return shared_prefix_workload(tokenizer, c.num_prompts, c.shared_prefix_len,
                                      c.input_len, c.output_len, seed)
    if c.workload == "jsonl":
        return jsonl_workload(Path(c.dataset), tokenizer, c.num_prompts, c.output_len,
                              offset=level * c.num_prompts)
    return random_workload(tokenizer, c.num_prompts, c.input_len, c.output_len, seed)


async def _run_all(config: ServeBenchConfig, warmup_request: BenchRequest,
                   levels: list[list[BenchRequest]], headers: dict[str, str],
                   use_tqdm: bool) -> tuple[RequestRecord, list[dict[str, Any]]]:
    limits = httpx.Limits(max_connections=max(config.concurrencies),
                          max_keepalive_connections=max(config.concurrencies))
    timeout = httpx.Timeout(connect=10, read=None, write=30, pool=None)
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits,
                                 timeout=timeout) as client:
        warmup = await _warm_up(client, config, warmup_request)
        runs = []
        for level, (concurrency, requests) in enumerate(zip(config.concurrencies, levels,
                                                             strict=True)):
            run = await run_load(client, config, requests, concurrency, use_tqdm)
            runs.append({**run, "seed": level_seed(config.seed, level)})
            print(format_run(runs[-1]), file=sys.stderr)
        return warmup, runs


async def _warm_up(client: httpx.AsyncClient, config: ServeBenchConfig,
                   request: BenchRequest) -> RequestRecord:
    """One short request: checks the server answers and warms its code paths."""
    short = BenchRequest(request.prompt, request.prompt_len, min(_WARMUP_TOKENS,
                                                                 request.output_len))
    record = await send_request(client, config, short)
    if not record.success:
        raise LLMServeError(f"warm-up request to {config.base_url} failed: {record.error}")
    return record


async def run_load(client: httpx.AsyncClient, config: ServeBenchConfig,
                   requests: list[BenchRequest], concurrency: int,
                   use_tqdm: bool = True) -> dict[str, Any]:
    """Send every request under `concurrency` (and the request rate); the run's report."""
    semaphore = asyncio.Semaphore(concurrency)
    progress = tqdm(total=len(requests), desc=f"concurrency {concurrency}", disable=not use_tqdm,
                    leave=False, file=sys.stderr)

    async def limited(request: BenchRequest) -> RequestRecord:
        async with semaphore:
            record = await send_request(client, config, request)
        progress.update(1)
        return record

    rng = random.Random(config.seed)
    start = time.perf_counter()
    tasks = []
    for i, request in enumerate(requests):
        if i and not math.isinf(config.request_rate):
            await asyncio.sleep(_interarrival_s(rng, config.request_rate, config.burstiness))
        tasks.append(asyncio.create_task(limited(request)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return {"concurrency": concurrency,
            "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
            "burstiness": config.burstiness,
            **summarize(records, duration, config.slo),
            "requests": [r.to_dict() for r in records]}


def _interarrival_s(rng: random.Random, rate: float, burstiness: float) -> float:
    """Gamma-distributed gap with mean 1/rate; shape `burstiness` (1: exponential)."""
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def request_body(config: ServeBenchConfig, request: BenchRequest) -> dict[str, Any]:
    """A streaming request for exactly `output_len` greedy tokens (vLLM/llama.cpp extras);
    with --structured, at most that many (a complete match ends the request earlier)."""
    body: dict[str, Any] = {
        "model": config.model, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0.0, "max_tokens": request.output_len,
        "min_tokens": request.output_len, "ignore_eos": True,
    }
    if config.structured is not None:  # min_tokens stays: the same request but for this
        body.update(STRUCTURED[config.structured])
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


async def send_request(client: httpx.AsyncClient, config: ServeBenchConfig,
                       request: BenchRequest) -> RequestRecord:
    """Stream one request; timestamps of every chunk that carries text."""
    record = RequestRecord(prompt_len=request.prompt_len,
                           expected_output_len=request.output_len)
    body = request_body(config, request)
    usage: dict[str, Any] | None = None
    record.start = time.perf_counter()
    try:
        async with client.stream("POST", ENDPOINTS[config.endpoint], json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise LLMServeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                usage = _on_event(record, json.loads(data)) or usage
        record.end = time.perf_counter()
        record.output_len = (usage or {}).get("completion_tokens") or len(record.chunk_times)
        record.prompt_len = (usage or {}).get("prompt_tokens") or record.prompt_len
        record.success = True
    except (httpx.HTTPError, LLMServeError, json.JSONDecodeError) as e:
        record.end = time.perf_counter()
        record.error = f"{type(e).__name__}: {e}"
    return record


def _on_event(record: RequestRecord, event: dict[str, Any]) -> dict[str, Any] | None:
    """Note the time of a text-bearing chunk; return the usage the event carries, if any."""
    if "error" in event:
        raise LLMServeError(str(event["error"].get("message", event["error"])))
    choices = event.get("choices") or []
    if choices and _chunk_text(choices[0]):
        record.chunk_times.append(time.perf_counter())
    return event.get("usage")


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


# ---- reporting -----------------------------------------------------------------------------


def format_run(run: dict[str, Any]) -> str:
    """vLLM-style block of one run's results."""
    rate = run["request_rate"]
    lines = [f"{' Serving benchmark: concurrency ' + str(run['concurrency']) + ' ':=^52}",
             _row("Request rate (req/s)", "inf" if rate is None else f"{rate:g}"),
             _row("Successful requests", run["completed"]),
             _row("Failed requests", run["failed"]),
             _row("Benchmark duration (s)", f"{run['duration_s']:.2f}"),
             _row("Total input tokens", run["total_input_tokens"]),
             _row("Total generated tokens", run["total_output_tokens"]),
             _row("Request throughput (req/s)", f"{run['request_throughput']:.2f}"),
             _row("Output token throughput (tok/s)", f"{run['output_throughput']:.2f}"),
             _row("Total token throughput (tok/s)", f"{run['total_token_throughput']:.2f}")]
    if run["short_outputs"]:
        lines.append(_row("WARNING: short outputs", run["short_outputs"]))
    if run["goodput"] is not None:
        lines.append(_row("Goodput (req/s)", f"{run['goodput']:.2f}"))
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + title + ' ':-^52}")
        for stat in ("mean", "p50", "p90", "p99"):
            lines.append(_row(f"{stat.capitalize()} {name.upper()} (ms)",
                              f"{run[f'{stat}_{name}_ms']:.2f}"))
    return "\n".join([*lines, "=" * 52])


def format_summary(report: dict[str, Any]) -> str:
    """One row per concurrency: the numbers people compare."""
    header = (f"{'conc':>5}{'ok':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}"
              f"{'TTFT p99':>10}{'TPOT p50':>10}{'E2E p50':>10}")
    rows = [format_machine(report.get("machine"), "client machine"), header]
    for r in report["runs"]:
        rows.append(f"{r['concurrency']:>5}{r['completed']:>5}{r['failed']:>5}"
                    f"{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}"
                    f"{r['p50_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>10.0f}"
                    f"{r['p50_tpot_ms']:>10.1f}{r['p50_e2el_ms']:>10.0f}")
    return "\n".join(rows) + "\n(latencies in ms)"


def _row(name: str, value: object) -> str:
    return f"{name + ':':<40}{value!s:>12}"
