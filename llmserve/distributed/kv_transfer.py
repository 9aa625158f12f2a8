"""Disaggregated prefill/decode: a prompt's KV blocks go from a prefill engine to a decode
engine over `torch.distributed` (gloo send/recv; blocks only, nothing is recomputed).

`llmserve serve --role prefill --kv-transfer-address HOST:PORT` and `llmserve serve --role
decode --kv-transfer-address HOST:PORT` meet at HOST:PORT (the decode server hosts the
store, the prefill server connects): a process group of two, prefill rank 0, decode rank 1.
`llmserve router --prefill URL --decode URL` sends each request to the prefill server with
`max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true, "transfer_id": id}`,
then to the decode server with `kv_transfer_params: {"transfer_id": id}`.

The engine sees this through `engine/kv_connector.py` (a `KVConnector`: `GlooKVConnector`):

* Prefill side: when such a request samples its first token, the runner copies its
  prompt's blocks out of the cache (one tensor for all layers, K and V) and `KVSender`
  sends them on its thread, with a header: the transfer id, the prompt's token ids, the
  first token the prefill sampled, the prompt's block hashes (prefix caching), the layout.
* Decode side: `KVReceiver` takes transfers on its thread and keeps them until the request
  with that id arrives (`wait`: its header) and is admitted (`take`: its blocks); the
  scheduler then gives the request fresh blocks, the runner writes the received blocks
  into them before the step's forward pass, and the first token is taken as if sampled:
  the next step decodes from it. Full blocks enter the decode engine's prefix cache (their
  hashes are recomputed there and checked against the ones that travelled).
"""

import datetime
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from llmserve.layers.kv_cache import KVCache

# the cache dtypes a transfer may carry, by their `str(dtype)`
_KV_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int8)}

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
PREFILL_RANK, DECODE_RANK = 0, 1
CONNECT_TIMEOUT = datetime.timedelta(seconds=600)
TRANSFER_TIMEOUT = datetime.timedelta(days=7)  # idle servers wait this long between transfers
UNCLAIMED_TTL_S = 600.0  # a transfer no request asked for is dropped after this
TRANSFER_TAG, WATCH_TAG = 0, 1  # transfers; a receive that only ends when the peer goes


@dataclass
class KVBlocks:
    """A prompt's KV: `data` (layers, 2, blocks, block_size, kv_heads, head_dim) in the cache
    dtype, `scales` (layers, 2, blocks, block_size, kv_heads) for an int8 cache."""

    data: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_bytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scales

    @classmethod
    def gather(cls, cache: KVCache, block_ids: list[int]) -> "KVBlocks":
        shape = (len(cache.key), 2, len(block_ids), *cache.key[0].shape[1:])
        data = torch.empty(shape, dtype=cache.dtype)
        scales = None
        if cache.key_scales is not None:
            scales = torch.empty(shape[:-1], dtype=torch.float32)
        cache.read_blocks(block_ids, data, scales)
        return cls(data, scales)

    def scatter(self, cache: KVCache, block_ids: list[int]) -> None:
        """Write these blocks into `cache` at `block_ids` (its layout must match)."""
        expected = (len(cache.key), 2, len(block_ids), *cache.key[0].shape[1:])
        if tuple(self.data.shape) != expected or self.data.dtype != cache.key[0].dtype:
            raise ValueError(f"transferred KV {tuple(self.data.shape)} {self.data.dtype} does "
                             f"not fit this cache {expected} {cache.key[0].dtype}: the prefill "
                             "and decode servers must run the same model, dtype and KV-cache "
                             "dtype and block size")
        cache.write_blocks(block_ids, self.data,
                           self.scales if cache.key_scales is not None else None)


@dataclass
class TransferredKV:
    """What the decode engine needs to continue a request the prefill engine started."""

    transfer_id: str
    prompt_token_ids: list[int]
    first_token: int
    block_hashes: list[bytes]
    blocks: KVBlocks | None  # None in a header (`KVReceiver.wait`)
    seconds: float = 0.0  # on the wire
    num_bytes: int = 0  # of the blocks, as received
    received_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class KVTransferConfig:
    role: str  # "prefill" or "decode"
    host: str
    port: int

    @classmethod
    def parse(cls, role: str, address: str) -> "KVTransferConfig":
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kv_transfer_address must be HOST:PORT, not {address!r}")
        return cls(role, host, int(port))


def connect(config: KVTransferConfig) -> Any:
    """The two-process gloo group of a prefill and a decode server (blocks until both are
    there; the decode server hosts the store)."""
    rank = PREFILL_RANK if config.role == "prefill" else DECODE_RANK
    logger.info("KV transfer: %s side waiting for its peer at %s:%d", config.role,
                config.host, config.port)
    store = dist.TCPStore(config.host, config.port, 2, rank == DECODE_RANK,
                          timeout=CONNECT_TIMEOUT)
    group = dist.ProcessGroupGloo(store, rank, 2, TRANSFER_TIMEOUT)
    logger.info("KV transfer: connected (%s side)", config.role)
    return group


@dataclass
class TransferStats:
    """Totals for /metrics: transfers, bytes, seconds on the wire."""

    num_transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    failure: str | None = None  # the peer went away


