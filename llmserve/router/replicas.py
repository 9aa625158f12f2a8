"""The router's view of its replicas: up or down, requests in flight, and the health monitor.

A replica is down from the moment a check fails (its process exited, /health refused the
connection, answered other than 200, or did not answer within the timeout) until a check
passes again. Going down sets its `down` event, which every request in flight to it waits
on beside the upstream answer: those requests end with a 503 at once instead of hanging on
a replica that may never answer.
"""

import asyncio
import logging
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 5.0


@dataclass(eq=False)
class Replica:
    """One backend server (an OpenAI-compatible llmserve) behind the router."""

    index: int
    url: str  # http://host:port, no trailing slash
    process: subprocess.Popen | None = None  # set when the router's parent started it
    role: str | None = None  # "prefill" or "decode" behind a disaggregated router
    model: str | None = None  # the model it serves behind a many-model server
    is_up: bool = True
    reason: str = ""  # why it is down
    in_flight: int = 0
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while it is down

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    @property
    def name(self) -> str:
        """What errors and logs call it: "replica 0", "prefill server", or "model 'x'"."""
        if self.model is not None:
            return f"model '{self.model}'"
        return f"{self.role} server" if self.role else f"replica {self.index}"

    @property
    def label(self) -> str:
        """Its value of the label on its metrics (`replica="0"`, `role="prefill"`, or
        `model="x"`)."""
        return self.model or self.role or str(self.index)

    def identity(self) -> dict[str, int | str]:
        """How /health names it: {"replica": 0}, {"role": "prefill"}, or {"model": "x"}."""
        if self.model is not None:
            return {"model": self.model}
        return {"role": self.role} if self.role else {"replica": self.index}

    def mark_down(self, reason: str) -> None:
        if self.is_up:
            logger.warning("%s (%s) is down: %s", self.name, self.url, reason)
        self.is_up, self.reason = False, reason
        self.down.set()

    def mark_up(self) -> None:
        if not self.is_up:
            logger.warning("%s (%s) is up again", self.name, self.url)
            self.down = asyncio.Event()
        self.is_up, self.reason = True, ""

    def describe_down(self) -> str:
        return f"{self.name} is down ({self.reason})"


class HealthMonitor:
    """Checks every replica's /health (and its process, if any) every `interval_s`."""

    def __init__(self, replicas: list[Replica], client: httpx.AsyncClient,
                 interval_s: float = HEALTH_INTERVAL_S, timeout_s: float = HEALTH_TIMEOUT_S,
                 headers: Mapping[str, str] | None = None) -> None:
        self.replicas = replicas
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})

    async def run(self) -> None:
        """Check forever (until cancelled)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def check(self, replica: Replica) -> None:
        """Check one replica now and mark it up or down."""
        problem = await self._problem(replica)
        if problem is None:
            replica.mark_up()
        else:
            replica.mark_down(problem)

    async def _problem(self, replica: Replica) -> str | None:
        exited = _exited(replica)
        if exited is not None:
            return exited
        try:
            response = await self.client.get(f"{replica.url}/health", headers=self.headers,
                                              timeout=self.timeout_s)
        except httpx.TimeoutException:
            return f"/health did not answer within {self.timeout_s:g} s"
        except httpx.TransportError as e:
            # a process that died while the check was under way is named for that
            return _exited(replica) or f"/health failed: {type(e).__name__}: {e}"
        if response.status_code != 200:
            return f"/health answered {response.status_code}"
        return None


def _exited(replica: Replica) -> str | None:
    if replica.process is not None and replica.process.poll() is not None:
        return f"its process exited with code {replica.process.returncode}"
    return None
