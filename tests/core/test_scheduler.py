"""Scheduler: budgets, decode-first chunked prefill, prefix hits, preemption, and a property test.

The scheduler is driven as the engine drives it: `schedule()`, then `update()` with a fake
sampled token for every scheduled request whose chunk ends its known tokens.
"""

import itertools
import random
import weakref

import pytest

from llmserve.core.kv_cache_manager import KVCacheManager, hash_block
from llmserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler, SchedulerConfig
from llmserve.sampling_params import SamplingParams

EOS = 0
TOKEN = 1  # what the fake model samples unless told to finish a request
BLOCK_SIZE = 4
_arrivals = itertools.count(1)
_prompt_bases = itertools.count(1)


def make_scheduler(
    num_blocks: int = 64,
    max_num_batched_tokens: int = 32,
    max_num_seqs: int = 8,
    policy: str = "fcfs",
    enable_caching: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, policy)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching))


def make_request(
    request_id: str,
    prompt: int | list[int],
    max_tokens: int = 8,
    priority: int = 0,
    cache_salt: str | None = None,
) -> Request:
    """A request; an int prompt means that many tokens no other request's prompt holds."""
    if isinstance(prompt, int):
        base = 1000 * next(_prompt_bases)
        prompt = [base + i for i in range(prompt)]
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens,
        eos_token_ids=frozenset({EOS}), priority=priority, cache_salt=cache_salt,
        arrival_time=float(next(_arrivals)),
    )


class RunnerMirror:
    """What a runner holds after each step: a block table per request, rebuilt only from
    the deltas the scheduler sends (whole tables for new requests, new ids after)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for request_id in out.preempted_request_ids | out.finished_request_ids:
            self.tables.pop(request_id, None)
        for s in out.scheduled:
            if s.new is None:
                assert s.request_id in self.tables, f"{s.request_id} sent as held, not held"
            else:
                assert s.request_id not in self.tables, f"{s.request_id} sent new twice"
                assert s.new.request_id == s.request_id and s.new_block_ids == []
                self.tables[s.request_id] = list(s.new.block_ids)
            self.tables[s.request_id] += s.new_block_ids


_mirrors: "weakref.WeakKeyDictionary[Scheduler, RunnerMirror]" = weakref.WeakKeyDictionary()


def mirror(sched: Scheduler) -> RunnerMirror:
    return _mirrors.setdefault(sched, RunnerMirror())


def step(sched: Scheduler, finish: set[str] = frozenset()) -> SchedulerOutput:
    """One engine step; requests in `finish` sample EOS, the others TOKEN."""
    out = sched.schedule()
    check_step(sched, out)
    sampled = {s.request_id: [EOS if s.request_id in finish else TOKEN]
               for s in out.scheduled if s.sample}
    update(sched, out, sampled)
    return out


def update(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list:
    """`Scheduler.update` with a fake runner's output: `sampled` tokens by request id."""
    return sched.update(out, ModelRunnerOutput.from_sampled(out, sampled))


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """What every step must satisfy, whatever the workload (call it on every schedule())."""
    tables = mirror(sched).tables
    mirror(sched).apply(out)
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert sched.num_running <= sched.config.max_num_seqs
    ids = [s.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert set(ids) <= {r.request_id for r in sched.running}
    for s in out.scheduled:
        request = sched.requests[s.request_id]
        end = s.start_position + len(s.token_ids)
        assert s.token_ids, "scheduled with no tokens"
        assert s.token_ids == request.all_token_ids[s.start_position : end]
        assert end == request.num_computed_tokens
        assert s.sample == (end == request.num_tokens)
        assert tables[s.request_id] == sched.kv.block_ids(request), "deltas lost a block"
        assert len(tables[s.request_id]) * BLOCK_SIZE >= end, "blocks do not cover the tokens"
        if s.new is not None:  # all a new (or resumed) request's tokens so far
            assert s.new.output_token_ids == request.output_token_ids
            assert s.new.output_token_ids is not request.output_token_ids
            assert s.new.prompt_token_ids == request.prompt_token_ids
    # a request that read its blocks from the KV tier is sent when it first computes
    loading = {load.request_id for load in out.tier_loads}
    unsent = {r.request_id for r in sched.running if r.num_blocks_sent is None}
    assert loading <= unsent
    assert set(tables) == {r.request_id for r in sched.running} - unsent, \
        "runner rows != running"


def run_until_done(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "requests did not finish"
        outs.append(step(sched))
    return outs


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    """request id -> number of tokens it got this step, in schedule order."""
    return {s.request_id: len(s.token_ids) for s in out.scheduled}


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks


# ---- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"policy": "lifo"}, "policy"),
    ],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


# ---- budgets, decode first, chunked prefill ----------------------------------------------


def test_budgets_hold_every_step_and_every_request_finishes():
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    lengths = [1, 5, 17, 3, 40, 8, 2, 33, 16, 9]
    for i, n in enumerate(lengths):
        sched.add_request(make_request(f"r{i}", n, max_tokens=1 + i % 4))
    requests = list(sched.requests.values())
    outs = run_until_done(sched)  # check_step asserts the budgets after every schedule()
    assert max(len(out.scheduled) for out in outs) == 3
    assert max(out.num_tokens for out in outs) == 16
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert [r.num_output_tokens for r in requests] == [1 + i % 4 for i in range(10)]
    assert_all_blocks_free(sched)


def test_max_num_seqs_holds_back_waiting_requests():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add_request(make_request(name, 4, max_tokens=3))
    assert list(scheduled(step(sched))) == ["a", "b"]
    assert sched.num_waiting == 1
    step(sched, finish={"a"})
    assert list(scheduled(step(sched))) == ["b", "c"]


def test_decodes_go_first_and_a_new_prompt_gets_what_the_budget_leaves():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 8, max_tokens=20))
    sched.add_request(make_request("b", 8, max_tokens=20))
    assert scheduled(step(sched)) == {"a": 8, "b": 8}

    sched.add_request(make_request("long", 40))
    assert scheduled(step(sched)) == {"a": 1, "b": 1, "long": 14}
    assert scheduled(step(sched)) == {"a": 1, "b": 1, "long": 14}
    out = step(sched)
    assert scheduled(out) == {"a": 1, "b": 1, "long": 12}
    assert [s.sample for s in out.scheduled] == [True, True, True]
    assert scheduled(step(sched)) == {"a": 1, "b": 1, "long": 1}


