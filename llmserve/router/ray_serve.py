"""`llmserve serve --data-parallel-size N --data-parallel-backend ray`: the replicas as a
Ray Serve application, the path from one machine to many.

One deployment per model (named after it), `N` replicas placed by Ray on the cluster's
nodes (`--threads` CPUs each, 1 by default), each replica a whole `llmserve serve` (the
user's flags, one engine) started by the replica's actor on its node and answering there
on the loopback; the actor forwards each request to it and streams the answer back. Ray
Serve's HTTP proxy serves the user's --host/--port; an ingress deployment reads each
request and hands it to the replicas through Ray's request router, here llmserve's
prefix-cache affinity bounded by load (`ray_routing.PrefixAffinityRouter`, the policy of
`llmserve router`): prompts that start alike go to the replica whose prefix cache holds
them, by rendezvous hashing on the replicas' ids, unless it runs far ahead of the least
loaded one. With `--max-data-parallel-size M` the
deployment autoscales between N and M replicas on requests in flight per replica
(`--target-ongoing-requests`, 8 by default). A replica whose server exits fails Ray
Serve's health check and is replaced. SIGTERM or SIGINT deletes the application (each
replica's server stopped) and shuts Serve down.

The cluster is the one `ray start` made (RAY_ADDRESS, else this node's); without one Ray
starts a local one.
"""

import json
import logging
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from llmserve.router.launcher import (
    ReplicaProcess,
    replica_command,
    stop_replicas,
    wait_until_serving,
)

logger = logging.getLogger(__name__)

# request headers that describe one hop, not the request
HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive",
                         "transfer-encoding", "te", "upgrade", "proxy-connection"})
DEFAULT_TARGET_ONGOING_REQUESTS = 8
# requests a replica (and the ingress) takes at once: Ray's default of 5 would cap the
# continuous batch
MAX_ONGOING_REQUESTS = 256
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 10.0, 60.0


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress hands it to a replica: its body read, and parsed
    when it is JSON (the request router reads the prompt from it)."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    json_body: Any = None


class LLMServeIngress:
    """Ray Serve's HTTP entry: reads each request and hands it to the replicas' handle,
    whose router (`ray_routing.PrefixAffinityRouter`) picks the replica by the prompt;
    streams the replica's answer back (a client gone cancels it there)."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import StreamingResponse

        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        stream = self.replicas.forward.remote(ForwardedRequest(
            request.method, request.url.path, request.url.query,
            [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS],
            body, parsed))
        head = await stream.__anext__()

        async def rest():
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                stream.cancel()

        return StreamingResponse(rest(), status_code=head["status"], headers=head["headers"])


class LLMServeReplica:
    """A Ray Serve replica: one `llmserve serve` on this node, requests forwarded to it;
    its answers carry `x-llmserve-replica` (this replica's id)."""

    def __init__(self, command: list[str]) -> None:
        from ray import serve

        self.name = serve.get_replica_context().replica_id.unique_id
        self.child = ReplicaProcess(0, command, name="ray replica")
        self.child.start_relay()
        wait_until_serving([self.child])
        self.client = httpx.AsyncClient(base_url=self.child.url, timeout=None)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        """The server's answer: {"status", "headers"} first, then the body's chunks."""
        upstream = self.client.build_request(request.method, request.path,
                                             params=request.query, headers=request.headers,
                                             content=request.body)
        response = await self.client.send(upstream, stream=True)
        try:
            headers = {k: v for k, v in response.headers.items()
                       if k.lower() not in HOP_HEADERS and k.lower() != "content-encoding"}
            yield {"status": response.status_code,
                   "headers": {**headers, "x-llmserve-replica": self.name}}
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose server exited is replaced."""
        if self.child.process.poll() is not None:
            raise RuntimeError(f"its llmserve server exited with code "
                               f"{self.child.process.returncode}")

    def __del__(self) -> None:
        stop_replicas([self.child])


def run_ray_serve(args: Any, argv: list[str], model_name: str) -> int:
    """Serve `model_name` as a Ray Serve application (see the module docstring); returns 0
    after SIGTERM or SIGINT."""
    try:
        from ray import serve
        from ray.serve.config import RequestRouterConfig
    except ImportError:
        raise RuntimeError("--data-parallel-backend ray needs Ray Serve: pip install "
                           "'llmserve[ray]'") from None
    from llmserve.executor.ray_executor import join_ray_cluster

    join_ray_cluster()
    threads = args.num_threads or 1
    command = replica_command(_without_ray_flags(argv), threads)
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": threads},
                               "health_check_period_s": 2, "health_check_timeout_s": 30}
    top = args.max_data_parallel_size
    if top is not None and top > args.data_parallel_size:
        options["autoscaling_config"] = {
            "min_replicas": args.data_parallel_size, "max_replicas": top,
            "initial_replicas": args.data_parallel_size,
            "target_ongoing_requests": args.target_ongoing_requests,
            # a replica takes seconds to load: add one after 10 s of a longer queue (Ray's
            # default waits 30), drop one after a minute below the target (not ten)
            "upscale_delay_s": UPSCALE_DELAY_S, "downscale_delay_s": DOWNSCALE_DELAY_S}
    else:
        options["num_replicas"] = args.data_parallel_size
    replicas = serve.deployment(
        LLMServeReplica, name=_app_name(model_name),
        # the server batches what it is given and answers 429/503 itself when full
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        request_router_config=RequestRouterConfig(
            request_router_class="llmserve.router.ray_routing.PrefixAffinityRouter"),
        **options)
    ingress = serve.deployment(LLMServeIngress, name=f"{_app_name(model_name)}-ingress",
                               num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=MAX_ONGOING_REQUESTS)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": args.host, "port": args.port})
    try:
        serve.run(ingress.bind(replicas.bind(command)), name=_app_name(model_name),
                  route_prefix="/")
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        print(f"llmserve: serving '{model_name}' at http://{host}:{args.port}/v1 (Ray Serve, "
              f"{args.data_parallel_size} replica(s))", flush=True)
        stop.wait()
    finally:
        serve.delete(_app_name(model_name))
        serve.shutdown()
    return 0


def _app_name(model_name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name) or "llmserve"


def _without_ray_flags(argv: list[str]) -> list[str]:
    """The user's flags a replica's server is started with: not the Ray Serve ones."""
    drop = {"--data-parallel-backend": 1, "--max-data-parallel-size": 1,
            "--target-ongoing-requests": 1}
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = 0 if "=" in arg else drop[name]
            continue
        out.append(arg)
    return out
