"""Turns a `SchedulerOutput` into one forward pass and one batched sampling call.

The runner holds the model, the KV cache and a persistent batch of the requests it runs
(`InputBatch`: block tables, sampling parameters, seeded generators, penalty counts),
updated by each step's deltas; it never decides which requests run.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from llmserve.core.scheduler import ScheduledRequest, SchedulerOutput
from llmserve.structured import GrammarStep
from llmserve.worker.attention import AttentionBackend, KVCache, attention_backend
from llmserve.worker.input_batch import InputBatch, RequestRow
from llmserve.worker.logprobs import PositionLogprobs, gather_logprobs
from llmserve.worker.sampler import argmax, sample

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
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device | str,
                 max_num_seqs: int = 256, attention: AttentionBackend | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.attention = attention or attention_backend(self.device)
        self.input_batch = InputBatch(max_num_seqs, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar: GrammarStep | None = None) -> RunnerOutput:
        """Run the step: sample for every request whose chunk ends its tokens (within its
        grammar's mask, for structured output), and gather the logprobs and prompt logprobs
        asked for."""
        batch = self.input_batch
        batch.update(out)
        if out.blocks_to_copy:
            self.kv_cache.copy_blocks(out.blocks_to_copy)
        result = RunnerOutput()
        if not out.scheduled:
            return result
        step = batch.prepare(out.scheduled, self.attention)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.metadata)  # (T, H)
        for i in np.flatnonzero(batch.prompt_logprobs[step.rows]).tolist():
            s, end = out.scheduled[i], int(step.last_token[i])
            self._prompt_logprobs(s, batch.rows[step.rows[i]],
                                  hidden[end + 1 - len(s.token_ids) : end + 1], result)
        to_sample = [i for i, s in enumerate(out.scheduled) if s.sample]
        if not to_sample:
            return result
        rows = step.rows[to_sample]
        last = torch.from_numpy(step.last_token[to_sample]).to(self.device)
        logits = self.model.compute_logits(hidden[last])  # (N, V)
        sampling = batch.sampling_batch(rows, logits.shape[-1])
        request_ids = [out.scheduled[i].request_id for i in to_sample]
        raw_needed = bool((batch.logprobs[rows] >= 0).any())  # logprobs are of raw logits
        allowed = logits if grammar is None else grammar.apply(logits, request_ids,
                                                                copy=raw_needed)
        tokens = argmax(allowed) if sampling is None else sample(allowed, sampling)  # (N,)
        result.sampled = dict(zip(request_ids, tokens.tolist(), strict=True))
        self._sample_logprobs(request_ids, rows, logits, tokens, result)
        return result

    def _sample_logprobs(
        self, request_ids: list[str], rows: np.ndarray, logits: torch.Tensor,
        tokens: torch.Tensor, result: RunnerOutput,
    ) -> None:
        """Raw logprobs of the sampled tokens (logits: (N, V), tokens: (N,))."""
        ks = self.input_batch.logprobs[rows]  # (N,) -1: not asked for
        want = np.flatnonzero(ks >= 0)
        if len(want) == 0:
            return
        index = torch.from_numpy(want).to(self.device)
        gathered = gather_logprobs(logits[index].log_softmax(dim=-1), tokens[index],
                                   int(ks[want].max()))
        for i, position in zip(want.tolist(), gathered, strict=True):
            result.logprobs[request_ids[i]] = position.truncated(int(ks[i]))

    def _prompt_logprobs(
        self, s: ScheduledRequest, request: RequestRow, hidden: torch.Tensor,
        result: RunnerOutput,
    ) -> None:
        """Raw logprobs of the prompt tokens this chunk predicts (hidden: (n, hidden)).

        Position p's logits score prompt token p + 1; the last prompt position predicts the
        first output token and is not part of the prompt logprobs.
        """
        num_prompt = len(request.prompt_token_ids)
        num = min(len(s.token_ids), num_prompt - 1 - s.start_position)
        if num <= 0:
            return
        targets = torch.tensor(
            request.prompt_token_ids[s.start_position + 1 : s.start_position + 1 + num],
            device=self.device,
        )
        k = request.sampling_params.prompt_logprobs
        positions: list[PositionLogprobs] = []
        for lo in range(0, num, PROMPT_LOGPROBS_SLICE):
            hi = min(num, lo + PROMPT_LOGPROBS_SLICE)
            logprobs = self.model.compute_logits(hidden[lo:hi]).log_softmax(dim=-1)
            positions += gather_logprobs(logprobs, targets[lo:hi], k)
        result.prompt_logprobs[s.request_id] = (s.start_position + 1, positions)
