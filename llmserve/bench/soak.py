"""`llmserve bench soak`: one server under steady streamed load for a long time, sampled
for leaks (memory that grows, KV blocks that never come back).

    `concurrency` clients, each in a loop until `duration`: a random prompt length and
        output length, /v1/completions or /v1/chat/completions, streamed; a
        `disconnect_fraction` of them hang up after a random number of chunks
    every `sample_interval`: the server's RSS (its process tree, /proc or else psutil), KV
        usage and running/waiting (/metrics), the 1-minute load, request counts, and TTFT,
        TPOT and E2E percentiles of the requests completed in the window
    then: the clients stop sending and their last requests finish, the server goes idle
        (nothing running or waiting), one last sample: its KV usage should be back at ~0

The server is started here (`llmserve serve --port 0`, its log relayed as `[server] ...`)
unless `--base-url` names one; then RSS is sampled only with `--server-pid`. One asyncio
loop drives every client, so the client takes little CPU from a server on the same machine.
The clients are in `soak_clients.py`; `soak_report.py` turns the samples into the RSS
slope, the summary and the plot.
"""

import asyncio
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmserve.bench.machine import machine_info
from llmserve.bench.procfs import NO_RSS_SOURCE, rss_source, tree_rss_bytes
from llmserve.bench.soak_clients import Tally, plan_request, stream_once
from llmserve.bench.soak_report import format_sample, summarize_soak
from llmserve.bench.workloads import LocalTokenizer, PromptTokenizer, ServerTokenizer
from llmserve.cpu_info import load_average_1m
from llmserve.errors import LLMServeError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600}
SERVER_START_TIMEOUT_S = 600.0  # a first start may fetch the model
LOG_TAIL_LINES = 20


def parse_duration(text: str) -> float:
    """Seconds from "90", "90s", "30m" or "1.5h"."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"expected a duration like 20s, 30m or 1h, got {text!r}")
    return float(match[1]) * _UNIT_S[match[2]]


@dataclass(frozen=True)
class SoakConfig:
    base_url: str | None = None  # None: start `llmserve serve --model model` here
    model: str | None = None  # to serve; with base_url the served id (None: the server's)
    server_pid: int | None = None  # with base_url: whose process tree's RSS to sample
    server_args: tuple[str, ...] = ()  # more `llmserve serve` flags for the started server
    duration_s: float = 1800.0
    concurrency: int = 32
    sample_interval_s: float = 10.0
    warmup_s: float = 60.0  # samples before this are left out of the RSS slope
    disconnect_fraction: float = 0.05
    input_len: tuple[int, int] = (16, 512)  # uniform, inclusive
    output_len: tuple[int, int] = (16, 256)
    drain_timeout_s: float = 120.0  # for the server to go idle after the last request
    seed: int = 0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.sample_interval_s <= 0:
            raise ValueError("--duration and --sample-interval must be positive")
        if self.warmup_s < 0:
            raise ValueError("--warmup must not be negative")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if not 0 <= self.disconnect_fraction <= 1:
            raise ValueError("--disconnect-fraction must be within [0, 1]")
        for name in ("input_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"--{name.replace('_', '-')} must be LOW:HIGH with "
                                 f"1 <= LOW <= HIGH, got {low}:{high}")
        if self.base_url is None and self.server_pid is not None:
            raise ValueError("--server-pid goes with --base-url (a server started here is "
                             "sampled anyway)")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "api_key"}


async def _client_loop(client: httpx.AsyncClient, config: SoakConfig, model: str,
                       tokenizer: PromptTokenizer, rng: random.Random, deadline: float,
                       tally: Tally) -> None:
    while time.monotonic() < deadline:
        # prompts are built off the event loop: their tokenizing must not delay the streams
        request = await asyncio.to_thread(plan_request, config.input_len, config.output_len,
                                          config.disconnect_fraction, model, tokenizer, rng)
        tally.sent += 1
        tally.add(await stream_once(client, request))


# ---- sampling ------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, Any]:
    """KV usage (the highest of the series), running and waiting (summed over the series)
    and finished requests by reason from a Prometheus exposition."""
    found: dict[str, Any] = {"kv_usage": None, "running": 0, "waiting": 0, "finished": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "llmserve_kv_cache_usage_ratio":
                found["kv_usage"] = max(found["kv_usage"] or 0.0, sample.value)
            elif name == "llmserve_num_requests_running":
                found["running"] += int(sample.value)
            elif name == "llmserve_num_requests_waiting":
                found["waiting"] += int(sample.value)
            elif name == "llmserve_request_success_total":
                reason = sample.labels.get("finished_reason", "")
                found["finished"][reason] = found["finished"].get(reason, 0) + int(sample.value)
    return found


async def scrape(client: httpx.AsyncClient) -> dict[str, Any] | None:
    """The server's /metrics as `parse_metrics` reads them; None if it does not answer."""
    try:
        response = await client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


