"""`llmserve serve --data-parallel-size N`: N replica processes behind one router.

The parent binds the user's --host/--port first (a busy port fails at once), starts N
children (`llmserve serve` with the same flags, on 127.0.0.1 and a free port, 1/N of the
cores each unless --threads is given), relays their logs line by line as `[replica i] ...`,
waits until each one serves, then runs the router on the user's socket.

Stopping: SIGTERM or SIGINT drains the router, then each child gets SIGTERM, and SIGKILL
after `STOP_TIMEOUT_S`. A parent killed outright takes its children with it: on Linux each
child asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG).
"""

import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import httpx

from llmserve.errors import LLMServeError

if TYPE_CHECKING:
    from llmserve.router.app import RouterSettings

logger = logging.getLogger(__name__)

# What `llmserve serve` prints once it listens (entrypoints/openai/server.py).
SERVING_LINE = re.compile(r"^llmserve: serving '(.*)' at (http://\S+)/v1$")
LOG_TAIL_LINES = 20
STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ReplicaProcess:
    """One child server: its process, the URL it serves at (once it says), its log's end."""

    def __init__(self, index: int, command: list[str], name: str | None = None) -> None:
        self.index = index
        self.name = name or f"replica {index}"  # what its relayed log lines start with
        self.process = spawn(command, {**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url: str | None = None
        self.model_name = ""
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._relay = threading.Thread(target=self._relay_log, daemon=True,
                                       name=f"{self.name}-log".replace(" ", "-"))

    def start_relay(self) -> None:
        self._relay.start()

    def _relay_log(self) -> None:
        for line in self.process.stdout:
            self.log_tail.append(line.rstrip("\n"))
            sys.stderr.write(f"[{self.name}] {line}")
            match = SERVING_LINE.match(line.rstrip())
            if match and self.url is None:
                self.model_name, self.url = match.groups()

    def start_failure(self) -> LLMServeError:
        """The error for a child that exited while starting (its whole log relayed first)."""
        self._relay.join(5)
        last = next((line for line in reversed(self.log_tail) if line.strip()), "no output")
        return LLMServeError(f"{self.name} exited with code "
                             f"{self.process.returncode} during start-up: {last.strip()}")


def run_data_parallel(args: Any, argv: list[str]) -> int:
    """Run `llmserve serve` (whose parsed flags are `args`, raw ones `argv`) as
    `args.data_parallel_size` replicas behind the router; returns 0 after a SIGTERM."""
    from llmserve.entrypoints.openai.server import listening_socket
    from llmserve.router.app import router_settings

    settings = router_settings(args)  # a bad flag fails before anything starts
    sock = listening_socket(args.host, args.port)
    num_threads = None if args.num_threads else max(1, _num_cpus() // args.data_parallel_size)
    command = replica_command(argv, num_threads)
    signal.signal(signal.SIGTERM, _interrupt)  # during start-up, SIGTERM stops as Ctrl-C does
    children: list[ReplicaProcess] = []
    try:
        for i in range(args.data_parallel_size):  # every fork before any thread starts
            children.append(ReplicaProcess(i, command))
        for child in children:
            child.start_relay()
        wait_until_serving(children)
        for child in children:
            print(f"llmserve: replica {child.index} (pid {child.process.pid}) serves at "
                  f"{child.url}", flush=True)
        _route(children, settings, sock, args.verbose)
    finally:
        stop_replicas(children)
    return 0


def _route(children: list[ReplicaProcess], settings: "RouterSettings", sock: socket.socket,
           access_log: bool) -> None:
    from llmserve.router.app import build_router_app, run_router
    from llmserve.router.replicas import Replica

    replicas = [Replica(c.index, c.url, process=c.process) for c in children]
    banner = f"serving '{children[0].model_name}'"  # as one server says it
    run_router(build_router_app(replicas, settings), settings, sock, banner,
               access_log=access_log)


def replica_command(argv: list[str], num_threads: int | None) -> list[str]:
    """The command line of a replica: the user's, with later flags overriding theirs
    (argparse keeps the last value): 127.0.0.1 on a free port, one replica, the threads."""
    overrides = ["--host", "127.0.0.1", "--port", "0", "--data-parallel-size", "1"]
    if num_threads is not None:
        overrides += ["--threads", str(num_threads)]
    return [sys.executable, "-m", "llmserve.entrypoints.cli", *argv, *overrides]


def spawn(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start `command`, output piped (stderr into stdout), in its own session (a Ctrl-C in
    the terminal reaches the parent only, which stops the children in order), and killed
    by the kernel if this process dies first (Linux)."""
    preexec = _die_with_parent() if sys.platform.startswith("linux") else None
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, start_new_session=True,
                            preexec_fn=preexec)


def _die_with_parent() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork
    parent = os.getpid()

    def set_death_signal() -> None:  # in the child, between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return set_death_signal


def wait_until_serving(children: list[ReplicaProcess], poll_s: float = 0.1) -> None:
    """Block until every child answers /health with 200; raise if one exits first."""
    waiting = list(children)
    with httpx.Client(timeout=5) as client:
        while waiting:
            for child in list(waiting):
                if child.process.poll() is not None:
                    raise child.start_failure()
                if child.url is not None and _healthy(client, child.url):
                    logger.info("replica %d is up at %s", child.index, child.url)
                    waiting.remove(child)
            time.sleep(poll_s if waiting else 0)


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def stop_replicas(children: list[ReplicaProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every child still running; SIGKILL those not gone after `timeout_s`."""
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("replica %d did not stop within %g s: killed", child.index,
                           timeout_s)
            child.process.kill()
            child.process.wait()


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
