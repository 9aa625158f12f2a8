"""Hosts made on this machine for tests that span several: network namespaces, each with
its own loopback and one interface on a bridge in the root namespace, private addresses
on a /24 chosen per run. Processes started in a host see only its interfaces (their
hostname still resolves to the loopback, as on many Debian hosts: a rank must bind the
address that routes to the master, not its hostname's).

`namespace_hosts(n)` is a context manager yielding `Host`s; it needs root and `ip`, and
skips the test without them. Everything it made is removed on exit (the hosts' processes
killed first).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class Host:
    name: str  # the namespace
    address: str  # its address on the bridge
    interface: str  # its end of the veth pair, inside it
    processes: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, argv: list[str], log: Path, **env: str) -> subprocess.Popen:
        """Start `argv` in this host, stdout and stderr to `log`."""
        handle = log.open("w")
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.name, *argv], stdout=handle, stderr=subprocess.STDOUT,
            env={**os.environ, **env}, start_new_session=True)
        self.processes.append(process)
        return process

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], check=check,
                              capture_output=True, text=True)

    def kill(self) -> None:
        """Every process started here, at once (a host that dies)."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process.wait()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def namespace_hosts(count: int):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("namespace hosts need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    bridge = f"lsbr{tag}"
    subnet = 10 + int(tag[:2], 16) % 200  # 10.<subnet>.0.0/24, one per run
    hosts: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i in range(count):
            name, outer = f"lsh{tag}{i}", f"lsv{tag}{i}"
            host = Host(name, f"10.{subnet}.0.{i + 1}", "eth0")
            _ip("netns", "add", name)
            hosts.append(host)
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            for args in (("addr", "add", f"{host.address}/24", "dev", "eth0"),
                         ("link", "set", "eth0", "up"), ("link", "set", "lo", "up")):
                _ip("-n", name, *args)
    except subprocess.CalledProcessError as exc:
        _remove(hosts, bridge)
        pytest.skip(f"cannot make namespace hosts here: {exc.stderr.strip()}")
    try:
        yield hosts
    finally:
        _remove(hosts, bridge)


def _remove(hosts: list[Host], bridge: str) -> None:
    for host in hosts:
        host.kill()
        subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def llmserve_argv() -> list[str]:
    """The llmserve command of this interpreter's environment."""
    return [str(Path(sys.executable).with_name("llmserve"))]


def torchrun_argv(nnodes: int, node_rank: int, nproc: int, master: str, port: int
                  ) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
            "--master-addr", master, "--master-port", str(port)]