class KVSender:
    """Prefill side: sends transfers in order on its own thread. A second thread waits on
    a receive the decode side never answers, so that a decode server that goes away is
    seen at once (its connection closes), not at the next transfer."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.stats = TransferStats()
        self._queue: list[TransferredKV] = []
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="llmserve-kv-send")
        self._thread.start()
        threading.Thread(target=self._watch_peer, daemon=True, name="llmserve-kv-watch").start()

    def _watch_peer(self) -> None:
        try:
            self.group.recv([torch.zeros(1)], DECODE_RANK, WATCH_TAG).wait()
        except Exception as exc:  # noqa: BLE001 - the decode side is gone
            self.stats.failure = self.stats.failure or f"the decode server went away: {exc}"
            logger.error("KV transfer: %s", self.stats.failure)

    def send(self, transfer: TransferredKV) -> None:
        with self._ready:
            self._queue.append(transfer)
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                transfer = self._queue.pop(0)
            start = time.perf_counter()
            try:
                self._send_one(transfer)
            except Exception as exc:  # noqa: BLE001 - the decode side is gone
                self.stats.failure = f"KV transfer to the decode server failed: {exc}"
                logger.error("%s", self.stats.failure)
                return
            self.stats.num_transfers += 1
            self.stats.num_bytes += transfer.blocks.num_bytes
            self.stats.seconds += time.perf_counter() - start

    def _send_one(self, t: TransferredKV) -> None:
        blocks = t.blocks
        header = json.dumps({
            "transfer_id": t.transfer_id, "prompt_token_ids": t.prompt_token_ids,
            "first_token": t.first_token, "block_hashes": [h.hex() for h in t.block_hashes],
            "shape": list(blocks.data.shape), "dtype": str(blocks.data.dtype),
            "scales_shape": None if blocks.scales is None else list(blocks.scales.shape),
        }).encode()
        self._put(torch.tensor([len(header)], dtype=torch.int64))
        self._put(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self._put(_as_bytes(blocks.data))
        if blocks.scales is not None:
            self._put(blocks.scales.contiguous())

    def _put(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor], DECODE_RANK, TRANSFER_TAG).wait()


class KVReceiver:
    """Decode side: receives transfers on its own thread; `wait` hands one's header over,
    `take` its blocks."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.stats = TransferStats()
        self._arrived: dict[str, TransferredKV] = {}
        self._claimed: set[str] = set()  # asked for by a request: never dropped unclaimed
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="llmserve-kv-recv")
        self._thread.start()

    def wait(self, transfer_id: str, timeout: float) -> TransferredKV:
        """The header of transfer `transfer_id` (no blocks: they stay here until `take`),
        once it has arrived (TimeoutError after `timeout` s, ConnectionError if the
        prefill server went away)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while transfer_id not in self._arrived:
                if self.stats.failure is not None:
                    raise ConnectionError(self.stats.failure)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no KV arrived for transfer {transfer_id!r} within "
                                       f"{timeout:.0f} s")
                self._changed.wait(min(left, 1.0))
            self._claimed.add(transfer_id)
            return replace(self._arrived[transfer_id], blocks=None)

    def take(self, transfer_id: str, missing_ok: bool = False) -> KVBlocks | None:
        """The blocks of a transfer `wait` handed over, which leaves here."""
        with self._changed:
            self._claimed.discard(transfer_id)
            transfer = self._arrived.pop(transfer_id, None)
        if transfer is None:
            if missing_ok:
                return None
            raise KeyError(f"KV transfer {transfer_id!r} is not here (taken already?)")
        return transfer.blocks

    def _run(self) -> None:
        while True:
            try:
                transfer = self._receive_one()
            except Exception as exc:  # noqa: BLE001 - the prefill side is gone
                with self._changed:
                    self.stats.failure = f"the prefill server went away: {exc}"
                    self._changed.notify_all()
                logger.error("KV transfer: %s", self.stats.failure)
                return
            self.stats.num_transfers += 1
            self.stats.num_bytes += transfer.blocks.num_bytes
            self.stats.seconds += transfer.seconds
            with self._changed:
                self._drop_unclaimed()
                self._arrived[transfer.transfer_id] = transfer
                self._changed.notify_all()

    def _receive_one(self) -> TransferredKV:
        size = self._get(torch.zeros(1, dtype=torch.int64))
        start = time.perf_counter()  # the header's arrival: the transfer is under way
        # JSON, not pickle: a peer's bytes never run as code here
        header = json.loads(self._get(torch.empty(int(size), dtype=torch.uint8))
                            .numpy().tobytes())
        dtype = _KV_DTYPES[header["dtype"]]
        shape = header["shape"]
        nbytes = torch.empty((), dtype=dtype).element_size()
        for dim in shape:
            nbytes *= dim
        raw = self._get(torch.empty(nbytes, dtype=torch.uint8))
        data = raw.view(dtype).reshape(shape)
        scales = None
        if header["scales_shape"] is not None:
            scales = self._get(torch.empty(header["scales_shape"], dtype=torch.float32))
        return TransferredKV(header["transfer_id"], header["prompt_token_ids"],
                             header["first_token"],
                             [bytes.fromhex(h) for h in header["block_hashes"]],
                             KVBlocks(data, scales), time.perf_counter() - start,
                             KVBlocks(data, scales).num_bytes)

    def _get(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.recv([tensor], PREFILL_RANK, TRANSFER_TAG).wait()
        return tensor

    def _drop_unclaimed(self) -> None:
        now = time.monotonic()
        for transfer_id in [t for t, kv in self._arrived.items() if t not in self._claimed
                            and now - kv.received_at > UNCLAIMED_TTL_S]:
            logger.warning("KV transfer %s was never asked for; dropped", transfer_id)
            del self._arrived[transfer_id]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
