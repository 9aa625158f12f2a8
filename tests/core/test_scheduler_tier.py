"""The scheduler with a KV tier: tier hits are read before a request computes anything,
the blocks that arrive count as computed (the rest are recomputed), every filled block is
offered to the tier once its KV is written, and a preempted request resumes from the tier
or by recomputing, as `--preemption-mode` and the measured costs say."""

import pytest

from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.core.preemption import ResumeCost
from llmserve.core.request import RequestStatus
from llmserve.core.scheduler import Scheduler, SchedulerConfig
from llmserve.lora_request import LoRARequest
from tests.core.test_scheduler import (
    BLOCK_SIZE,
    EOS,
    TOKEN,
    assert_all_blocks_free,
    check_step,
    make_request,
    scheduled,
)


class FakeTier:
    """The tier as the runner keeps it: hashes saved after each step; `bad` ones fail to
    load (as a damaged file does)."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.bad: set[bytes] = set()
        self.saved: list[bytes] = []

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes


def make(num_blocks: int = 64, mode: str = "auto", budget: int = 32,
         max_num_seqs: int = 8) -> tuple[Scheduler, FakeTier]:
    tier = FakeTier()
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, True, tier)
    config = SchedulerConfig(max_num_seqs, budget, 1024, max_loras=1)
    return Scheduler(config, kv, resume_cost=ResumeCost(mode, BLOCK_SIZE, 1000)), tier


def step(sched: Scheduler, tier: FakeTier, finish: frozenset[str] = frozenset()
         ) -> SchedulerOutput:
    """One step with a fake runner that keeps the step's filled blocks in `tier` and loads
    the tier's blocks up to the first bad one."""
    out = sched.schedule()
    check_step(sched, out)
    for block_id, block_hash in out.tier_saves:
        owner = [r for r in sched.running if block_id in sched.kv.block_ids(r)]
        assert owner, "a saved block belongs to no running request"
        index = sched.kv.block_ids(owner[0]).index(block_id)
        # the whole block is computed by the end of this step
        assert owner[0].num_computed_tokens >= (index + 1) * BLOCK_SIZE
        assert owner[0].block_hashes[index] == block_hash
        tier.hashes.add(block_hash)
        tier.saved.append(block_hash)
    sampled = {s.request_id: [EOS if s.request_id in finish else TOKEN]
               for s in out.scheduled if s.sample}
    result = ModelRunnerOutput.from_sampled(out, sampled)
    for load in out.tier_loads:
        assert load.request_id not in scheduled(out), "a loading request computed"
        n = 0
        while n < len(load.block_hashes) and load.block_hashes[n] not in tier.bad:
            n += 1
        result.tier_loaded[load.request_id] = n
    result.tier_load_seconds = 0.001 * len(out.tier_loads)
    sched.update(out, result)
    return out


