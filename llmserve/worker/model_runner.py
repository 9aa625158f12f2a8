"""Turns a `SchedulerOutput` into one forward pass and one batched sampling call.

The runner holds the model, the KV cache and a persistent batch of the requests it runs
(`InputBatch`: block tables, sampling parameters, seeded generators, penalty counts),
updated by each step's deltas; it never decides which requests run, and it knows nothing
of other ranks (an executor drives one runner per rank, `executor/`).

    execute_model(out) -> ModelRunnerOutput   row i for out.scheduled[i]
        rows dropped / added, new block ids  (InputBatch.update)
        KV loads written                     (kv_connector.load_kv, disaggregated decode)
        KV tier blocks read in               (kv_tier.load; their requests compute nothing)
        slices of the asked images' encodes  (encoder_cache: once per image, beside the
                                             step's tokens, never a whole image in a step)
        forward over the flat batch          (image tokens take their image's rows)
        blocks the forward filled kept       (kv_tier.save: copied now, written off-step)
        prompt logprobs of prefill chunks
        pooling requests' chunks pooled; their outputs once their prompt is done
        logits at the sample positions (at each draft too) -> grammar masks -> sample
        drafts proposed for the next step    (proposer, where the step asks: drafts.py)
        KV saves sent                        (kv_connector.save_kv, disaggregated prefill)
        images the scheduler evicts dropped
"""

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from llmserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.layers.pooler import Pooler
from llmserve.worker import mrope
from llmserve.worker.drafts import DraftProposer, DraftSeed
from llmserve.worker.encoder_cache import IDLE_BUDGET_S, STEP_BUDGET_S, EncoderCache
from llmserve.worker.input_batch import InputBatch, RequestRow
from llmserve.worker.logprobs import PositionLogprobs, gather_logprobs
from llmserve.worker.rejection_sampler import verify
from llmserve.worker.sampler import argmax, sample, target_probs

# prompt positions whose logits are materialised at once for prompt logprobs: (256, V) fp32
PROMPT_LOGPROBS_SLICE = 256


@dataclass
class StepInFlight:
    """A step `ModelRunner.begin` ran up to its forward pass, for `finish`: its output so
    far, its inputs (None: it computes nothing) and final hidden states (None on a
    pipeline's stage 0, whose last stage sends them)."""

    out: SchedulerOutput
    result: ModelRunnerOutput
    step: Any = None
    hidden: torch.Tensor | None = None


