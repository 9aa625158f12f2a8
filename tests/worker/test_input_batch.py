"""The runner's persistent batch, driven by the real scheduler: rows follow the requests
through admission, chunked prefill, preemption, resumption, finishing and compaction, and
what a step reads from it equals what the from-scratch path builds (attention metadata,
sampling parameters, penalties, seeded draws)."""

import random

import numpy as np
import pytest
import torch

from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.outputs import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler, SchedulerConfig
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.sampling_params import SamplingParams
from llmserve.worker.input_batch import InputBatch
from llmserve.worker.logits_processors import History
from llmserve.worker.sampler import SamplingBatch, sample

BLOCK_SIZE = 4
VOCAB = 32
EOS = 0


def make_request(request_id: str, prompt: list[int], params: SamplingParams | None = None,
                 max_tokens: int = 8) -> Request:
    params = params or SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(request_id, prompt, params, max_tokens, eos_token_ids=frozenset({EOS}),
                   arrival_time=float(int(request_id.strip("r") or 0)))


def scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 32,
              max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len=128)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE))


def check_rows(batch: InputBatch, sched: Scheduler, out: SchedulerOutput) -> None:
    """The rows hold exactly the scheduled-or-running requests the scheduler sent, densely,
    with the scheduler's block tables, zero padding and every token the request has."""
    assert sorted(batch.row_of.values()) == list(range(batch.num_rows)), "rows not dense"
    assert all(batch.rows[r] is None for r in range(batch.num_rows, batch.capacity))
    for request_id, row in batch.row_of.items():
        request = sched.requests[request_id]
        held = batch.rows[row]
        assert held.request_id == request_id
        n = int(batch.num_blocks[row])
        assert batch.block_table[row, :n].tolist() == sched.kv.block_ids(request)
        assert not batch.block_table[row, n:].any(), "padding past the blocks is not zero"
        assert batch.num_computed_tokens[row] == request.num_computed_tokens
        # the row knows every token scheduled so far (the newest output is learnt when sent)
        assert held.prompt_token_ids == request.prompt_token_ids
        assert request.output_token_ids[: len(held.output_token_ids)] == held.output_token_ids
        assert len(held.output_token_ids) >= request.num_computed_tokens - len(
            request.prompt_token_ids)
    assert not batch.block_table[batch.num_rows :].any()
    assert set(batch.row_of) <= {r.request_id for r in sched.running}
    assert {s.request_id for s in out.scheduled} <= set(batch.row_of)


def check_metadata(batch: InputBatch, sched: Scheduler, scheduled: list[ScheduledRequest]):
    """The persistent path's step inputs equal the from-scratch build, field by field."""
    step = batch.prepare(scheduled)
    ref = AttentionMetadata.build(
        [len(s.token_ids) for s in scheduled], [s.start_position for s in scheduled],
        [sched.kv.block_ids(sched.requests[s.request_id]) for s in scheduled], BLOCK_SIZE)
    meta = step.metadata
    assert torch.equal(meta.slot_mapping, ref.slot_mapping)
    assert meta.slot_mapping.dtype == ref.slot_mapping.dtype == torch.long
    assert meta.query_start == ref.query_start and meta.context_lens == ref.context_lens
    assert torch.equal(meta.block_tables, ref.block_tables)
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.is_contiguous()
    assert torch.equal(meta.query_start_t, ref.query_start_t)
    assert torch.equal(meta.context_lens_t, ref.context_lens_t)
    assert meta.block_size == ref.block_size
    positions = [p for s in scheduled
                 for p in range(s.start_position, s.start_position + len(s.token_ids))]
    assert step.positions.tolist() == positions
    assert step.input_ids.tolist() == [t for s in scheduled for t in s.token_ids]
    assert step.last_token.tolist() == [q - 1 for q in meta.query_start[1:]]
    return step


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_rows_and_metadata_match_the_scheduler(seed):
    """Admissions, chunked prefills, aborts and preemptions (a small pool); the batch
    starts tiny so that rows and block tables must grow."""
    rng = random.Random(seed)
    sched = scheduler(num_blocks=rng.randint(12, 24), max_num_batched_tokens=rng.randint(6, 24),
                      max_num_seqs=rng.randint(2, 6))
    batch = InputBatch(max_num_rows=1, block_size=BLOCK_SIZE, max_blocks_per_row=1)
    num_steps = num_compactions = 0
    for i in range(400):
        op = rng.random()
        if op < 0.25:
            prompt = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 30))]
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 16)))
        elif op < 0.3 and sched.requests:
            sched.finish_request(rng.choice(sorted(sched.requests)),
                                 RequestStatus.FINISHED_ABORTED)
        else:
            out = sched.schedule()
            before = dict(batch.row_of)
            batch.update(out)
            num_compactions += any(batch.row_of[k] != v for k, v in before.items()
                                   if k in batch.row_of)
            check_rows(batch, sched, out)
            if out.scheduled:
                check_metadata(batch, sched, out.scheduled)
                num_steps += 1
            sampled = {s.request_id: [rng.randint(0, VOCAB - 1)] for s in out.scheduled
                       if s.sample}
            sched.update(out, ModelRunnerOutput.from_sampled(out, sampled))
    assert num_steps > 50 and sched.num_preemptions > 0 and num_compactions > 0
    assert batch.capacity >= 2 and batch.block_table.shape[1] > 1


