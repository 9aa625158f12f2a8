"""Helpers of the router tests: routers and fake backends on real sockets, waiting, prompts
that hash to a given replica, processes that are gone."""

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from llmserve.router.app import RouterSettings, build_router_app
from llmserve.router.policy import (
    DEFAULT_PREFIX_CHARS,
    ReplicaLoad,
    prefix_key,
    rendezvous_score,
)
from llmserve.router.replicas import Replica
from tests.router.fake_backend import FakeBackend, serve_in_thread

REPO = Path(__file__).resolve().parents[2]
FAST_HEALTH = {"health_interval_s": 0.2, "health_timeout_s": 1.0}


@dataclass
class RunningRouter:
    url: str
    backends: list[FakeBackend]
    backend_urls: list[str]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, timeout=30, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)


@contextmanager
def run_router(replicas: list[Replica], **settings: Any) -> Iterator[str]:
    app = build_router_app(replicas, RouterSettings(**{**FAST_HEALTH, **settings}))
    with serve_in_thread(app) as url:
        yield url


@contextmanager
def backend_process(name: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A fake backend in a process of its own (to kill); yields it and its URL."""
    process = subprocess.Popen([sys.executable, "-m", "tests.router.fake_backend", name],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{process.stdout.readline().split()[1]}"
        wait_for(lambda: _answers(url), 20, f"{name} did not start")
        yield process, url
    finally:
        process.kill()
        process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def wait_for(condition: Any, timeout_s: float, message: str) -> float:
    """Poll `condition` until true; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, message
        time.sleep(0.02)
    return time.monotonic() - start


def prompt_for(replica: int, stem: str, num_replicas: int = 2) -> str:
    """A prompt starting with `stem` whose prefix key goes to `replica` (all up, idle)."""
    for i in range(1000):
        prompt = f"{stem} {i}"
        key = prefix_key({"prompt": prompt}, DEFAULT_PREFIX_CHARS)
        if max(range(num_replicas),
               key=lambda r: rendezvous_score(key, ReplicaLoad(r, 0).hashed)) == replica:
            return prompt
    raise AssertionError("no prompt found")


def gone(pid: int) -> bool:
    """No such process, or only its zombie left (dead, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
