"""`llmserve bench hostile`: a normal chat's latency alone, then beside each hostile request
of the kind that used to take a server from everyone else, side by side in one run.

Each probe runs on threads of its own while the same normal chat runs `repeats` times in
a row beside it; the table gives the median of those against the median alone, and what
the hostile request got (a 4xx naming its field, a stream's error event, a correct answer,
connections the server closed). The probes:

* `choice` constraints of 300,000 and 50,000 strings (over the cap) and of 10,000 (at it)
* a nested-repeat regex the parser cannot follow, whole and streamed
* 40 connections sending their headers a byte every 0.2 s (slowloris)
* a prompt of ~1.3 million tokens (3.9 MB, under the body cap), on /v1/completions and
  on Ollama's /api/generate
* runtime adapter loading: a path outside any `--lora-dir`, two loads of a FIFO under it
  (with `--lora-dir`), a lone surrogate in the name
"""

import json
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
NESTED_REGEX = "((a{100}){100}){100}"
SLOW_CONNECTIONS = 40
DRIP_INTERVAL_S = 0.2


@dataclass
class HostileConfig:
    base_url: str
    model: str
    repeats: int = 5  # normal chats alone, and beside each probe
    output_tokens: int = 32  # of the normal chat
    api_key: str | None = None
    fifo_adapter: str | None = None  # a FIFO's lora_path under the server's --lora-dir


Probe = Callable[["_Context"], dict[str, Any]]


class _Context:
    def __init__(self, config: HostileConfig) -> None:
        self.config = config
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    def client(self, timeout: float = 600) -> httpx.Client:
        return httpx.Client(base_url=self.config.base_url, headers=self.headers,
                            timeout=timeout)

    def chat_body(self, content: str, **extra: Any) -> dict[str, Any]:
        return {"model": self.config.model, "messages": [{"role": "user", "content": content}],
                "temperature": 0, **extra}


def normal_chat_seconds(ctx: _Context, http: httpx.Client) -> float:
    body = ctx.chat_body("Tell me about the sea.", max_tokens=ctx.config.output_tokens,
                         ignore_eos=True)
    start = time.monotonic()
    reply = http.post(CHAT, json=body)
    reply.raise_for_status()
    return time.monotonic() - start


def _refusal(reply: httpx.Response) -> dict[str, Any]:
    try:
        error = reply.json().get("error") or {}
    except ValueError:
        error = {}
    if isinstance(error, str):  # Ollama's routes: the message alone
        error = {"message": error}
    return {"status": reply.status_code, "param": error.get("param"),
            "message": (error.get("message") or reply.text)[:160]}


def _constrained(ctx: _Context, constraint: dict[str, Any]) -> dict[str, Any]:
    return ctx.chat_body("Pick one.", max_tokens=16, structured_outputs=constraint)


def _choice(count: int) -> Probe:
    def probe(ctx: _Context) -> dict[str, Any]:
        choices = [f"c{i}x" for i in range(count)]
        with ctx.client() as http:
            reply = http.post(CHAT, json=_constrained(ctx, {"choice": choices}))
        result = _refusal(reply)
        if reply.status_code == 200:
            text = reply.json()["choices"][0]["message"]["content"]
            result["message"] = f"answered {text!r}, one of the choices: {text in choices}"
        return result
    return probe


def _nested_regex(ctx: _Context) -> dict[str, Any]:
    with ctx.client() as http:
        return _refusal(http.post(CHAT, json=_constrained(ctx, {"regex": NESTED_REGEX})))


def _nested_regex_streamed(ctx: _Context) -> dict[str, Any]:
    body = {**_constrained(ctx, {"regex": NESTED_REGEX}), "stream": True}
    with ctx.client() as http, http.stream("POST", CHAT, json=body) as reply:
        events = [line.removeprefix("data: ") for line in reply.iter_lines()
                  if line.startswith("data: ")]
    last = json.loads(events[-2]) if len(events) >= 2 else {}
    error = last.get("error") or {}
    return {"status": f"{reply.status_code}, event {error.get('code', 'none')}",
            "param": error.get("param"), "message": (error.get("message") or "")[:160]}


def _slowloris(ctx: _Context) -> dict[str, Any]:
    host, port = ctx.config.base_url.removeprefix("http://").rstrip("/").split(":")
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
               b"application/json\r\nX-Padding: " + b"a" * 300)
    socks = [socket.create_connection((host, int(port)), timeout=5)
             for _ in range(SLOW_CONNECTIONS)]
    closed: set[int] = set()
    start = time.monotonic()
    for byte in request:  # ~60 s at a byte per 0.2 s, unless the server closes them all
        for i, sock in enumerate(socks):
            if i not in closed:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    closed.add(i)
        if len(closed) == len(socks):
            break
        time.sleep(DRIP_INTERVAL_S)
    for sock in socks:
        sock.close()
    return {"status": f"{len(closed)}/{len(socks)} closed by the server", "param": None,
            "message": f"after {time.monotonic() - start:.1f} s"}


def _huge_prompt(ctx: _Context) -> dict[str, Any]:
    body = {"model": ctx.config.model, "prompt": "hi " * 1_300_000, "max_tokens": 4}
    with ctx.client() as http:
        return _refusal(http.post("/v1/completions", json=body))


