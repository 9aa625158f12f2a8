"""Turns a `SchedulerOutput` into one forward pass and one batched sampling call.

The runner holds the model, the KV cache and per-request sampling state (seeded
generators); it never decides which requests run.
"""

import torch
from torch import nn

from llmserve.core.scheduler import ScheduledRequest, SchedulerOutput
from llmserve.worker.attention import (
    AttentionMetadata,
    KVCache,
    PrefillChunk,
)
from llmserve.worker.sampler import SamplingBatch, sample


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device | str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run the step; return the sampled token for every request whose chunk ends its tokens."""
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        if not out.scheduled:
            return {}
        # decodes first: the attention metadata expects them at the front of the batch
        batch = sorted(out.scheduled, key=lambda s: len(s.token_ids) != 1)
        input_ids, positions, meta = self._prepare_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # (T, hidden)
        to_sample = [i for i, s in enumerate(batch) if s.sample]
        if not to_sample:
            return {}
        ends = torch.tensor([len(s.token_ids) for s in batch]).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[ends[to_sample].to(self.device)])
        rows = [batch[i] for i in to_sample]
        params = [s.sampling_params for s in rows]
        sampling = SamplingBatch.build(params, [self._generator(s) for s in rows], self.device)
        tokens = sample(logits, sampling).tolist()
        return {s.request_id: t for s, t in zip(rows, tokens, strict=True)}

    def _prepare_inputs(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        decodes = [s for s in batch if len(s.token_ids) == 1]
        for s in batch:
            start = s.start_position
            n = len(s.token_ids)
            if n > 1:
                table = torch.tensor(s.block_ids, dtype=torch.long, device=self.device)
                prefills.append(PrefillChunk(len(token_ids), n, start, table))
            token_ids.extend(s.token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in pos)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=self._padded_tables(decodes) if decodes else None,
            decode_seq_lens=torch.tensor(
                [s.start_position + 1 for s in decodes], device=self.device
            ) if decodes else None,
            prefills=prefills,
            block_size=bs,
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, meta

    def _padded_tables(self, decodes: list[ScheduledRequest]) -> torch.Tensor:
        """Block tables cut to the blocks in use and padded with block 0 (masked out)."""
        lens = [-(-(s.start_position + 1) // self.block_size) for s in decodes]
        width = max(lens)
        rows = [s.block_ids[:n] + [0] * (width - n) for s, n in zip(decodes, lens, strict=True)]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(s.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[s.request_id] = gen
        return gen