def test_waiting_prompt_is_not_admitted_when_decodes_use_the_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=2)
    sched.add_request(make_request("a", 1, max_tokens=5))
    sched.add_request(make_request("b", 1, max_tokens=5))
    step(sched)
    sched.add_request(make_request("c", 3))
    assert scheduled(step(sched)) == {"a": 1, "b": 1}
    assert sched.num_waiting == 1


def test_long_prompt_is_split_into_budget_sized_chunks():
    sched = make_scheduler(max_num_batched_tokens=16)
    request = make_request("r", 50, max_tokens=2)
    sched.add_request(request)
    chunks = [step(sched).scheduled[0] for _ in range(4)]

    assert [len(c.token_ids) for c in chunks] == [16, 16, 16, 2]
    assert [c.start_position for c in chunks] == [0, 16, 32, 48]
    assert [c.sample for c in chunks] == [False, False, False, True]
    assert sum((c.token_ids for c in chunks), []) == request.prompt_token_ids
    # the data once, then only the blocks each chunk adds: ceil(50 / 4) = 13 in all
    assert chunks[0].new is not None and [c.new for c in chunks[1:]] == [None] * 3
    assert [len(chunks[0].new.block_ids)] + [len(c.new_block_ids) for c in chunks[1:]] == [
        4, 4, 4, 1]
    assert mirror(sched).tables["r"] == sched.kv.block_ids(request)
    assert request.output_token_ids == [TOKEN]

    decode = step(sched).scheduled[0]
    assert (decode.start_position, decode.token_ids, decode.sample) == (50, [TOKEN], True)
    assert (decode.new, decode.new_block_ids) == (None, [])  # 51 tokens fit in 13 blocks
    assert request.status == RequestStatus.FINISHED_LENGTH