def run(sched: Scheduler, tier: FakeTier, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps
        outs.append(step(sched, tier))
    return outs


def warm(sched: Scheduler, tier: FakeTier, prompt: list[int], **kwargs) -> None:
    """Run `prompt` to completion, then forget the memory tier's copy of its blocks."""
    sched.add_request(make_request("warm", prompt, max_tokens=2, **kwargs))
    run(sched, tier)
    sched.kv.pool.reset_prefix_cache()


def test_every_filled_block_goes_to_the_tier_once():
    sched, tier = make()
    prompt = list(range(100, 150))  # 12 full blocks and 2 tokens
    sched.add_request(make_request("a", prompt, max_tokens=12))
    # shares a's 12 full blocks, not what follows them
    sched.add_request(make_request("b", prompt[:48] + [7, 8], max_tokens=12))
    run(sched, tier)
    assert len(tier.saved) == len(set(tier.saved))
    # the 12 shared blocks, then each request's 3 (61 tokens computed: 15 full blocks)
    assert len(tier.saved) == 12 + 2 * 3


def test_a_prompt_memory_evicted_is_read_from_the_tier_not_computed():
    sched, tier = make()
    prompt = list(range(100, 150))
    warm(sched, tier, prompt)
    again = make_request("again", prompt, max_tokens=3)
    sched.add_request(again)
    first = step(sched, tier)
    assert scheduled(first) == {} and len(first.tier_loads) == 1
    load = first.tier_loads[0]
    assert load.request_id == "again" and load.block_hashes == again.block_hashes[:12]
    assert load.block_ids == sched.kv.block_ids(again)
    assert again.num_computed_tokens == 48 and again.num_cached_tokens == 48
    assert again.num_tier_cached_tokens == 48
    second = step(sched, tier)
    assert scheduled(second) == {"again": 2}  # only the tokens past the loaded blocks
    assert second.scheduled[0].start_position == 48
    run(sched, tier)
    assert again.output_token_ids == [TOKEN] * 3
    assert sched.kv.num_tier_hits == 12 and sched.kv.num_tier_hit_tokens == 48
    assert_all_blocks_free(sched)


def test_memory_hits_come_first_and_the_tier_continues_them():
    sched, tier = make()
    prompt = list(range(100, 150))
    warm(sched, tier, prompt)
    sched.add_request(make_request("short", prompt[:17], max_tokens=1))
    run(sched, tier)  # its 4 blocks are back in memory (read from the tier)
    full = make_request("full", prompt, max_tokens=1)
    sched.add_request(full)
    out = step(sched, tier)
    assert out.tier_loads[0].block_hashes == full.block_hashes[4:12]
    assert full.num_cached_tokens == 48 and full.num_tier_cached_tokens == 32


def test_blocks_that_fail_to_load_are_recomputed_from_the_first_bad_one():
    sched, tier = make()
    prompt = list(range(100, 150))
    warm(sched, tier, prompt)
    again = make_request("again", prompt, max_tokens=2)
    sched.kv._update_block_hashes(again)
    tier.bad = {again.block_hashes[5]}
    sched.add_request(again)
    step(sched, tier)
    assert again.num_computed_tokens == 5 * BLOCK_SIZE  # blocks 0-4 arrived
    assert again.num_tier_cached_tokens == 20
    # the failed blocks are not in memory's prefix cache until they are computed
    assert sched.kv.pool.get_cached_block(again.block_hashes[5]) is None
    out = step(sched, tier)
    assert out.scheduled[0].start_position == 20 and len(out.scheduled[0].token_ids) == 30
    run(sched, tier)
    assert again.output_token_ids == [TOKEN] * 2
    assert_all_blocks_free(sched)


def test_another_cache_salt_finds_nothing_in_the_tier():
    sched, tier = make()
    prompt = list(range(100, 150))
    warm(sched, tier, prompt, cache_salt="alice")
    bob = make_request("bob", prompt, max_tokens=1, cache_salt="bob")
    sched.add_request(bob)
    out = step(sched, tier)
    assert out.tier_loads == [] and scheduled(out) == {"bob": 32}
    alice = make_request("alice", prompt, max_tokens=1, cache_salt="alice")
    sched.add_request(alice)
    assert step(sched, tier).tier_loads[0].request_id == "alice"


def test_adapter_requests_neither_save_nor_load():
    sched, tier = make()
    request = make_request("lora", list(range(100, 150)), max_tokens=1)
    request.lora_request = LoRARequest("sql", 1, "/nowhere")
    sched.add_request(request)
    run(sched, tier)
    assert tier.saved == []
    sched.kv.pool.reset_prefix_cache()
    warm(sched, tier, list(range(100, 150)))
    again = make_request("lora2", list(range(100, 150)), max_tokens=1)
    again.lora_request = LoRARequest("sql", 1, "/nowhere")
    sched.add_request(again)
    assert step(sched, tier).tier_loads == []


def test_an_aborted_loading_request_frees_its_blocks():
    sched, tier = make()
    prompt = list(range(100, 150))
    warm(sched, tier, prompt)
    sched.add_request(make_request("gone", prompt, max_tokens=4))
    out = sched.schedule()
    assert out.tier_loads
    sched.finish_request("gone", RequestStatus.FINISHED_ABORTED)
    sched.update(out, ModelRunnerOutput.from_sampled(out, {}))
    assert_all_blocks_free(sched)


def preempting_workload(mode: str) -> tuple[Scheduler, FakeTier, list[SchedulerOutput]]:
    """Two long requests in a cache too small for both: the later one is preempted."""
    sched, tier = make(num_blocks=14, mode=mode)
    sched.add_request(make_request("first", 24, max_tokens=24))
    second = make_request("second", 24, max_tokens=24)
    sched.add_request(second)
    outs = run(sched, tier)
    assert second.num_preemptions >= 1
    assert second.output_token_ids == [TOKEN] * 24
    assert_all_blocks_free(sched)
    return sched, tier, outs


def resumed_loads(outs: list[SchedulerOutput]) -> list[int]:
    return [len(load.block_ids) for out in outs for load in out.tier_loads
            if load.request_id == "second"]


def test_swap_reads_a_preempted_requests_blocks_back():
    sched, _, outs = preempting_workload("swap")
    second = sched.requests.get("second")  # finished: not tracked any more
    assert second is None
    assert resumed_loads(outs), "the resumed request read nothing from the tier"


def test_recompute_never_reads_a_preempted_requests_blocks_back():
    _, _, outs = preempting_workload("recompute")
    assert resumed_loads(outs) == []


@pytest.mark.parametrize("tier_bytes_per_s, reads", [(1e9, True), (1.0, False)])
def test_auto_reads_back_when_reading_costs_less_than_computing(tier_bytes_per_s, reads):
    cost = ResumeCost("auto", BLOCK_SIZE, 1000, prefill_tokens_per_s=100.0,
                      tier_bytes_per_s=tier_bytes_per_s)
    assert cost.swap_pays(3) is reads
    assert ResumeCost("auto", BLOCK_SIZE, 1000).swap_pays(3)  # unmeasured: read
    assert not ResumeCost("recompute").swap_pays(3)


def test_costs_are_measured_from_the_steps():
    cost = ResumeCost("auto", BLOCK_SIZE, 1000)
    cost.observe_step(10, 1.0)  # too few prefill tokens to say anything
    assert cost.prefill_tokens_per_s is None
    cost.observe_step(200, 2.0)
    cost.observe_load(4, 0.004)
    assert cost.prefill_tokens_per_s == 100.0 and cost.tier_bytes_per_s == 1e6
    with pytest.raises(ValueError, match="preemption_mode"):
        ResumeCost("sometimes")


def test_requests_sharing_a_prefix_read_it_once():
    sched, tier = make()
    prompt = list(range(100, 150))
    warm(sched, tier, prompt)
    first = make_request("first", prompt, max_tokens=2)
    second = make_request("second", prompt[:48] + [9, 9, 9], max_tokens=2)
    sched.add_request(first)
    sched.add_request(second)
    out = step(sched, tier)
    assert [load.request_id for load in out.tier_loads] == ["first"]
    assert second.status == RequestStatus.WAITING  # waits a step for the blocks
    out = step(sched, tier)
    assert out.tier_loads == [] and second.num_cached_tokens == 48
    assert second.num_tier_cached_tokens == 0  # found in memory, read once
    run(sched, tier)
    assert_all_blocks_free(sched)
