"""Turns a `SchedulerOutput` into one forward pass and one batched sampling call.

The runner holds the model, the KV cache and per-request sampling state (seeded
generators); it never decides which requests run.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from llmserve.core.scheduler import ScheduledRequest, SchedulerOutput
from llmserve.worker.attention import AttentionMetadata, KVCache, attention_backend
from llmserve.worker.logprobs import PositionLogprobs, gather_logprobs
from llmserve.worker.sampler import SamplingBatch, sample

# prompt positions whose logits are materialised at once for prompt logprobs: (256, V) fp32
PROMPT_LOGPROBS_SLICE = 256


@dataclass
class RunnerOutput:
    """What one step produced, keyed by request id.

    `logprobs[id]` is the sampled token's (raw) logprobs, for requests asking for logprobs.
    `prompt_logprobs[id] = (first, positions)`: positions[i] scores prompt token
    `first + i` (first >= 1); a chunked prompt arrives over several steps.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(
        default_factory=dict
    )


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device | str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.attention = attention_backend(self.device)
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step: sample for every request whose chunk ends its tokens, and gather
        the logprobs and prompt logprobs asked for."""
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        if out.blocks_to_copy:
            self.kv_cache.copy_blocks(out.blocks_to_copy)
        result = RunnerOutput()
        if not out.scheduled:
            return result
        batch = out.scheduled
        input_ids, positions, meta = self._prepare_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # (T, hidden)
        ends = torch.tensor([len(s.token_ids) for s in batch]).cumsum(0) - 1
        for s, end in zip(batch, ends.tolist(), strict=True):
            if s.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden[end + 1 - len(s.token_ids) : end + 1], result)
        to_sample = [i for i, s in enumerate(batch) if s.sample]
        if not to_sample:
            return result
        logits = self.model.compute_logits(hidden[ends[to_sample].to(self.device)])  # (N, V)
        rows = [batch[i] for i in to_sample]
        params = [s.sampling_params for s in rows]
        sampling = SamplingBatch.build(
            params, [self._generator(s) for s in rows], self.device, histories=rows
        )
        tokens = sample(logits, sampling)  # (N,)
        result.sampled = dict(zip([s.request_id for s in rows], tokens.tolist(), strict=True))
        self._sample_logprobs(rows, logits, tokens, result)
        return result

    def _sample_logprobs(
        self, rows: list[ScheduledRequest], logits: torch.Tensor, tokens: torch.Tensor,
        result: RunnerOutput,
    ) -> None:
        """Raw logprobs of the sampled tokens (logits: (N, V), tokens: (N,))."""
        want = [i for i, s in enumerate(rows) if s.sampling_params.logprobs is not None]
        if not want:
            return
        k = max(rows[i].sampling_params.logprobs for i in want)
        index = torch.tensor(want, device=self.device)
        gathered = gather_logprobs(logits[index].log_softmax(dim=-1), tokens[index], k)
        for i, position in zip(want, gathered, strict=True):
            s = rows[i]
            result.logprobs[s.request_id] = position.truncated(s.sampling_params.logprobs)

    def _prompt_logprobs(
        self, s: ScheduledRequest, hidden: torch.Tensor, result: RunnerOutput
    ) -> None:
        """Raw logprobs of the prompt tokens this chunk predicts (hidden: (n, hidden)).

        Position p's logits score prompt token p + 1; the last prompt position predicts the
        first output token and is not part of the prompt logprobs.
        """
        num_prompt = len(s.prompt_token_ids)
        num = min(len(s.token_ids), num_prompt - 1 - s.start_position)
        if num <= 0:
            return
        targets = torch.tensor(
            s.prompt_token_ids[s.start_position + 1 : s.start_position + 1 + num],
            device=self.device,
        )
        k = s.sampling_params.prompt_logprobs
        positions: list[PositionLogprobs] = []
        for lo in range(0, num, PROMPT_LOGPROBS_SLICE):
            hi = min(num, lo + PROMPT_LOGPROBS_SLICE)
            logprobs = self.model.compute_logits(hidden[lo:hi]).log_softmax(dim=-1)
            positions += gather_logprobs(logprobs, targets[lo:hi], k)
        result.prompt_logprobs[s.request_id] = (s.start_position + 1, positions)

    def _prepare_inputs(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        for s in batch:
            token_ids.extend(s.token_ids)
            positions.extend(range(s.start_position, s.start_position + len(s.token_ids)))
        meta = AttentionMetadata.build(
            [len(s.token_ids) for s in batch], [s.start_position for s in batch],
            [s.block_ids for s in batch], self.block_size, self.device, self.attention,
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, meta

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