# ---- finishing and aborting --------------------------------------------------------------


def test_eos_finishes_a_request_frees_its_blocks_and_is_reported_next_step():
    sched = make_scheduler()
    request = make_request("r", 6, max_tokens=10)
    sched.add_request(request)
    step(sched)
    step(sched, finish={"r"})
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [TOKEN, EOS]
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    out = sched.schedule()
    check_step(sched, out)
    assert out.finished_request_ids == {"r"}
    assert sched.schedule().finished_request_ids == set()


def test_max_model_len_ends_a_request():
    sched = make_scheduler(max_model_len=10)
    request = make_request("r", 8, max_tokens=100)
    sched.add_request(request)
    run_until_done(sched)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 10


def test_abort_waiting_and_running_requests():
    sched = make_scheduler(max_num_batched_tokens=8)
    running, waiting = make_request("running", 8), make_request("waiting", 8)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert sched.kv.pool.num_free_blocks < sched.kv.pool.num_blocks

    assert sched.finish_request("waiting", RequestStatus.FINISHED_ABORTED) is waiting
    assert sched.finish_request("running", RequestStatus.FINISHED_ABORTED) is running
    assert sched.finish_request("unknown", RequestStatus.FINISHED_ABORTED) is None
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    out = sched.schedule()
    assert out.scheduled == [] and out.finished_request_ids == {"running", "waiting"}


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    sched = make_scheduler()
    request = make_request("r", 4)
    sched.add_request(request)
    out = sched.schedule()
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert update(sched, out, {"r": [TOKEN]}) == []
    assert request.output_token_ids == []
    assert_all_blocks_free(sched)


# ---- prefix cache ------------------------------------------------------------------------


def test_hit_statistics_count_each_admission_once():
    """A request that waits for blocks for several steps is counted once, when admitted."""
    sched = make_scheduler(num_blocks=4)
    prompt = list(range(300, 316))
    sched.add_request(make_request("big", 14, max_tokens=2))  # 4 blocks once it decodes
    step(sched)
    sched.add_request(make_request("waiter", prompt, max_tokens=1))
    for _ in range(3):
        step(sched)
    run_until_done(sched)
    assert sched.kv.num_queries == 14 + 16
    sched.add_request(make_request("again", prompt, max_tokens=1))
    run_until_done(sched)
    assert sched.kv.num_queries == 14 + 16 + 16
    assert sched.kv.num_hits == 12  # 3 of the 4 blocks; the last token is always computed


def test_same_prefix_hits_full_blocks_but_never_the_last_token():
    sched = make_scheduler()
    prompt = list(range(100, 140))
    first = make_request("first", prompt, max_tokens=2)
    sched.add_request(first)
    run_until_done(sched)
    hits_before = sched.kv.num_hits

    second = make_request("second", prompt, max_tokens=2)
    sched.add_request(second)
    out = step(sched)
    assert second.num_cached_tokens == 36  # 10 full blocks, but the 40th token is computed
    assert sched.kv.num_hits - hits_before == 36
    (chunk,) = out.scheduled
    assert (chunk.start_position, chunk.sample) == (36, True)
    assert chunk.token_ids == prompt[36:]
    run_until_done(sched)
    assert second.output_token_ids == [TOKEN, TOKEN]


def test_running_requests_share_cached_prefix_blocks():
    sched = make_scheduler()
    prompt = [7] * 16 + [8, 9]
    sched.add_request(make_request("a", prompt, max_tokens=10))
    step(sched)
    sched.add_request(make_request("b", prompt[:16] + [5, 5, 5], max_tokens=10))
    step(sched)
    table_a, table_b = (sched.kv.block_ids(sched.requests[r]) for r in "ab")
    assert table_a[:4] == table_b[:4] and set(table_a[4:]).isdisjoint(table_b[4:])
    assert sched.requests["b"].num_cached_tokens == 16
    assert [sched.kv.pool.blocks[i].ref_cnt for i in table_b] == [2, 2, 2, 2, 1]


