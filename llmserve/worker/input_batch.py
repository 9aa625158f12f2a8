"""The model runner's persistent batch (vLLM v1's `InputBatch`): one row per request it holds.

A request's data arrives once (`NewRequestData`); each step then brings only its tokens,
start position and new block ids, and the batch updates preallocated per-row buffers in
place. Rows are dense:

    | row 0 | row 1 | ... | row num_rows - 1 | free ... | capacity

a leaving row's place is taken by the last row (compaction), and the buffers grow when a
row or a block table outgrows them. From the buffers a step's flat inputs (positions, slot
mapping, block tables) come out of a few vectorised numpy ops, its sampling parameters are
gathered instead of rebuilt, and penalties read output-token counts kept up to date token
by token. Invariant: a row's block-table entries past its `num_blocks` are zero (the
padding attention reads).
"""

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llmserve.core.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from llmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from llmserve.layers.pooler import PooledState
from llmserve.sampling_params import SamplingParams
from llmserve.worker.logits_processors import (
    History,
    LogitsProcessing,
    Penalties,
    has_penalty,
)
from llmserve.worker.sampler import SamplingBatch


@dataclass(eq=False)
class RequestRow:
    """What the runner keeps of one request (also its `RowHistory` for the processors)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]  # grows with each output token the scheduler sends
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    bad_words_token_ids: list[list[int]]
    generator: torch.Generator | None  # seeded requests only; survives a preemption
    num_counted: int | None = None  # output tokens in the penalty counts; None: not set up
    row: int | None = None  # its row; None: preempted, kept only for its generator
    # a pooling request: its PoolingParams and what its chunks left (layers/pooler.py)
    pooling_params: Any = None
    pooled: PooledState | None = None
    lora_request: Any = None  # its LoRA adapter (LoRARequest), None: the base model
    mm_inputs: list = field(default_factory=list)  # its images (multimodal.ImageInput)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class StepInputs:
    """The flat inputs of one forward pass, in batch (schedule) order."""

    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    metadata: AttentionMetadata
    rows: np.ndarray  # (B,) each scheduled request's row
    last_token: np.ndarray  # (B,) index of each sequence's last query token in the T tokens


# per-row numpy buffers: (name, dtype, value of an empty row); block_table is 2-D
_ROW_BUFFERS = (
    ("block_table", np.int32, 0),
    ("num_blocks", np.int64, 0),
    ("num_computed_tokens", np.int64, 0),
    ("temperature", np.float32, 0.0),
    ("top_k", np.int64, 0),
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("repetition", np.float32, 1.0),
    ("frequency", np.float32, 0.0),
    ("presence", np.float32, 0.0),
    ("logprobs", np.int64, -1),  # -1: not asked for
    ("prompt_logprobs", np.bool_, False),
    ("pooling", np.bool_, False),  # a pooling request: pooled, never sampled
    ("needs_sort", np.bool_, False),  # top-k or top-p on a sampled (temperature > 0) row
    ("penalised", np.bool_, False),
    ("processed", np.bool_, False),  # bias, allowed ids, bans or penalties
)


class InputBatch:
    def __init__(self, max_num_rows: int, block_size: int, device: torch.device | str = "cpu",
                 max_blocks_per_row: int = 64) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.capacity = max_num_rows
        self.rows: list[RequestRow | None] = [None] * max_num_rows
        # every request held: those with a row, and preempted seeded ones (row None) whose
        # generator waits for them to resume
        self.requests: dict[str, RequestRow] = {}
        self.num_rows = 0  # after `update`, rows [0, num_rows) are all held
        self._holes: list[int] = []  # heap of free rows below num_rows
        for name, dtype, empty in _ROW_BUFFERS:
            shape = (max_num_rows, max_blocks_per_row) if name == "block_table" else max_num_rows
            setattr(self, name, np.full(shape, empty, dtype=dtype))
        # (capacity, V) on the device, allocated when the first penalised row samples
        self.output_counts: torch.Tensor | None = None  # float: each output token's count
        self.prompt_seen: torch.Tensor | None = None  # bool: in the prompt

    @property
    def row_of(self) -> dict[str, int]:
        """Each request with a row -> its row (a view, built on each call)."""
        return {rid: r.row for rid, r in self.requests.items() if r.row is not None}

    # ---- deltas from the scheduler ---------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        """Drop the rows of finished and preempted requests, add new ones, compact, then
        append each scheduled request's new block ids and output tokens."""
        for request_id in out.preempted_request_ids:
            self._remove(request_id, park_generator=True)
        for request_id in out.finished_request_ids:
            self._remove(request_id)
            self.requests.pop(request_id, None)
        for s in out.scheduled:
            if s.new is not None:
                self._remove(s.request_id)  # a row it still holds is stale
                self._add(s.new, s.start_position)
        self._condense()
        for s in out.scheduled:
            row = self.requests[s.request_id].row
            if s.start_position != self.num_computed_tokens[row]:
                raise RuntimeError(
                    f"{s.request_id}: scheduled from position {s.start_position}, but the "
                    f"runner holds {self.num_computed_tokens[row]} computed tokens")
            if s.new_block_ids:
                self._append_blocks(row, s.new_block_ids)
            self._learn_outputs(self.rows[row], s)
            self.num_computed_tokens[row] = s.start_position + s.num_tokens

    def _add(self, new: NewRequestData, start_position: int) -> None:
        if self._holes:
            row = heapq.heappop(self._holes)
        else:
            if self.num_rows == self.capacity:
                self._grow_rows(2 * self.capacity)
            row = self.num_rows
            self.num_rows += 1
        p = new.sampling_params
        parked = self.requests.pop(new.request_id, None)
        generator = parked.generator if parked is not None else None
        if generator is None and p.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(p.seed)
        self.rows[row] = RequestRow(
            new.request_id, new.prompt_token_ids, list(new.output_token_ids), p,
            new.eos_token_ids, new.bad_words_token_ids, generator, row=row,
            pooling_params=new.pooling_params,
            pooled=None if new.pooling_params is None else PooledState(),
            lora_request=new.lora_request, mm_inputs=new.mm_inputs,
        )
        self.requests[new.request_id] = self.rows[row]
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        self.num_computed_tokens[row] = start_position
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition[row] = p.repetition_penalty
        self.frequency[row] = p.frequency_penalty
        self.presence[row] = p.presence_penalty
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.prompt_logprobs[row] = p.prompt_logprobs is not None
        self.pooling[row] = new.pooling_params is not None
        self.needs_sort[row] = (p.top_k > 0 or p.top_p < 1) and p.temperature > 0
        self.penalised[row] = has_penalty(p)
        self.processed[row] = bool(
            has_penalty(p) or p.logit_bias or p.allowed_token_ids is not None
            or new.bad_words_token_ids or p.min_tokens > 0)

    def _remove(self, request_id: str, park_generator: bool = False) -> None:
        """Free the request's row; keep its generator if it is preempted (parked)."""
        request = self.requests.get(request_id)
        if request is None or request.row is None:
            return  # not held, or parked already
        row, request.row = request.row, None
        if not (park_generator and request.generator is not None):
            del self.requests[request_id]
        self.rows[row] = None
        self.block_table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        heapq.heappush(self._holes, row)

    def _condense(self) -> None:
        """Fill holes with the last rows, so that rows [0, num_rows) are all held."""
        while self._holes:
            hole = heapq.heappop(self._holes)
            last = self.num_rows - 1
            while last >= 0 and self.rows[last] is None:
                last -= 1
            self.num_rows = last + 1
            if last < hole:
                self._holes = []  # every other hole is past the last held row too
                break
            self._move(last, hole)
            self.num_rows = last

    def _move(self, src: int, dst: int) -> None:
        request = self.rows[src]
        self.rows[dst], self.rows[src] = request, None
        request.row = dst
        for name, _, _ in _ROW_BUFFERS:
            buffer = getattr(self, name)
            buffer[dst] = buffer[src]
        self.block_table[src, : self.num_blocks[src]] = 0
        self.num_blocks[src] = 0
        if request.num_counted is not None:
            self.output_counts[dst] = self.output_counts[src]
            self.prompt_seen[dst] = self.prompt_seen[src]

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            wider = np.zeros((self.capacity, max(end, 2 * self.block_table.shape[1])), np.int32)
            wider[:, : self.block_table.shape[1]] = self.block_table
            self.block_table = wider
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def accept_drafts(self, request_id: str, num_drafts: int, accepted: list[int]) -> None:
        """After verification: the accepted drafts are outputs now, and the rejected
        drafts' slots are no longer computed."""
        row = self.requests[request_id].row
        self.rows[row].output_token_ids.extend(accepted)
        self.num_computed_tokens[row] -= num_drafts - len(accepted)

    @staticmethod
    def _learn_outputs(request: RequestRow, s: ScheduledRequest) -> None:
        """Tokens past what the row knows are outputs sampled since (a decode's one token)."""
        known = request.num_tokens
        if s.start_position > known:
            raise RuntimeError(f"{s.request_id}: tokens from position {s.start_position} "
                               f"skip past the {known} the runner knows")
        request.output_token_ids.extend(s.token_ids[known - s.start_position :])

    def _grow_rows(self, capacity: int) -> None:
        for name, dtype, empty in _ROW_BUFFERS:
            old = getattr(self, name)
            new = np.full((capacity, *old.shape[1:]), empty, dtype=dtype)
            new[: self.capacity] = old
            setattr(self, name, new)
        self.rows += [None] * (capacity - self.capacity)
        if self.output_counts is not None:
            vocab = self.output_counts.shape[1]
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(
                capacity - self.capacity, vocab)])
            self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(
                capacity - self.capacity, vocab)])
        self.capacity = capacity

    # ---- one step's inputs -------------------------------------------------------------

    def prepare(self, batch: list[ScheduledRequest],
                backend: AttentionBackend | None = None) -> StepInputs:
        """Flat token ids, positions and attention metadata of the scheduled requests."""
        n = len(batch)
        rows = np.fromiter((self.requests[s.request_id].row for s in batch), np.int64, n)
        query_lens = [s.num_tokens for s in batch]
        context_lens = [s.start_position for s in batch]
        token_ids = list(itertools.chain.from_iterable(
            s.token_ids + s.spec_token_ids if s.spec_token_ids else s.token_ids
            for s in batch))
        if len(token_ids) == n:  # decodes only: sequence b's one query at context_lens[b]
            positions = np.array(context_lens, dtype=np.int64)
        else:  # sequence b's query i sits at context_lens[b] + i
            q = np.array(query_lens, dtype=np.int64)
            starts = np.cumsum(q) - q  # (B,) first query token of each
            positions = np.repeat(np.array(context_lens) - starts, q) + np.arange(len(token_ids))
        meta = AttentionMetadata.from_block_table(
            self.block_table, rows, query_lens, context_lens, positions, self.block_size,
            self.device, backend)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(positions).to(self.device),
            metadata=meta,
            rows=rows,
            last_token=np.array(meta.query_start[1:]) - 1,
        )

    # ---- sampling ----------------------------------------------------------------------

    def sampling_batch(self, rows: np.ndarray, vocab_size: int,
                       preceding: list[list[int]] | None = None) -> SamplingBatch | None:
        """The sampling parameters of `rows` (in that order); None when every row is
        greedy with no processor, so that sampling is just the argmax.

        `preceding[i]`: draft tokens to count as already output at row i's position
        (speculative decoding; a row may then appear once per position)."""
        temperature = self.temperature[rows]
        all_greedy = not (temperature > 0).any()
        processed = bool(self.processed[rows].any())
        if all_greedy and not processed:
            return None
        processing = None
        if processed and preceding is not None and any(preceding):
            # each position's own history: counted from token lists, not the row's counts
            requests = [self.rows[r] for r in rows]
            histories = [History(q.prompt_token_ids, q.output_token_ids + pre,
                                 q.eos_token_ids, q.bad_words_token_ids)
                         for q, pre in zip(requests, preceding, strict=True)]
            processing = LogitsProcessing.build(
                [q.sampling_params for q in requests], histories, self.device)
        elif processed:
            requests = [self.rows[r] for r in rows]
            processing = LogitsProcessing.build(
                [r.sampling_params for r in requests], requests, self.device,
                penalties=self._penalties(rows, vocab_size))
        return SamplingBatch(
            temperature=self._tensor(temperature),
            top_k=self._tensor(self.top_k[rows]),
            top_p=self._tensor(self.top_p[rows]),
            min_p=self._tensor(self.min_p[rows]),
            generators=[self.rows[r].generator for r in rows],
            all_greedy=all_greedy,
            need_sort=bool(self.needs_sort[rows].any()),
            processing=processing,
        )

    def _penalties(self, rows: np.ndarray, vocab_size: int) -> Penalties | None:
        local = np.flatnonzero(self.penalised[rows])  # positions in the sampled batch
        if len(local) == 0:
            return None
        penalised = rows[local]
        self._count_outputs(penalised, vocab_size)
        index = self._tensor(penalised)
        repetition = self.repetition[penalised]
        return Penalties(
            rows=self._tensor(local),
            repetition=self._tensor(repetition),
            frequency=self._tensor(self.frequency[penalised]),
            presence=self._tensor(self.presence[penalised]),
            output_counts=self.output_counts[index],
            prompt_seen=self.prompt_seen[index] if (repetition != 1).any() else None,
        )

    def _count_outputs(self, rows: np.ndarray, vocab_size: int) -> None:
        """Bring the rows' output counts up to date: a row set up now starts from zero and
        marks its prompt; then every output token not yet counted is added."""
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.capacity, vocab_size, device=self.device)
            self.prompt_seen = torch.zeros(self.capacity, vocab_size, dtype=torch.bool,
                                           device=self.device)
        fresh, prompt_rows, prompt_ids, count_rows, count_ids = [], [], [], [], []
        for row in rows.tolist():
            request = self.rows[row]
            if request.num_counted is None:
                fresh.append(row)
                prompt_rows += [row] * len(request.prompt_token_ids)
                prompt_ids += request.prompt_token_ids
                request.num_counted = 0
            new = request.output_token_ids[request.num_counted :]
            count_rows += [row] * len(new)
            count_ids += new
            request.num_counted += len(new)
        if fresh:
            index = self._tensor(fresh)
            self.output_counts[index] = 0
            self.prompt_seen[index] = False
            self.prompt_seen[self._tensor(prompt_rows), self._tensor(prompt_ids)] = True
        if count_rows:
            self.output_counts.index_put_(
                (self._tensor(count_rows), self._tensor(count_ids)),
                torch.ones(len(count_rows), device=self.device), accumulate=True)

    def _tensor(self, values: np.ndarray | list[int]) -> torch.Tensor:
        if isinstance(values, list):
            return torch.tensor(values, dtype=torch.long, device=self.device)
        return torch.from_numpy(values).to(self.device)
