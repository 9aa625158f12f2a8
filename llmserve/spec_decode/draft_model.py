"""A draft model proposes: a smaller (or quantized) model with the target's tokenizer.

It keeps its own small paged KV cache. Per request it remembers the tokens whose K/V it
holds; at each proposal it keeps the longest prefix of those that the target verified,
feeds what it has not seen (the whole prompt the first time; after a round, the accepted
drafts it did not feed and the target's own token), then decodes greedily:

    fed:       | verified, in the draft cache | new: catch-up | d1 ... d(k-1) |
    proposed:                                   d1 (from the catch-up)  d2 ... dk

All speculating requests go through each of these forwards together. Drafts are greedy, a
point mass q, which the rejection rule handles exactly (`worker/rejection_sampler.py`), so
the output keeps the target's distribution whatever the draft.

`self_draft` is this with the target's own checkpoint on its fast quantized path: the
exact float32 target verifies what its int4 self proposes.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.spec_decode.cost import time_step
from llmserve.spec_decode.proposer import Proposer
from llmserve.worker.drafts import DraftSeed
from llmserve.worker.sampler import argmax

if TYPE_CHECKING:
    from llmserve.config.engine import EngineConfig, SpeculativeConfig
    from llmserve.loader.model_loader import LoadedModel

logger = logging.getLogger(__name__)

# the draft's KV cache holds as many tokens as the target's, within this many bytes
DRAFT_KV_CACHE_BYTES = 512 * 2**20


@dataclass
class _DraftSequence:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # whose K/V the draft cache holds
    last_used: int = 0


class DraftModelProposer(Proposer):
    def __init__(self, loaded: "LoadedModel", kv_cache: KVCache,
                 attention: AttentionBackend, device: torch.device) -> None:
        self.model = loaded.model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.block_size = kv_cache.block_size
        self.free_blocks = list(range(kv_cache.num_blocks - 1, -1, -1))  # a stack
        self.seqs: dict[str, _DraftSequence] = {}
        self._round = 0

    @classmethod
    def build(cls, spec: "SpeculativeConfig", engine: "EngineConfig",
              target: "LoadedModel", device: torch.device,
              target_num_tokens: int) -> "DraftModelProposer":
        """Load the draft (`spec.model`, or the target's checkpoint for self_draft) and
        give it a KV cache; refuse a draft whose tokenizer differs from the target's."""
        from llmserve.layers.kv_cache import resolve_kv_cache_dtype
        from llmserve.loader.catalog import resolve_model
        from llmserve.loader.model_loader import load_model
        from llmserve.memory import kv_bytes_per_token
        from llmserve.models.compile import warm_up

        spec_model = spec.model if spec.method == "draft_model" else engine.model
        quantization = spec.draft_quantization
        if quantization == "auto" and spec.method == "self_draft" and \
                resolve_model(spec_model).kind != "gguf":
            quantization = "int4"  # a float checkpoint's fast path
        quantization = None if quantization == "none" else quantization
        loaded = load_model(spec_model, torch.float32, device, quantization,
                            engine.enforce_eager)
        if spec.method == "self_draft" and loaded.quantization == target.quantization:
            raise ValueError(
                "speculative_config: self_draft speeds up the exact path (dtype float32); "
                f"here the target already runs the draft's weights "
                f"({target.quantization or 'float'}), so drafting could only slow it down")
        _check_same_tokenizer(loaded, target)
        attention = attention_backend(device, engine.attention_backend)
        kv_dtype = resolve_kv_cache_dtype("auto", torch.float32, loaded.quantization,
                                          attention.reads_only_written_slots)
        cfg = loaded.config
        per_token = kv_bytes_per_token(cfg, kv_dtype)
        num_tokens = min(target_num_tokens, DRAFT_KV_CACHE_BYTES // per_token)
        num_blocks = max(1, num_tokens // engine.block_size)
        kv_cache = KVCache.allocate(
            cfg.num_hidden_layers, num_blocks, engine.block_size, cfg.num_key_value_heads,
            cfg.head_dim, kv_dtype, device, zeroed=not attention.reads_only_written_slots)
        warm_up(loaded.model, kv_cache, attention)
        logger.info("speculative decoding: %s drafts with %s (%s weights), KV cache of %d "
                    "tokens", spec.method, loaded.source.name,
                    loaded.quantization or "float32", num_blocks * engine.block_size)
        return cls(loaded, kv_cache, attention, device)

    # ---- proposing -----------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seeds: Sequence[DraftSeed]) -> list[list[int]]:
        self._round += 1
        drafts: list[list[int]] = [[] for _ in seeds]
        batch = []  # (index, sequence, tokens to feed, drafts wanted)
        active = {s.request_id for s in seeds}
        for i, seed in enumerate(seeds):
            k = seed.num_drafts
            seq = self.seqs.setdefault(seed.request_id, _DraftSequence())
            seq.last_used = self._round
            tokens = seed.token_ids
            # the last verified token is always fed (again, if the draft fed it as a draft
            # the scheduler then left out): its logits propose the first draft
            keep = min(_common_prefix(seq.tokens, tokens), len(tokens) - 1)
            del seq.tokens[keep:]
            feed = tokens[keep:]
            # slots for the catch-up and the k - 1 drafts fed back
            if k > 0 and self._reserve(seq, keep + len(feed) + k - 1, active):
                batch.append((i, seq, feed, k))
        if not batch:
            return drafts
        # forward 1: each sequence's catch-up; its last logits propose the first draft
        proposed = self._forward([seq for _, seq, _, _ in batch], [f for _, _, f, _ in batch])
        for (i, _, _, _), token in zip(batch, proposed, strict=True):
            drafts[i].append(token)
        # then one token per sequence and step, while some want more
        for step in range(1, max(k for _, _, _, k in batch)):
            going = [(i, seq) for i, seq, _, k in batch if k > step]
            proposed = self._forward([seq for _, seq in going],
                                     [[drafts[i][-1]] for i, _ in going])
            for (i, _), token in zip(going, proposed, strict=True):
                drafts[i].append(token)
        return drafts

    def _forward(self, seqs: list[_DraftSequence], feeds: list[list[int]]) -> list[int]:
        """Append `feeds[b]` to sequence b (computing their K/V) and return each
        sequence's greedy next token."""
        query_lens = [len(f) for f in feeds]
        context_lens = [len(s.tokens) for s in seqs]
        width = max(len(s.blocks) for s in seqs)
        block_table = np.zeros((len(seqs), width), dtype=np.int32)
        for b, s in enumerate(seqs):
            block_table[b, : len(s.blocks)] = s.blocks
        positions = np.concatenate([np.arange(c, c + n) for c, n in
                                    zip(context_lens, query_lens, strict=True)])
        meta = AttentionMetadata.from_block_table(
            block_table, np.arange(len(seqs)), query_lens, context_lens, positions,
            self.block_size, self.device, self.attention)
        input_ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long,
                                 device=self.device)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device),
                            self.kv_cache, meta)  # (T, H)
        last = torch.tensor(np.cumsum(query_lens) - 1, device=self.device)
        tokens = argmax(self.model.compute_logits(hidden[last])).tolist()  # (B,)
        for s, f in zip(seqs, feeds, strict=True):
            s.tokens.extend(f)
        return tokens

    def step_seconds(self, batch: int, repeats: int = 5) -> float:
        """Seconds of one draft step at `batch` sequences, best of `repeats` (start-up
        calibration, before any request holds the draft cache's blocks)."""
        return time_step(self.model, self.kv_cache, self.attention, batch, 1, repeats)

    # ---- the draft cache's blocks ----------------------------------------------------------

    def _reserve(self, seq: _DraftSequence, num_tokens: int, active: set[str]) -> bool:
        """Blocks for `num_tokens` in `seq`, evicting idle sequences (least recently used
        first) when the cache is full; False (and `seq` dropped) if they cannot fit."""
        needed = -(-num_tokens // self.block_size) - len(seq.blocks)
        while needed > len(self.free_blocks):
            idle = [rid for rid, s in self.seqs.items() if rid not in active]
            if not idle:
                self._release(seq)
                return False
            self.remove(min(idle, key=lambda rid: self.seqs[rid].last_used))
        for _ in range(max(needed, 0)):
            seq.blocks.append(self.free_blocks.pop())
        return True

    def _release(self, seq: _DraftSequence) -> None:
        self.free_blocks.extend(seq.blocks)
        seq.blocks, seq.tokens = [], []

    def remove(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._release(seq)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix. The draft's tokens differ from the target's only in
    their last few (drafts the target rejected), so the bulk is one list compare."""
    n = min(len(a), len(b))
    start = max(0, n - 32)
    if a[:start] != b[:start]:
        start = 0
    while start < n and a[start] == b[start]:
        start += 1
    return start


def _check_same_tokenizer(draft: "LoadedModel", target: "LoadedModel") -> None:
    if draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise ValueError(
            f"speculative_config: the draft model {draft.source.name} has a different "
            f"tokenizer from the target {target.source.name}; a draft must share the "
            "target's vocabulary")