def new_data(request_id: str, blocks: list[int], prompt: list[int] | None = None,
             params: SamplingParams | None = None) -> NewRequestData:
    return NewRequestData(request_id, prompt or [1, 2, 3], params or SamplingParams(), blocks)


def first_step(request_id: str, new: NewRequestData) -> ScheduledRequest:
    tokens = list(new.prompt_token_ids) + new.output_token_ids
    return ScheduledRequest(request_id, tokens, 0, [], sample=True, new=new)


def test_a_leaving_row_is_filled_by_the_last_one():
    batch = InputBatch(max_num_rows=4, block_size=BLOCK_SIZE)
    batch.update(SchedulerOutput(scheduled=[
        first_step(name, new_data(name, [10 * i + 1, 10 * i + 2])) for i, name in
        enumerate("abcd")]))
    assert batch.row_of == {"a": 0, "b": 1, "c": 2, "d": 3}
    batch.update(SchedulerOutput(finished_request_ids={"b"}))
    assert batch.row_of == {"a": 0, "d": 1, "c": 2} and batch.num_rows == 3
    assert batch.block_table[1, :2].tolist() == [31, 32] and not batch.block_table[3].any()
    batch.update(SchedulerOutput(finished_request_ids={"c", "a"}))
    assert batch.row_of == {"d": 0} and batch.num_rows == 1
    # a new request takes the first free row; held ones get their new blocks appended
    batch.update(SchedulerOutput(scheduled=[
        ScheduledRequest("d", [7], 3, [33], sample=True),
        first_step("e", new_data("e", [41]))]))
    assert batch.row_of == {"d": 0, "e": 1}
    assert batch.block_table[0, :4].tolist() == [31, 32, 33, 0]
    assert batch.rows[0].output_token_ids == [7]  # learnt from the tokens sent


def test_block_tables_and_rows_grow():
    batch = InputBatch(max_num_rows=1, block_size=BLOCK_SIZE, max_blocks_per_row=2)
    batch.update(SchedulerOutput(scheduled=[first_step("a", new_data("a", [5, 6]))]))
    batch.update(SchedulerOutput(scheduled=[
        ScheduledRequest("a", [9], 3, [7, 8, 9], sample=True),
        first_step("b", new_data("b", [1]))]))
    assert batch.capacity == 2 and batch.block_table.shape[1] >= 5
    assert batch.block_table[0, :5].tolist() == [5, 6, 7, 8, 9]
    assert batch.block_table[1].tolist() == [1] + [0] * (batch.block_table.shape[1] - 1)


def test_a_step_out_of_order_is_refused():
    batch = InputBatch(max_num_rows=2, block_size=BLOCK_SIZE)
    batch.update(SchedulerOutput(scheduled=[first_step("a", new_data("a", [1]))]))
    with pytest.raises(RuntimeError, match="position 5"):
        batch.update(SchedulerOutput(scheduled=[ScheduledRequest("a", [9], 5, [], True)]))


def test_preemption_drops_the_row_and_keeps_the_seeded_generator():
    seeded = SamplingParams(temperature=1.0, seed=7)
    batch = InputBatch(max_num_rows=2, block_size=BLOCK_SIZE)
    batch.update(SchedulerOutput(scheduled=[first_step("a", new_data("a", [1], params=seeded))]))
    generator = batch.rows[0].generator
    first_draw = torch.rand(1, generator=generator)
    batch.update(SchedulerOutput(preempted_request_ids={"a"}))
    assert batch.row_of == {} and batch.num_rows == 0
    resumed = new_data("a", [2], params=seeded)
    resumed.output_token_ids = [4]
    batch.update(SchedulerOutput(scheduled=[first_step("a", resumed)]))
    assert batch.rows[0].generator is generator  # its stream goes on where it was
    assert batch.rows[0].output_token_ids == [4] and batch.block_table[0, 0] == 2
    assert not torch.equal(torch.rand(1, generator=generator), first_draw)
    batch.update(SchedulerOutput(finished_request_ids={"a"}))
    batch.update(SchedulerOutput(scheduled=[first_step("a", new_data("a", [3], params=seeded))]))
    fresh = batch.rows[0].generator
    assert fresh is not generator and torch.equal(torch.rand(1, generator=fresh), first_draw)