def test_a_request_admitted_later_in_the_same_step_hits_blocks_cached_this_step():
    sched = make_scheduler(max_num_batched_tokens=64)
    prompt = list(range(100, 120))
    sched.add_request(make_request("a", prompt))
    sched.add_request(make_request("b", prompt))
    out = step(sched)
    assert scheduled(out) == {"a": 20, "b": 4}
    assert sched.requests["b"].num_cached_tokens == 16


@pytest.mark.parametrize("salt", ["other-user", None])
def test_a_different_cache_salt_does_not_hit(salt):
    sched = make_scheduler()
    prompt = list(range(100, 120))
    sched.add_request(make_request("a", prompt, cache_salt="user"))
    run_until_done(sched)
    sched.add_request(make_request("b", prompt, cache_salt=salt))
    assert scheduled(step(sched)) == {"b": 20}
    assert sched.requests["b"].num_cached_tokens == 0
    sched.add_request(make_request("c", prompt, cache_salt="user"))
    step(sched)
    assert sched.requests["c"].num_cached_tokens == 16


def test_no_prefix_caching_never_hits():
    sched = make_scheduler(enable_caching=False)
    prompt = list(range(100, 120))
    sched.add_request(make_request("a", prompt))
    run_until_done(sched)
    sched.add_request(make_request("b", prompt))
    assert scheduled(step(sched)) == {"b": 20}
    assert sched.requests["b"].num_cached_tokens == 0
    assert sched.kv.num_hits == 0 and sched.kv.pool.cached == {}


def test_freed_prefix_survives_until_fresh_blocks_evict_its_tail_first():
    sched = make_scheduler(num_blocks=8)
    prompt = list(range(100, 121))
    sched.add_request(make_request("a", prompt, max_tokens=1))  # blocks 0-5, 0-4 cached
    run_until_done(sched)
    assert list(sched.kv.pool.free_queue) == [6, 7, 5, 4, 3, 2, 1, 0]

    sched.add_request(make_request("filler", 16, max_tokens=1))  # 4 fresh blocks
    run_until_done(sched)
    assert sched.kv.pool.num_evictions == 1  # blocks 6, 7, a's uncached tail, then block 4

    second = make_request("b", prompt, max_tokens=1)
    sched.add_request(second)
    step(sched)
    assert second.num_cached_tokens == 16  # a's head, blocks 0-3


# ---- preemption --------------------------------------------------------------------------


def test_fcfs_preempts_the_latest_request_and_recomputes_it_with_its_outputs():
    sched = make_scheduler(num_blocks=6, enable_caching=False)
    first = make_request("first", 8, max_tokens=10)
    second = make_request("second", 8, max_tokens=10)
    sched.add_request(first)
    sched.add_request(second)

    outs = [step(sched)]
    while outs[-1].num_preempted == 0:
        outs.append(step(sched))
    assert scheduled(outs[-1]) == {"first": 1}
    assert outs[-1].preempted_request_ids == {"second"}  # the runner drops its row
    assert second.status == RequestStatus.PREEMPTED and second.num_preemptions == 1
    assert sched.waiting[0] is second and second.num_computed_tokens == 0
    assert sched.kv.block_ids(second) == []
    # its KV freed: the prompt and 4 outputs (the 5th was yet to be computed)
    assert second.num_preempted_tokens == 12
    tokens_at_preemption = list(second.all_token_ids)

    while "second" not in scheduled(outs[-1]):
        outs.append(step(sched))
    resumed = outs[-1].scheduled[-1]
    assert resumed.start_position == 0
    assert resumed.token_ids == tokens_at_preemption  # prompt and outputs, from scratch
    assert resumed.sample
    assert resumed.new is not None  # sent whole again, its outputs so far included
    assert resumed.new.output_token_ids == tokens_at_preemption[8:] == [TOKEN] * 5

    run_until_done(sched)
    assert first.output_token_ids == [TOKEN] * 10
    assert second.output_token_ids == [TOKEN] * 10
    assert first.num_preemptions == 0
    assert_all_blocks_free(sched)


