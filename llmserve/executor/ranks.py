"""How the ranks of a tensor-parallel engine meet and talk: the process groups, the
messages rank 0 sends its workers, and what the workers are told to build."""

import contextlib
import datetime
import os
import pickle
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from llmserve.distributed.channels import Channels
from llmserve.distributed.parallel import TensorParallel
from llmserve.distributed.pipeline import PipelineStage

# collectives wait this long for a peer; an idle server's workers wait for the next step
# far longer than any step, and a dead peer is seen by its closed connection, not by this
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
CONNECT_TIMEOUT = datetime.timedelta(seconds=300)  # ranks loading models before they meet
REACH_TIMEOUT = datetime.timedelta(seconds=10)  # one rank connecting to another


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its share of the model (sent once by rank 0)."""

    model: str | None
    dtype: torch.dtype
    device: str
    quantization: str | None
    num_threads: int | None
    seed: int
    # a pipeline's layers per stage, as rank 0 split them (empty: no pipeline)
    stage_layers: tuple[range, ...] = ()


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache every rank allocates for its own KV heads (sent after loading)."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype
    attention_backend: str
    max_num_seqs: int


@dataclass
class Ranks:
    """One rank's groups: `tp` for the model's collectives (its stage's), `control` (gloo,
    every rank) for messages and the pipeline's activations, `stage` its pipeline stage
    (size 1: no pipeline)."""

    tp: TensorParallel
    control: Any  # a c10d ProcessGroup
    stage: PipelineStage = field(default_factory=PipelineStage)
    channels: Channels | None = None  # rank 0's messages, the pipeline's activations

    @property
    def world_size(self) -> int:
        return self.tp.size * self.stage.size


def connect(rank: int, size: int, host: str, port: int, device: torch.device,
            pipeline_size: int = 1) -> Ranks:
    """Meet the other ranks at host:port (rank 0 hosts the store): `size` ranks in
    `pipeline_size` stages of size // pipeline_size (rank = stage x that + rank in it).

    Each rank talks from the address of its interface that routes to `host` (not the one
    its hostname resolves to, often the loopback), and first checks that it reaches every
    other rank there: a rank that cannot says which and exits, instead of waiting in the
    process group's connection for ever."""
    address = route_address(host)
    try:
        store = dist.TCPStore(host, port, size, rank == 0, timeout=CONNECT_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - any failure to meet is said the same way
        raise RuntimeError(f"rank {rank} ({address}) cannot reach the engine's store at "
                           f"{host}:{port}: {str(exc).splitlines()[0][:200]}") from None
    channels = Channels(rank, check_reachable(store, rank, size, address), store)
    control = _gloo(store, rank, size, address)
    tp_size = size // pipeline_size
    index, tp_rank = divmod(rank, tp_size)
    group = control
    if pipeline_size > 1 and tp_size > 1:  # the stage's own group
        group = _gloo(dist.PrefixStore(f"stage{index}", store), tp_rank, tp_size, address)
    if device.type == "cuda" and tp_size > 1:
        group = dist.ProcessGroupNCCL(dist.PrefixStore(f"nccl{index}", store), tp_rank,
                                      tp_size)
    stage = PipelineStage(index, pipeline_size, range(0), channels, tp_rank, tp_size)
    return Ranks(TensorParallel(tp_rank, tp_size, group, exchange=device.type != "cuda"),
                 control, stage, channels)


def route_address(host: str) -> str:
    """This machine's address on the interface that routes to `host` (IPv4; no packet is
    sent)."""
    target = socket.getaddrinfo(host, 1, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 1))
        return probe.getsockname()[0]


def _gloo(store: Any, rank: int, size: int, address: str) -> Any:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, options)


def check_reachable(store: Any, rank: int, size: int, address: str) -> socket.socket:
    """Every rank listens on `address` and connects to every other's (each publishing its
    own in the store); raises naming the first rank it cannot reach within
    REACH_TIMEOUT. Returns once every rank has checked (no listener closes early), with
    the listener: the rank's channels (`distributed/channels.py`) go on with it."""
    listener = socket.create_server((address, 0))
    with contextlib.ExitStack() as on_error:
        on_error.callback(listener.close)
        listener.settimeout(0.2)
        store.set(f"reach/{rank}", f"{address}:{listener.getsockname()[1]}")
        stop = threading.Event()
        acceptor = threading.Thread(target=_accept_until, args=(listener, stop), daemon=True)
        acceptor.start()
        try:
            for peer in range(size):
                if peer == rank:
                    continue
                peer_host, peer_port = store.get(f"reach/{peer}").decode().rsplit(":", 1)
                try:
                    socket.create_connection((peer_host, int(peer_port)),
                                             REACH_TIMEOUT.total_seconds()).close()
                except OSError as exc:
                    raise RuntimeError(
                        f"rank {rank} ({address}) cannot reach rank {peer} at {peer_host}:"
                        f"{peer_port} ({exc}); every rank talks from its interface that "
                        "routes to the master address, and the ranks must reach each "
                        "other there") from None
            store.set(f"reached/{rank}", "1")
            store.wait([f"reached/{peer}" for peer in range(size)])
        finally:
            stop.set()
            acceptor.join()
        on_error.pop_all()
    return listener


def _accept_until(listener: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            listener.accept()[0].close()
        except (TimeoutError, OSError):
            continue


def broadcast_object(channels: Channels, workers: range, obj: Any) -> None:
    """Rank 0: `obj` to every worker (pickled; queued, each worker reads it when it gets
    to it)."""
    data = pickle.dumps(obj)
    for worker in workers:
        channels.send(worker, CONTROL_TAG, data)


def receive_object(channels: Channels) -> Any:
    """A worker: rank 0's next message."""
    return pickle.loads(channels.receive(0, CONTROL_TAG))


def all_gather_values(control: Any, values: list[float]) -> list[list[float]]:
    """Every rank's `values` (as many on each; integers below 2**53 exactly), rank order."""
    parts = [torch.zeros(len(values), dtype=torch.float64) for _ in range(control.size())]
    control.allgather([parts], [torch.tensor(values, dtype=torch.float64)]).wait()
    return [p.tolist() for p in parts]


CONTROL_TAG = 1  # rank 0's messages (the model's exchanges use parallel.EXCHANGE_TAG)

# messages rank 0 broadcasts to the workers (FINISH: to stage 0's other ranks, whose
# logits all-gather a step ends with, once the pipeline's last stage is done)
STEP, FINISH, ROWS, TIMING, CALIBRATE, STOP = ("step", "finish", "rows", "timing",
                                               "calibrate", "stop")


def torchrun_env() -> tuple[int, int, str, int]:
    """(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as torchrun sets them. The engine's own
    store listens on MASTER_PORT + 1 (torchrun's rendezvous holds MASTER_PORT)."""
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except KeyError as missing:
        raise RuntimeError(f"external_launcher needs torchrun's environment: {missing} is not "
                           "set (start every rank with torchrun)") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