def test_plain_greedy_rows_skip_sampling():
    batch = InputBatch(max_num_rows=4, block_size=BLOCK_SIZE)
    params = {"greedy": SamplingParams(temperature=0),
              "logprobs": SamplingParams(temperature=0, logprobs=2),
              "penalty": SamplingParams(temperature=0, presence_penalty=0.5),
              "hot": SamplingParams(temperature=0.7)}
    batch.update(SchedulerOutput(scheduled=[
        first_step(name, new_data(name, [i + 1], params=p)) for i, (name, p) in
        enumerate(params.items())]))
    assert batch.sampling_batch(np.array([0, 1]), VOCAB) is None
    assert batch.sampling_batch(np.array([0, 2]), VOCAB).processing is not None
    assert not batch.sampling_batch(np.array([0, 3]), VOCAB).all_greedy


def scenario(max_tokens: int) -> list[SamplingParams]:
    """Every sampling feature, each on its own row; penalties on greedy and sampled rows."""
    features = [
        {"temperature": 0},
        {"temperature": 0, "repetition_penalty": 1.7, "frequency_penalty": 0.3},
        {"temperature": 0.9, "seed": 11, "frequency_penalty": 0.8, "presence_penalty": 0.4},
        {"temperature": 1.2, "seed": 5, "repetition_penalty": 1.3, "top_k": 6},
        {"temperature": 0.8, "top_p": 0.7, "presence_penalty": 1.0},
        {"temperature": 1.0, "min_p": 0.2, "seed": 3},
        {"temperature": 0, "logit_bias": {3: 2.0, 4: -1.5}, "min_tokens": 4},
        {"temperature": 1.0, "allowed_token_ids": [2, 3, 5, 7, 11], "seed": 9},
        {"temperature": 0.7, "bad_words": ["x"]},
        {"temperature": 1.0},
    ]
    return [SamplingParams(max_tokens=max_tokens, **f) for f in features]


def test_sampling_equals_the_from_scratch_path_step_by_step():
    """Ten requests (chunked prompts, a preemption) through the scheduler; each step the
    persistent batch's sampling (penalty counts kept incrementally, generators kept per
    row) gives the same processed logits and the same tokens as rebuilding everything from
    the requests, as the runner used to."""
    rng = random.Random(0)
    sched = scheduler(num_blocks=22, max_num_batched_tokens=24, max_num_seqs=10)
    for i, params in enumerate(scenario(max_tokens=12)):
        request = make_request(f"r{i}", [rng.randint(1, VOCAB - 1) for _ in range(3 + 2 * i)],
                               params, max_tokens=12)
        if params.bad_words:
            request.bad_words_token_ids = [[5, 6], [7]]
        sched.add_request(request)
    batch = InputBatch(max_num_rows=4, block_size=BLOCK_SIZE)
    old_generators: dict[str, torch.Generator] = {}  # the old runner's, by request id
    num_sampled = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        batch.update(out)
        to_sample = [s for s in out.scheduled if s.sample]
        if not to_sample:
            sched.update(out, ModelRunnerOutput.from_sampled(out, {}))
            continue
        logits = torch.randn(len(to_sample), VOCAB, generator=torch.Generator().manual_seed(
            num_sampled)) * 3
        requests = [sched.requests[s.request_id] for s in to_sample]
        old = SamplingBatch.build(
            [r.sampling_params for r in requests],
            [old_generator(old_generators, r) for r in requests],
            histories=[History(r.prompt_token_ids, r.output_token_ids, r.eos_token_ids,
                               r.bad_words_token_ids) for r in requests])
        new = batch.sampling_batch(np.array([batch.row_of[r.request_id] for r in requests]),
                                   VOCAB)
        if new is None:
            assert old.all_greedy and old.processing is None
            tokens = logits.argmax(dim=-1)
        else:
            assert (old.processing is None) == (new.processing is None)
            if old.processing is not None:
                assert torch.equal(old.processing.apply(logits), new.processing.apply(logits))
            torch.manual_seed(num_sampled)
            tokens = sample(logits, old)
            torch.manual_seed(num_sampled)
            assert torch.equal(sample(logits, new), tokens)
        num_sampled += 1
        sched.update(out, ModelRunnerOutput.from_sampled(out, {
            s.request_id: [t] for s, t in zip(to_sample, tokens.tolist(), strict=True)}))
    assert sched.num_preemptions > 0 and num_sampled > 12
    assert batch.output_counts is not None  # the incremental counts were used


def old_generator(generators: dict[str, torch.Generator], request: Request):
    seed = request.sampling_params.seed
    if seed is None:
        return None
    if request.request_id not in generators:
        generators[request.request_id] = torch.Generator().manual_seed(seed)
    return generators[request.request_id]