def test_resumed_request_reuses_its_own_cached_prefix():
    sched = make_scheduler(num_blocks=6)
    sched.add_request(make_request("first", 8, max_tokens=10))
    second = make_request("second", 8, max_tokens=10)
    sched.add_request(second)
    outs = run_until_done(sched)
    assert sum(out.num_preempted for out in outs) >= 1
    assert second.output_token_ids == [TOKEN] * 10
    assert second.num_cached_tokens == 0  # counted at first admission only
    assert_all_blocks_free(sched)


def test_priority_preempts_the_lowest_priority_request_not_the_latest():
    sched = make_scheduler(num_blocks=6, policy="priority", enable_caching=False)
    low = make_request("low", 8, max_tokens=10, priority=5)  # arrives first
    high = make_request("high", 8, max_tokens=10, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    assert list(scheduled(step(sched))) == ["high", "low"]
    while step(sched).num_preempted == 0:
        pass
    assert low.status == RequestStatus.PREEMPTED and high.status == RequestStatus.RUNNING
    run_until_done(sched)
    assert high.num_preemptions == 0
    assert low.output_token_ids == high.output_token_ids == [TOKEN] * 10


def test_priority_preempts_a_low_priority_decode_already_scheduled_this_step():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=8, policy="priority")
    low = make_request("low", 4, max_tokens=16, priority=5)
    sched.add_request(low)
    step(sched)
    high = make_request("high", 20, max_tokens=4, priority=0)
    sched.add_request(high)
    outs = [step(sched)]  # low decodes first; high's prefill chunks take the rest
    while outs[-1].num_preempted == 0:
        outs.append(step(sched))
    assert low.status == RequestStatus.PREEMPTED
    assert high.status == RequestStatus.RUNNING and high.num_preemptions == 0
    assert "low" not in scheduled(outs[-1])
    run_until_done(sched)
    assert high.output_token_ids == [TOKEN] * 4 and low.output_token_ids == [TOKEN] * 16
    assert_all_blocks_free(sched)



def test_a_decode_taken_back_by_preemption_leaves_no_unwritten_block_in_the_prefix_cache():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=16, policy="priority")
    high = make_request("high", 8, max_tokens=4, priority=0)
    low = make_request("low", 2, max_tokens=8, priority=5)
    sched.add_request(high)
    sched.add_request(low)
    step(sched)
    sched.add_request(make_request("mid", 21, max_tokens=1, priority=3))
    step(sched)  # mid's first chunk takes the last free blocks

    out = sched.schedule()
    check_step(sched, out)
    # low's decode (filling its first block) is taken back; mid still lacks a block and goes too
    assert out.num_preempted == 2 and list(scheduled(out)) == ["high"]
    assert out.preempted_request_ids == {"low", "mid"}
    assert low.status == RequestStatus.PREEMPTED and len(low.block_hashes) == 1
    assert low.block_hashes[0] not in sched.kv.pool.cached
    probe = make_request("probe", low.all_token_ids + [5])
    assert sched.kv.get_computed_blocks(probe)[1] == 0

    update(sched, out, {"high": [TOKEN]})
    run_until_done(sched)
    assert low.output_token_ids == [TOKEN] * 8
    assert_all_blocks_free(sched)

# ---- property test -----------------------------------------------------------------------