def _huge_ollama_prompt(ctx: _Context) -> dict[str, Any]:
    body = {"model": ctx.config.model, "prompt": "hi " * 1_300_000, "raw": True,
            "stream": False, "options": {"num_predict": 4}}
    with ctx.client() as http:
        return _refusal(http.post("/api/generate", json=body))


def _adapter_outside(ctx: _Context) -> dict[str, Any]:
    with ctx.client() as http:
        return _refusal(http.post("/v1/load_lora_adapter",
                                  json={"lora_name": "x", "lora_path": "/etc/passwd"}))


def _adapter_fifo(ctx: _Context) -> dict[str, Any]:
    """Two loads of a FIFO under --lora-dir at once (a hung network filesystem): before,
    they held the tokenizer's two threads and every chat timed out."""
    if ctx.config.fifo_adapter is None:
        return {"status": "skipped (give --lora-dir)", "param": None, "message": ""}
    replies: list[httpx.Response] = []

    def load(name: str) -> None:
        with ctx.client() as http:
            replies.append(http.post("/v1/load_lora_adapter", json={
                "lora_name": name, "lora_path": ctx.config.fifo_adapter}))

    threads = [threading.Thread(target=load, args=(f"stuck{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = [_refusal(reply) for reply in replies]
    return {"status": " and ".join(str(r["status"]) for r in results),
            "param": results[0]["param"], "message": results[0]["message"]}


def _adapter_surrogate(ctx: _Context) -> dict[str, Any]:
    with ctx.client() as http:
        return _refusal(http.post("/v1/load_lora_adapter",
                                  headers={"content-type": "application/json"},
                                  content='{"lora_name": "\\ud800", "lora_path": "a"}'))


PROBES: dict[str, Probe] = {
    "choice of 300,000 strings": _choice(300_000),
    "choice of 50,000 strings": _choice(50_000),
    "choice of 10,000 strings": _choice(10_000),
    f"regex {NESTED_REGEX}": _nested_regex,
    f"regex {NESTED_REGEX}, streamed": _nested_regex_streamed,
    f"{SLOW_CONNECTIONS} slowloris connections": _slowloris,
    "a 1.3M-token prompt": _huge_prompt,
    "a 1.3M-token prompt on Ollama's /api/generate": _huge_ollama_prompt,
    "load_lora_adapter /etc/passwd": _adapter_outside,
    "load_lora_adapter of a FIFO, twice at once": _adapter_fifo,
    "load_lora_adapter, lone surrogate": _adapter_surrogate,
}


def run_hostile(config: HostileConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The normal chat alone, then beside each probe; a report (JSON-ready)."""
    ctx = _Context(config)
    with ctx.client() as http:
        normal_chat_seconds(ctx, http)  # warm-up
        alone = [normal_chat_seconds(ctx, http) for _ in range(config.repeats)]
    log(f"normal chat alone: p50 {statistics.median(alone) * 1000:.0f} ms")
    rows = []
    for name, probe in PROBES.items():
        outcome: dict[str, Any] = {}

        def hostile(probe: Probe = probe, outcome: dict[str, Any] = outcome) -> None:
            start = time.monotonic()
            try:
                outcome.update(probe(ctx))
            except Exception as e:  # noqa: BLE001 - a probe's failure is its result
                outcome.update(status=f"client error: {type(e).__name__}", param=None,
                               message=str(e)[:160])
            outcome["seconds"] = round(time.monotonic() - start, 2)

        thread = threading.Thread(target=hostile, daemon=True)
        thread.start()
        with ctx.client() as http:
            beside = [normal_chat_seconds(ctx, http) for _ in range(config.repeats)]
        thread.join(600)
        row = {"probe": name, "normal_p50_s": statistics.median(beside),
               "normal_max_s": max(beside),
               "ratio": statistics.median(beside) / statistics.median(alone), **outcome}
        rows.append(row)
        log(f"{name}: normal chat p50 {row['normal_p50_s'] * 1000:.0f} ms "
            f"({row['ratio']:.2f}x alone); hostile got {row.get('status')}")
    return {"config": vars(config) | {"api_key": None}, "alone_s": alone,
            "alone_p50_s": statistics.median(alone), "probes": rows}


def format_hostile(report: dict[str, Any]) -> str:
    lines = [f"normal chat ({report['config']['output_tokens']} tokens) alone: p50 "
             f"{report['alone_p50_s'] * 1000:.0f} ms",
             "| hostile request | normal chat p50 beside it | vs alone | max | what the hostile "
             "request got |", "|---|---|---|---|---|"]
    for row in report["probes"]:
        got = f"{row.get('status')}" + (f" naming {row['param']}" if row.get("param") else "")
        got += f": {row.get('message', '')}" if row.get("message") else ""
        lines.append(f"| {row['probe']} | {row['normal_p50_s'] * 1000:.0f} ms | "
                     f"{row['ratio']:.2f}x | {row['normal_max_s'] * 1000:.0f} ms | "
                     f"{got.replace('|', '/')} |")
    return "\n".join(lines)
