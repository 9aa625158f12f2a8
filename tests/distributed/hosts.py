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

    def commands(self) -> list[str]:
        """The command lines of the processes in this host (its network namespace)."""
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True,
                              text=True).stdout.split()
        lines = []
        for pid in pids:
            with contextlib.suppress(OSError):
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                             .decode(errors="replace"))
        return lines

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], check=check,
                              capture_output=True, text=True)

    def kill(self) -> None:
        """Every process in this host at once (a host that dies): the ones started here
        and their children, whatever their process group."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
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
        _ip("addr", "add", f"10.{subnet}.0.254/24", "dev", bridge)  # the test reaches them
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


# ---- a link with delay and loss (the kernel here has no netem) ------------------------

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def _open_tun(name: str) -> int:
    import fcntl
    import struct

    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


@dataclass
class Link:
    """Two hosts joined point to point through this process: each packet waits `delay_s`
    (one way) and is dropped with probability `loss`, as netem would on both ends."""

    delay_s: float
    loss: float = 0.0
    seed: int = 0
    forwarded: int = 0
    dropped: int = 0


@contextlib.contextmanager
def delay_link(count: int = 2, delay_s: float = 0.05, loss: float = 0.0):
    """Two namespace hosts whose only link runs through this process (TUN devices moved
    into each): yields (hosts, link); the hosts' addresses reach each other over it."""
    import heapq
    import random
    import threading
    import time

    if count != 2:
        raise ValueError("a delay link joins two hosts")
    if os.geteuid() != 0 or shutil.which("ip") is None or not Path("/dev/net/tun").exists():
        pytest.skip("a delay link needs root, iproute2 and /dev/net/tun")
    tag = uuid.uuid4().hex[:6]
    subnet = 10 + int(tag[:2], 16) % 200
    link = Link(delay_s, loss)
    hosts, fds = [], []
    try:
        for i in range(2):
            name, dev = f"lsd{tag}{i}", f"lst{tag}{i}"
            fds.append(_open_tun(dev))
            _ip("netns", "add", name)
            host = Host(name, f"10.{subnet}.1.{i + 1}", dev)
            hosts.append(host)
            _ip("link", "set", dev, "netns", name)
            peer = f"10.{subnet}.1.{2 - i}"
            for args in (("addr", "add", host.address, "peer", peer, "dev", dev),
                         ("link", "set", dev, "up"), ("link", "set", "lo", "up")):
                _ip("-n", name, *args)
    except (subprocess.CalledProcessError, OSError) as exc:
        _remove(hosts, "")
        for fd in fds:
            os.close(fd)
        pytest.skip(f"cannot make a delay link here: {exc}")
    queue: list[tuple[float, int, int, bytes]] = []
    ready = threading.Condition()
    stop = threading.Event()
    rng = random.Random(link.seed)
    counter = [0]

    def reader(src: int, dst: int) -> None:
        while not stop.is_set():
            try:
                packet = os.read(fds[src], 65536)
            except OSError:
                return
            with ready:
                if rng.random() < link.loss:
                    link.dropped += 1
                    continue
                counter[0] += 1
                heapq.heappush(queue, (time.monotonic() + link.delay_s, counter[0], dst,
                                       packet))
                ready.notify()

    def writer() -> None:
        while not stop.is_set():
            with ready:
                while not queue and not stop.is_set():
                    ready.wait(0.1)
                if stop.is_set():
                    return
                due, _, dst, packet = queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    ready.wait(wait)
                    continue
                heapq.heappop(queue)
            try:
                os.write(fds[dst], packet)
                link.forwarded += 1
            except OSError:
                pass

    threads = [threading.Thread(target=reader, args=(0, 1), daemon=True),
               threading.Thread(target=reader, args=(1, 0), daemon=True),
               threading.Thread(target=writer, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        yield hosts, link
    finally:
        stop.set()
        with ready:
            ready.notify_all()
        _remove(hosts, "")
        for fd in fds:
            os.close(fd)