class FakeKVCache:
    """Slot -> a hash of the token prefix whose K/V it holds; checks every read.

    Writes of a step land before its reads, as in the model runner, so a request may read
    blocks another request writes in the same step (a same-step prefix hit). `full_blocks`
    maps a block id to the chain hash of the full block last written into it.
    """

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.full_blocks: dict[int, int | None] = {}

    def execute(self, sched: Scheduler, out: SchedulerOutput) -> None:
        """Run a step whose block tables are those the runner rebuilt from the deltas."""
        tables = mirror(sched).tables
        expected = [sched.requests[s.request_id] for s in out.scheduled]
        for s, request in zip(out.scheduled, expected, strict=True):
            self._write(s, request, tables[s.request_id])
        for s, request in zip(out.scheduled, expected, strict=True):
            prefixes = prefix_hashes(request)
            for pos in range(s.start_position + len(s.token_ids)):
                assert self.slots.get(self._slot(tables[s.request_id], pos)) == prefixes[pos], (
                    f"{s.request_id} reads the wrong KV at position {pos}"
                )

    def check_cached_blocks_hold_their_tokens(self, sched: Scheduler) -> None:
        for block_hash, block in sched.kv.pool.cached.items():
            assert self.full_blocks.get(block.block_id) == block_hash, (
                f"block {block.block_id} is cached but does not hold its tokens' KV"
            )

    def _write(self, s: ScheduledRequest, request: Request, block_ids: list[int]) -> None:
        end = s.start_position + len(s.token_ids)
        prefixes, chain = prefix_hashes(request), block_chain(request)
        for pos in range(s.start_position, end):
            self.slots[self._slot(block_ids, pos)] = prefixes[pos]
        for i in range(s.start_position // BLOCK_SIZE, -(-end // BLOCK_SIZE)):
            is_full = (i + 1) * BLOCK_SIZE <= end
            self.full_blocks[block_ids[i]] = chain[i] if is_full else None

    @staticmethod
    def _slot(block_ids: list[int], pos: int) -> int:
        return block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


class FakeTier:
    """The KV tier as the runner keeps it: a saved block's slots, copied after the step's
    writes; a load copies them into fresh blocks before the step's writes and sometimes
    stops early (a damaged file)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.blocks: dict[bytes, list[int | None]] = {}
        self.num_loaded = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def load(self, kv: FakeKVCache, out: SchedulerOutput) -> dict[str, int]:
        loaded = {}
        for load in out.tier_loads:
            n = 0
            for block_id, block_hash in zip(load.block_ids, load.block_hashes, strict=True):
                if self.rng.random() < 0.05:
                    break
                for j, value in enumerate(self.blocks[block_hash]):
                    kv.slots[block_id * BLOCK_SIZE + j] = value
                kv.full_blocks[block_id] = block_hash
                n += 1
            loaded[load.request_id] = n
            self.num_loaded += n
        return loaded

    def save(self, kv: FakeKVCache, out: SchedulerOutput) -> None:
        for block_id, block_hash in out.tier_saves:
            assert kv.full_blocks.get(block_id) == block_hash, "saved before it was written"
            self.blocks[block_hash] = [kv.slots.get(block_id * BLOCK_SIZE + j)
                                       for j in range(BLOCK_SIZE)]


def prefix_hashes(request: Request) -> list[int]:
    """hashes[p] stands for tokens[: p + 1] (with the cache salt), what K/V at p depends on."""
    hashes, h = [], hash(request.cache_salt)
    for token in request.all_token_ids:
        h = hash((h, token))
        hashes.append(h)
    return hashes


def block_chain(request: Request) -> list[int]:
    """Chain hash of every full block of the request's tokens."""
    chain: list[int] = []
    tokens = request.all_token_ids
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = chain[-1] if chain else None
        chain.append(hash_block(parent, tokens[start : start + BLOCK_SIZE], request.cache_salt))
    return chain


def check_invariants(sched: Scheduler, unfinished: dict[str, Request]) -> None:
    """Request and block bookkeeping; `unfinished` loses the requests that ended."""
    pool = sched.kv.pool
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    assert running.isdisjoint(waiting) and running | waiting == set(sched.requests)
    assert len(sched.running) <= sched.config.max_num_seqs
    for request_id in [i for i in unfinished if i not in sched.requests]:
        assert unfinished.pop(request_id).status.finished, f"{request_id} dropped"
    for request in sched.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0 and not request.blocks
    for request in sched.running:
        assert request.status == RequestStatus.RUNNING
        assert len(request.blocks) * BLOCK_SIZE >= request.num_computed_tokens

    holders: dict[int, list[str]] = {}
    for request_id, request in sched.requests.items():  # a finished one holds none
        ids = [b.block_id for b in request.blocks]
        assert len(ids) == len(set(ids)), f"{request_id} holds a block twice"
        assert not ids or request_id in running
        for block_id in ids:
            holders.setdefault(block_id, []).append(request_id)
    for block in pool.blocks:
        num_holders = len(holders.get(block.block_id, []))
        assert block.ref_cnt == num_holders, f"block {block.block_id} ref count"
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
        if num_holders > 1:
            assert block.block_hash is not None, f"private block {block.block_id} shared"
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    assert len(pool.free_queue) == sum(b.ref_cnt == 0 for b in pool.blocks)
    assert all(b.block_hash == h for h, b in pool.cached.items())


def random_prompt(rng: random.Random, shared_prefixes: list[list[int]]) -> list[int]:
    """Often a shared prefix, with tokens from a small vocabulary so blocks repeat."""
    length = rng.randint(1, 40)
    head = rng.choice(shared_prefixes)[: rng.randint(0, length)] if rng.random() < 0.6 else []
    return head + [rng.randint(2, 5) for _ in range(length - len(head))]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("enable_caching, with_tier", [(True, False), (False, False),
                                                       (True, True)])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_the_invariants(seed, enable_caching, with_tier, policy):
    rng = random.Random(seed)
    # 16 blocks of 4 = 64 tokens: any one request (<= 40 + 20 tokens) fits alone, few together
    sched = make_scheduler(
        num_blocks=16,
        max_num_batched_tokens=rng.randint(8, 32),
        max_num_seqs=rng.randint(2, 6),
        policy=policy,
        enable_caching=enable_caching,
        max_model_len=64,
    )
    shared_prefixes = [[rng.randint(2, 5) for _ in range(32)] for _ in range(3)]
    fake_kv = FakeKVCache()
    tier = FakeTier(random.Random(seed)) if with_tier else None
    sched.kv.tier = tier
    tracked: dict[str, Request] = {}
    unfinished: dict[str, Request] = {}

    def random_step() -> None:
        out = sched.schedule()
        check_step(sched, out)
        loaded = tier.load(fake_kv, out) if tier else {}
        fake_kv.execute(sched, out)
        if tier:
            tier.save(fake_kv, out)
        sampled = {s.request_id: [EOS if rng.random() < 0.1 else rng.randint(2, 5)]
                   for s in out.scheduled if s.sample}
        result = ModelRunnerOutput.from_sampled(out, sampled)
        result.tier_loaded = loaded
        sched.update(out, result)
        check_invariants(sched, unfinished)
        fake_kv.check_cached_blocks_hold_their_tokens(sched)

    for i in range(1000):
        op = rng.random()
        if op < 0.3:
            request = make_request(
                f"r{i}", random_prompt(rng, shared_prefixes), max_tokens=rng.randint(1, 20),
                priority=rng.randint(0, 3), cache_salt=rng.choice([None, None, "salt"]),
            )
            tracked[request.request_id] = unfinished[request.request_id] = request
            sched.add_request(request)
        elif op < 0.4 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            assert sched.finish_request(victim, RequestStatus.FINISHED_ABORTED) is not None
            check_invariants(sched, unfinished)
        else:
            random_step()

    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        random_step()
    assert not sched.has_unfinished_requests(), "requests never finished"

    assert sched.num_preemptions > 0, "the pool was too big to exercise preemption"
    assert not enable_caching or sched.kv.num_hits > 0
    assert not with_tier or tier.num_loaded > 0, "nothing was read from the tier"
    assert all(not r.blocks and r.num_offered_blocks == 0 and r.num_blocks_sent is None
               for r in tracked.values())  # no per-request leftovers
    for request in tracked.values():
        assert request.status.finished
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.max_tokens or request.num_tokens == 64
        if request.status == RequestStatus.FINISHED_STOPPED:
            assert request.output_token_ids[-1] == EOS
    assert_all_blocks_free(sched)
    assert sorted(sched.kv.pool.free_queue) == list(range(16))