async def take_sample(client: httpx.AsyncClient, server_pid: int | None, t_s: float,
                      phase: str, tally: Tally) -> dict[str, Any]:
    metrics = await scrape(client) or {"kv_usage": None, "running": None, "waiting": None,
                                       "finished": {}}
    tree = tree_rss_bytes(server_pid) if server_pid is not None else None
    return {
        "t_s": round(t_s, 2), "phase": phase,
        "rss_mib": None if tree is None else round(tree[0] / 2**20, 2),
        "num_server_processes": None if tree is None else tree[1],
        "load_1m": load_average_1m(),
        "kv_usage": metrics["kv_usage"], "running": metrics["running"],
        "waiting": metrics["waiting"], "finished_on_server": metrics["finished"],
        "requests": tally.counts(), "window": tally.take_window(),
    }


# ---- the run -------------------------------------------------------------------------------


async def _soak(config: SoakConfig, base_url: str, model: str, server_pid: int | None,
                tokenizer: PromptTokenizer, log: Any) -> tuple[list[dict], Tally, float]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + 2,
                          max_keepalive_connections=config.concurrency + 2)
    timeout = httpx.Timeout(connect=10, read=600, write=30, pool=None)
    tally, samples = Tally(), []
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=timeout) as client:
        start = time.monotonic()
        deadline = start + config.duration_s
        clients = [asyncio.create_task(_client_loop(
            client, config, model, tokenizer, random.Random(f"{config.seed}-{i}"), deadline,
            tally)) for i in range(config.concurrency)]
        pending = set(clients)
        next_sample = start + config.sample_interval_s
        while pending:  # sample on the interval until every client's last request ended
            _, pending = await asyncio.wait(pending,
                                            timeout=max(0.0, next_sample - time.monotonic()))
            if time.monotonic() >= next_sample:
                t_s = next_sample - start
                phase = "load" if t_s <= config.duration_s else "finishing"
                samples.append(await take_sample(client, server_pid, t_s, phase, tally))
                log(format_sample(samples[-1]))
                next_sample += config.sample_interval_s
        for task in clients:
            task.result()  # re-raise a failure of the client loop itself (not of a request)
        elapsed = time.monotonic() - start
        await _wait_idle(client, config.drain_timeout_s)
        samples.append(await take_sample(client, server_pid, time.monotonic() - start,
                                         "end", tally))
        log(format_sample(samples[-1]))
    return samples, tally, elapsed


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float) -> None:
    """Until /metrics shows nothing running or waiting (aborts land at the engine's next
    turn), or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = await scrape(client)
        if metrics is not None and metrics["running"] == 0 and metrics["waiting"] == 0:
            return
        await asyncio.sleep(0.2)


def run_soak(config: SoakConfig, log: Any = None) -> dict[str, Any]:
    """Start (or reach) the server, run the soak, stop what was started; the JSON report."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    server = None
    if config.base_url is None:
        server = ServerProcess(config.model, config.server_args)
        base_url, model, server_pid = server.wait_until_serving(), server.model_name, server.pid
    else:
        base_url, server_pid = config.base_url.rstrip("/").removesuffix("/v1"), config.server_pid
    if server_pid is not None and rss_source() is None:
        log(NO_RSS_SOURCE)
    try:
        with httpx.Client(base_url=base_url, timeout=30, headers=(
                {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {})) as http:
            if server is None:
                model = config.model or served_model(http)
            tokenizer = (LocalTokenizer(config.model or model)
                         if LocalTokenizer.can_load(config.model or model)
                         else ServerTokenizer.probe(http, model))
            if tokenizer is None:
                raise LLMServeError(f"{base_url} has no /tokenize llmserve understands and "
                                    f"{model!r} is not a model llmserve knows")
            before = _finished(http)
        samples, tally, elapsed = asyncio.run(
            _soak(config, base_url, model, server_pid, tokenizer, log))
    finally:
        if server is not None:
            server.stop()
    aborts = None
    if before is not None and samples[-1]["finished_on_server"]:
        aborts = samples[-1]["finished_on_server"].get("abort", 0) - before.get("abort", 0)
    return {
        "label": "soak", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_info(), "config": config.to_dict(), "elapsed_s": elapsed,
        "server": {"url": base_url, "model": model, "pid": server_pid,
                   "command": server.command if server is not None else None},
        "samples": samples,
        "summary": summarize_soak(samples, tally.latencies, tally.errors, aborts,
                                  config.warmup_s),
    }


def served_model(http: httpx.Client) -> str:
    """The first model id the server lists."""
    try:
        return http.get("/v1/models").json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise LLMServeError(f"cannot read the served model from {http.base_url}/v1/models "
                            f"({type(e).__name__}); pass --model") from None


def _finished(http: httpx.Client) -> dict[str, int] | None:
    try:
        return parse_metrics(http.get("/metrics").text)["finished"]
    except httpx.HTTPError:
        return None


# ---- a server of our own -------------------------------------------------------------------


class ServerProcess:
    """`llmserve serve` started for the soak, on a free port; its log relayed to stderr as
    `[server] ...`, the URL read from the line it prints once it listens."""

    def __init__(self, model: str | None, server_args: tuple[str, ...],
                 python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        """`python`: the interpreter to run it with (another install's); `env`: variables
        over this process's environment."""
        from llmserve.router.launcher import spawn

        self.command = [python, "-m", "llmserve.entrypoints.cli", "serve",
                        "--port", "0", *(["--model", model] if model else []), *server_args]
        self.process = spawn(self.command, {**os.environ, **(env or {}),
                                            "PYTHONUNBUFFERED": "1"})
        self.pid = self.process.pid
        self.url: str | None = None
        self.model_name = ""
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.startup_log: list[str] = []  # every line until it serves
        threading.Thread(target=self._relay, daemon=True, name="soak-server-log").start()

    def _relay(self) -> None:
        from llmserve.router.launcher import SERVING_LINE

        for line in self.process.stdout:
            self.log_tail.append(line.rstrip("\n"))
            if self.url is None:
                self.startup_log.append(line.rstrip("\n"))
            sys.stderr.write(f"[server] {line}")
            match = SERVING_LINE.match(line.rstrip())
            if match and self.url is None:
                self.model_name, url = match.groups()
                self.url = url

    def wait_until_serving(self) -> str:
        """Its base URL once /health answers 200; raises if it exits or takes too long."""
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        with httpx.Client(timeout=5) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    last = next((x for x in reversed(self.log_tail) if x.strip()), "no output")
                    raise LLMServeError(f"the server exited with code "
                                        f"{self.process.returncode} while starting: {last}")
                if self.url is not None:
                    try:
                        if http.get(f"{self.url}/health").status_code == 200:
                            return self.url
                    except httpx.TransportError:
                        pass
                time.sleep(0.1)
        self.stop()
        raise LLMServeError(f"the server did not serve within {SERVER_START_TIMEOUT_S:g} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the server drains, then exits), SIGKILL after `timeout_s`."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