class ModelRunner:
    """Runs steps on one model (one rank's share of it). `samples=False`: compute the
    logits but sample nothing (a tensor-parallel worker rank, whose logits all-gather
    meets the sampling rank's). `kv_connector`: an `engine.kv_connector.KVConnector`
    for disaggregated prefill/decode, else None. `pooler`: the pooling runner's
    (`layers/pooler.py`), for pooling requests. `kv_tier`: a `kv_tier.BlockStore`, the
    prefix cache's second tier, else None. `proposer`: speculative decoding's drafts,
    proposed after sampling where the step asks (`drafts.py`), else None."""

    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device | str,
                 max_num_seqs: int = 256, attention: AttentionBackend | None = None,
                 samples: bool = True, kv_connector: Any = None,
                 pooler: Pooler | None = None, lora: Any = None,
                 kv_tier: Any = None, proposer: DraftProposer | None = None) -> None:
        self.model = model
        self.proposer = proposer
        # the layers whose incoming hidden states the model keeps (EAGLE-3's taps), set
        # before each forward: engines may share one loaded model
        self.aux_layers: tuple[int, ...] = getattr(proposer, "aux_layers", ()) \
            if proposer is not None and proposer.reads_aux_hidden else ()
        self.kv_tier = kv_tier
        self.lora = lora  # a lora.manager.LoRAManager, when adapters are enabled
        self.pooler = pooler
        self.samples = samples
        self.kv_connector = kv_connector
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        self.attention = attention or attention_backend(self.device)
        self.input_batch = InputBatch(max_num_seqs, self.block_size, self.device)
        # a vision-language model's encoder outputs by image (None: a text model)
        encode = getattr(model, "encode_slices", None)
        self.encoder_cache = None if encode is None else EncoderCache(
            lambda image: encode(image.pixel_values.unsqueeze(0).to(self.device), image.grid))
        config = getattr(model, "config", None)
        vision = getattr(config, "vision", None)
        # M-RoPE (Qwen2.5-VL): an image request's positions follow its images' grids
        self.mrope = getattr(config, "mrope_section", None) is not None
        self.images_attend_both_ways = vision is not None and vision.images_attend_both_ways

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step: sample for every request whose chunk ends its tokens (within its
        grammar's mask, `out.grammar`, for structured output), and gather the logprobs
        and prompt logprobs asked for."""
        return self.finish(self.begin(out))

    @torch.inference_mode()
    def begin(self, out: SchedulerOutput) -> "StepInFlight":
        """The step up to its forward pass (on a pipeline's stage 0: through this stage's
        layers, the rest of the pipeline still to come); `finish` does the rest. Steps
        begun are finished in order, and a step begun while others are in flight
        schedules none of their requests (the engine's pipeline, `engine.py`)."""
        try:
            return self._begin(out)
        except BaseException:
            if out.drop_images:
                self.encoder_cache.drop(out.drop_images)
            raise

    @torch.inference_mode()
    def finish(self, flight: "StepInFlight") -> ModelRunnerOutput:
        try:
            return self._finish(flight)
        finally:
            if flight.out.drop_images:
                self.encoder_cache.drop(flight.out.drop_images)

    def _begin(self, out: SchedulerOutput) -> "StepInFlight":
        batch = self.input_batch
        batch.update(out)
        if self.proposer is not None:
            for request_id in out.finished_request_ids:
                self.proposer.remove(request_id)
        for load in out.kv_loads:  # prompts a prefill engine computed
            self.kv_connector.load_kv(self.kv_cache, load)
        result = ModelRunnerOutput.empty([s.request_id for s in out.scheduled])
        if out.tier_loads:
            self._load_from_tier(out, result)
        if out.encode_images:
            result.encoded_images = self.encoder_cache.advance(
                out.encode_images, STEP_BUDGET_S if out.scheduled else IDLE_BUDGET_S)
        if not out.scheduled:
            return StepInFlight(out, result)
        step = batch.prepare(out.scheduled, self.attention)
        if self.mrope:
            step.positions = self._mrope_positions(out, step)
        if self.lora is not None:
            self._begin_lora(out)
        embeds = self._image_embeds(out, step) if self.encoder_cache is not None else None
        if self.aux_layers or getattr(self.model, "aux_layers", None):
            self.model.aux_layers = self.aux_layers
        try:
            if embeds is None:
                hidden = self.model(step.input_ids, step.positions, self.kv_cache,
                                    step.metadata)  # (T, H)
            else:
                hidden = self.model(step.input_ids, step.positions, self.kv_cache,
                                    step.metadata, embeds=embeds)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if out.tier_saves:  # their KV is written now; the next step may reuse the blocks
            self.kv_tier.save(self.kv_cache, [b for b, _ in out.tier_saves],
                              [h for _, h in out.tier_saves])
        return StepInFlight(out, result, step, hidden)

    def _finish(self, flight: "StepInFlight") -> ModelRunnerOutput:
        out, result, step, hidden = flight.out, flight.result, flight.step, flight.hidden
        if step is None:
            return result
        stage = getattr(self.model, "stage", None)
        if stage is not None:
            if not stage.is_first:
                return result  # a later pipeline stage: no head, nothing to sample
            # stage 0: the last stage's final hidden states; steps begun since may have
            # moved rows (a finished request's place taken by the last row)
            hidden = self.model.receive_final(len(step.input_ids))
            start = time.perf_counter()
            try:
                return self._finish_step(out, result, step, hidden, rows_moved=True)
            finally:
                stage.busy_seconds += time.perf_counter() - start
        return self._finish_step(out, result, step, hidden)

    def _finish_step(self, out: SchedulerOutput, result: ModelRunnerOutput, step: Any,
                     hidden: torch.Tensor, rows_moved: bool = False) -> ModelRunnerOutput:
        """From the final hidden states on: prompt logprobs, pooling, logits, sampling or
        verification, drafts, KV saves."""
        batch = self.input_batch
        if rows_moved:
            step.rows = np.fromiter((batch.requests[s.request_id].row for s in out.scheduled),
                                    np.int64, len(out.scheduled))
        for i in np.flatnonzero(batch.prompt_logprobs[step.rows]).tolist():
            s, end = out.scheduled[i], int(step.last_token[i])
            start = end + 1 - s.num_tokens  # the chunk's first token
            self._prompt_logprobs(i, s, batch.rows[step.rows[i]],
                                  hidden[start : start + len(s.token_ids)], result)
        pooling = batch.pooling[step.rows]
        if pooling.any():
            self._pool(out, np.flatnonzero(pooling), step, hidden, result)
        sample = np.fromiter((s.sample for s in out.scheduled), bool, len(out.scheduled))
        to_sample = np.flatnonzero(sample & ~pooling)
        if len(to_sample):
            drafts = [out.scheduled[i].spec_token_ids for i in to_sample]
            if any(drafts):
                self._verify(out, to_sample, step.rows[to_sample], step.last_token[to_sample],
                             drafts, hidden, result)
            else:
                self._sample(out, to_sample, step, hidden, result)
        if self.proposer is not None and self.samples:
            fed = np.flatnonzero(~pooling) if self.proposer.feeds_every_chunk else to_sample
            self._propose(out, fed, step.last_token,
                          self.model.aux_hidden if self.proposer.reads_aux_hidden else hidden,
                          result)
        if len(to_sample):
            self._save_kv(out, result)
        return result

    def _image_embeds(self, out: SchedulerOutput, step: Any
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image rows of the step's image tokens: (their index among the T tokens,
        rows), the images' encoder outputs sliced to each chunk; None: no image token.
        Where an image's tokens attend to each other both ways, its rows go in the
        attention metadata's `image_spans` too (the scheduler never splits such an image
        across steps: `SchedulerConfig.whole_images`)."""
        spans = []  # (first flat index, image, first row, end row)
        both_ways = step.metadata.image_spans
        for i, s in enumerate(out.scheduled):
            images = self.input_batch.requests[s.request_id].mm_inputs
            if not images:
                continue
            start, end = s.start_position, s.start_position + len(s.token_ids)
            first = int(step.last_token[i]) + 1 - s.num_tokens  # the chunk's first token
            for image in images:
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                if lo < hi:
                    spans.append((first + lo - start, image, lo - image.offset,
                                  hi - image.offset))
                    if self.images_attend_both_ways:
                        if hi != image.offset + image.length:
                            raise RuntimeError("a step ends inside an image whose tokens "
                                               "attend both ways")
                        both_ways.append((i, first + lo - start, first + hi - start))
        if not spans:
            return None
        rows = self.encoder_cache.rows_for([image for _, image, _, _ in spans])
        index = torch.cat([torch.arange(f, f + hi - lo) for f, _, lo, hi in spans])
        values = torch.cat([rows[image.hash][lo:hi] for _, image, lo, hi in spans])
        return index.to(self.device), values

    def _mrope_positions(self, out: SchedulerOutput, step: Any) -> torch.Tensor:
        """The step's rotary positions where a request's images move them (`mrope.py`)."""
        chunks = []
        for i, s in enumerate(out.scheduled):
            images = self.input_batch.requests[s.request_id].mm_inputs
            if images:
                first = int(step.last_token[i]) + 1 - s.num_tokens
                chunks.append((first, s.start_position, s.num_tokens, images))
        return mrope.step_positions(step.positions, chunks)

    def _load_from_tier(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        start = time.perf_counter()
        for load in out.tier_loads:
            result.tier_loaded[load.request_id] = self.kv_tier.load(
                self.kv_cache, load.block_ids, load.block_hashes)
        result.tier_load_seconds = time.perf_counter() - start

    def _begin_lora(self, out: SchedulerOutput) -> None:
        """Each of the step's rows gets its request's adapter (0: the base model)."""
        requests = [self.input_batch.requests[s.request_id] for s in out.scheduled]
        in_use = {r.lora_request.lora_int_id for r in requests if r.lora_request}
        ids = []
        for r in requests:
            if r.lora_request is not None:
                self.lora.get(r.lora_request, in_use)  # loaded (again, if it was evicted)
            ids.append(r.lora_request.lora_int_id if r.lora_request else 0)
        self.lora.begin_step(np.repeat(np.array(ids, dtype=np.int64),
                                       [s.num_tokens for s in out.scheduled]))

    def _sample(self, out: SchedulerOutput, to_sample: np.ndarray, step: Any,
                hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """One token for each row of `to_sample` (indices into the batch), at its last."""
        batch = self.input_batch
        rows = step.rows[to_sample]
        if len(to_sample) == hidden.shape[0]:  # every token is a sample position (decodes)
            last_hidden = hidden
        else:
            last_hidden = hidden[torch.from_numpy(step.last_token[to_sample]).to(self.device)]
        logits = self.model.compute_logits(last_hidden)  # (N, V)
        if not self.samples:
            return
        sampling = batch.sampling_batch(rows, logits.shape[-1])
        raw_needed = bool((batch.logprobs[rows] >= 0).any())  # logprobs are of raw logits
        allowed = logits if out.grammar is None else out.grammar.apply(
            logits, [(out.scheduled[i].request_id, 0) for i in to_sample.tolist()],
            copy=raw_needed)
        tokens = argmax(allowed) if sampling is None else sample(allowed, sampling)  # (N,)
        for i, token in zip(to_sample.tolist(), tokens.tolist(), strict=True):
            result.sampled_token_ids[i] = [token]
        self._sample_logprobs(to_sample, rows, logits, np.arange(len(rows)), tokens, result)

    def _verify(
        self, out: SchedulerOutput, to_sample: np.ndarray, rows: np.ndarray,
        last_token: np.ndarray, drafts: list[list[int]], hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Sample at each request's last token and at each of its drafts, in one batch,
        and keep the drafts the rejection rule accepts (`rejection_sampler.py`).

        Logits rows: request i owns 1 + k_i consecutive rows, its positions
        `| last verified token | draft 1 | ... | draft k_i |`; the target distribution at
        draft j's row is processed as if drafts 1..j were already output (penalties, bad
        words, min_tokens, grammar).
        """
        batch = self.input_batch
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)  # (N,)
        counts = num_drafts + 1
        first = np.cumsum(counts) - counts  # (N,) each request's first logits row
        owner = np.repeat(np.arange(len(rows)), counts)  # (L,) request of each row
        offset = np.arange(int(counts.sum())) - first[owner]  # (L,) j of each row
        index = last_token[owner] - num_drafts[owner] + offset  # (L,) into the T tokens
        logits = self.model.compute_logits(hidden[torch.from_numpy(index)])  # (L, V)
        if not self.samples:
            return
        preceding = [drafts[i][:j] for i, j in zip(owner.tolist(), offset.tolist(),
                                                   strict=True)]
        expanded = rows[owner]
        sampling = batch.sampling_batch(expanded, logits.shape[-1], preceding)
        raw_needed = bool((batch.logprobs[rows] >= 0).any())
        request_ids = [out.scheduled[i].request_id for i in to_sample.tolist()]
        allowed = logits if out.grammar is None else out.grammar.apply(
            logits, [(request_ids[i], j) for i, j in zip(owner.tolist(), offset.tolist(),
                                                         strict=True)], copy=raw_needed)
        processed = allowed if sampling is None or sampling.processing is None else \
            sampling.processing.apply(allowed)
        target_argmax = argmax(processed)  # (L,): what greedy rows emit
        if sampling is None or sampling.all_greedy:
            emitted = _greedy_verify(drafts, target_argmax.tolist(), first)
        else:
            probs = target_probs(processed, sampling)  # (L, V)
            width = int(counts.max())
            padded = probs.new_zeros(len(rows), width, probs.shape[-1])  # (N, K + 1, V)
            padded[owner, offset] = probs
            argmax_padded = target_argmax.new_zeros(len(rows), width)
            argmax_padded[owner, offset] = target_argmax
            draft_tokens = torch.zeros(len(rows), width - 1, dtype=torch.long)
            for i, d in enumerate(drafts):
                draft_tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
            greedy = (batch.temperature[rows] == 0).tolist()
            emitted = verify(padded, draft_tokens.to(self.device), num_drafts.tolist(), greedy,
                             [batch.rows[r].generator for r in rows], target_argmax=argmax_padded)
        for i, rid, d, tokens in zip(to_sample.tolist(), request_ids, drafts, emitted,
                                     strict=True):
            result.sampled_token_ids[i] = tokens
            if d:
                batch.accept_drafts(rid, len(d), tokens[:-1])
        # logprobs: emitted token j sits at its request's row first + j
        emitted_rows = np.concatenate([first[i] + np.arange(len(t))
                                       for i, t in enumerate(emitted)])
        emitted_owner = np.repeat(np.arange(len(rows)), [len(t) for t in emitted])
        flat = torch.tensor([t for tokens in emitted for t in tokens], dtype=torch.long,
                            device=self.device)
        self._sample_logprobs(to_sample, rows, logits, emitted_rows, flat, result,
                              emitted_owner)

    def _propose(self, out: SchedulerOutput, rows: np.ndarray, last_token: np.ndarray,
                 hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """The next step's drafts for the sampled rows that ask for them: each follows
        its request's verified tokens, this step's (accepted drafts, then the sampled
        token) included. A proposer reading hidden states gets the verified positions'
        rows; one fed every chunk (an EAGLE head, whose K/V follows the target's) gets
        every row of `rows`, a chunk that samples nothing with no drafts asked."""
        every = self.proposer.feeds_every_chunk
        batch = self.input_batch
        seeds, asked = [], []
        for i in rows.tolist():
            s = out.scheduled[i]
            emitted = result.sampled_token_ids[i]
            if not emitted and not (every and not s.sample):
                continue  # a sampling row that got no token here asks for nothing
            if not every and s.num_drafts == 0:
                continue
            row_index = batch.requests[s.request_id].row
            row = batch.rows[row_index]
            # the row's outputs hold the accepted drafts already; the sampled token comes
            # with the next step's tokens (a chunk that samples nothing: the next token
            # is the prompt's own, known)
            tokens = [*row.prompt_token_ids, *row.output_token_ids]
            count = len(s.token_ids)
            if emitted:
                tokens.append(emitted[-1])
                count += len(emitted) - 1
            seed = DraftSeed(s.request_id, tokens, s.num_drafts if emitted else 0,
                             start_position=s.start_position, min_chance=s.draft_min_chance,
                             keep_chance=s.draft_keep_chance)
            if self.proposer.needs_hidden:
                first = int(last_token[i]) + 1 - s.num_tokens  # the chunk's first row
                seed.hidden = hidden[first : first + count]
            if every:
                seed.block_ids = batch.block_table[row_index, : batch.num_blocks[row_index]]
            seeds.append(seed)
            asked.append(i)
        if not seeds:
            return
        start = time.perf_counter()
        drafts = self.proposer.propose(seeds)
        result.draft_seconds = time.perf_counter() - start
        for i, seed, d in zip(asked, seeds, drafts, strict=True):
            if seed.num_drafts:
                result.draft_token_ids[i] = list(d[: seed.num_drafts])

    def _sample_logprobs(
        self, to_sample: np.ndarray, rows: np.ndarray, logits: torch.Tensor,
        logits_rows: np.ndarray, tokens: torch.Tensor, result: ModelRunnerOutput,
        owner: np.ndarray | None = None,
    ) -> None:
        """Raw logprobs of the sampled tokens: tokens[e] was sampled from
        logits[logits_rows[e]] by sampled row owner[e] (default: e), in order."""
        owner = np.arange(len(rows)) if owner is None else owner
        ks = self.input_batch.logprobs[rows][owner]  # (E,) -1: not asked for
        want = np.flatnonzero(ks >= 0)
        if len(want) == 0:
            return
        index = torch.from_numpy(logits_rows[want]).to(self.device)
        gathered = gather_logprobs(logits[index].log_softmax(dim=-1),
                                   tokens[torch.from_numpy(want).to(self.device)],
                                   int(ks[want].max()))
        for e, position in zip(want.tolist(), gathered, strict=True):
            i = int(to_sample[owner[e]])
            if result.logprobs[i] is None:
                result.logprobs[i] = []
            result.logprobs[i].append(position.truncated(int(ks[e])))

    def _prompt_logprobs(
        self, i: int, s: ScheduledRequest, request: RequestRow, hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Raw logprobs of the prompt tokens batch row i's chunk predicts (hidden:
        (n, hidden)).

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
        result.prompt_logprobs[i] = (s.start_position + 1, positions)

    def _pool(self, out: SchedulerOutput, rows: np.ndarray, step: Any, hidden: torch.Tensor,
              result: ModelRunnerOutput) -> None:
        """Pool the chunks of the pooling requests among batch rows `rows`; those whose
        prompt this chunk ends get their output (embedding or class scores)."""
        done: list[int] = []
        for i in rows.tolist():
            s = out.scheduled[i]
            request = self.input_batch.rows[step.rows[i]]
            end = int(step.last_token[i])
            chunk = hidden[end + 1 - s.num_tokens : end + 1]
            self.pooler.add_chunk(request.pooled, chunk, s.start_position, s.sample)
            if s.sample:
                done.append(i)
        if not done:
            return
        requests = [self.input_batch.rows[step.rows[i]] for i in done]
        outputs = self.pooler.finish([r.pooled for r in requests],
                                     [r.pooling_params for r in requests])
        for i, output in zip(done, outputs, strict=True):
            result.pooler_output[i] = output

    def _save_kv(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Send the prompts whose first token this step sampled to the decode engine."""
        if not out.kv_saves or not self.samples:
            return
        index = {rid: i for i, rid in enumerate(result.req_ids)}
        for save in out.kv_saves:
            tokens = result.sampled_token_ids[index[save.request_id]]
            row = self.input_batch.rows[self.input_batch.requests[save.request_id].row]
            self.kv_connector.save_kv(self.kv_cache, save, list(row.prompt_token_ids),
                                      tokens[0])


def _greedy_verify(drafts: list[list[int]], target_argmax: list[int],
                   first: np.ndarray) -> list[list[int]]:
    """Greedy rows: keep drafts while they equal the target's argmax, then emit the
    argmax where they stop (so the output is the non-speculative one, token for token)."""
    emitted = []
    for i, d in enumerate(drafts):
        base = int(first[i])
        n = 0
        while n < len(d) and d[n] == target_argmax[base + n]:
            n += 1
        emitted.append(d[:n] + [target_argmax[base + n]])
    return emitted
