"""The interface disaggregated prefill/decode attaches at: a `KVConnector` moves prompts' KV
between engines by block id; the gloo transfer (`distributed/kv_transfer.py`) is one
implementation.

    prefill engine                                   decode engine
    scheduler: KVSave(request, transfer id,          server: wait_for(transfer id) -> header
               prompt block ids) as data             engine: request.remote_kv = header
    runner, after sampling the first token:          scheduler: fresh blocks,
      save_kv(cache, save, prompt, first token)        KVLoad(request, transfer id, block ids)
                      ---- blocks + header ---->     runner, before the forward:
                                                       load_kv(cache, load)
"""

from abc import ABC, abstractmethod

from llmserve.core.outputs import KVLoad, KVSave
from llmserve.distributed.kv_transfer import (
    KVBlocks,
    KVReceiver,
    KVSender,
    KVTransferConfig,
    TransferredKV,
    TransferStats,
    connect,
)
from llmserve.layers.kv_cache import KVCache


class KVConnector(ABC):
    """Moves a prompt's KV from a prefill engine's cache into a decode engine's.

    Contract: the scheduler never calls a connector; it schedules `KVSave`s and `KVLoad`s
    as data (`core/outputs.py`) and the model runner calls `save_kv` after sampling a
    saved request's first token (its prompt's blocks hold their KV; they are read before
    anything can overwrite them) and `load_kv` before the forward pass of the step that
    admits a loaded request (its blocks are fresh and its own). Both run on the engine
    thread and must not block on the peer: bytes move on the connector's own threads.
    `stats` and `failure` are read by the metrics and by `Engine.failure`.
    """

    role: str  # "prefill" or "decode"

    @property
    @abstractmethod
    def stats(self) -> TransferStats:
        """Totals so far, and `failure` (why the peer is gone, or None)."""

    @abstractmethod
    def save_kv(self, kv_cache: KVCache, save: KVSave, prompt_token_ids: list[int],
                first_token: int) -> None:
        """Prefill side: send the blocks `save.block_ids` under `save.transfer_id`."""

    @abstractmethod
    def wait_for(self, transfer_id: str, timeout: float) -> TransferredKV:
        """Decode side: the header of transfer `transfer_id` once it has arrived (its
        blocks stay here until `load_kv` or `release`); TimeoutError, or ConnectionError
        when the prefill engine is gone."""

    @abstractmethod
    def load_kv(self, kv_cache: KVCache, load: KVLoad) -> None:
        """Decode side: write transfer `load.transfer_id`'s blocks into `load.block_ids`."""

    @abstractmethod
    def release(self, transfer_id: str) -> None:
        """Decode side: drop a transfer whose request ended before it was admitted."""


class GlooKVConnector(KVConnector):
    """Both roles over a two-process gloo group (`kv_transfer.py`)."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.role = config.role
        group = connect(config)
        self.sender = KVSender(group) if config.role == "prefill" else None
        self.receiver = KVReceiver(group) if config.role == "decode" else None

    @property
    def stats(self) -> TransferStats:
        return (self.sender or self.receiver).stats

    def save_kv(self, kv_cache: KVCache, save: KVSave, prompt_token_ids: list[int],
                first_token: int) -> None:
        self.sender.send(TransferredKV(save.transfer_id, prompt_token_ids, first_token,
                                       save.block_hashes,
                                       KVBlocks.gather(kv_cache, save.block_ids)))

    def wait_for(self, transfer_id: str, timeout: float) -> TransferredKV:
        return self.receiver.wait(transfer_id, timeout)

    def load_kv(self, kv_cache: KVCache, load: KVLoad) -> None:
        self.receiver.take(load.transfer_id).scatter(kv_cache, load.block_ids)

    def release(self, transfer_id: str) -> None:
        self.receiver.take(transfer_id, missing_ok=True)


def make_kv_connector(role: str | None, address: str | None) -> KVConnector | None:
    if role is None:
        return None
    return GlooKVConnector(KVTransferConfig.parse(role, address))
