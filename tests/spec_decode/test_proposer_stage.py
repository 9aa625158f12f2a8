"""Speculative decoding at the scheduler's edges, with no model: a step says how many drafts
each sampling request wants after it, the drafts the runner returns are verified in the
next step, cut to the request's room and grammar, and a preempted request's are dropped.

The scheduler is driven as the engine drives it: `schedule()`, then `update()` with what a
fake runner returns (its sampled tokens and the drafts it proposed)."""

from llmserve.config.engine import SpeculativeConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler, SchedulerConfig
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposer_stage import ProposerStage
from llmserve.spec_decode.speculator import Speculator

BLOCK_SIZE = 4
K = 3


def make(max_model_len: int = 1024, num_blocks: int = 64, disable_by_batch_size=None,
         adaptive: bool = False, budget: int = 64) -> tuple[Scheduler, Speculator]:
    speculator = Speculator(SpeculativeConfig(
        method="ngram", num_speculative_tokens=K, adaptive=adaptive,
        disable_by_batch_size=disable_by_batch_size))
    stage = ProposerStage(speculator, max_model_len)
    scheduler = Scheduler(SchedulerConfig(8, budget, max_model_len, "fcfs"),
                          KVCacheManager(num_blocks, BLOCK_SIZE, False), [stage])
    return scheduler, speculator


def request(request_id: str, num_prompt: int = 6, max_tokens: int = 20) -> Request:
    return Request(request_id, list(range(100, 100 + num_prompt)),
                   SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(scheduler: Scheduler, emit: dict[str, list[int]],
             drafts: dict[str, list[int]]) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """One step: requests that sample emit `emit[id]` (accepted drafts and one token;
    [5] by default) and the runner proposes `drafts[id]` for those asking (cut to what
    they asked for, as the runner does)."""
    out = scheduler.schedule()
    result = ModelRunnerOutput.empty([s.request_id for s in out.scheduled])
    for i, s in enumerate(out.scheduled):
        if s.sample:
            result.sampled_token_ids[i] = emit.get(s.request_id, [5])
            result.draft_token_ids[i] = drafts.get(s.request_id, [])[: s.num_drafts]
    scheduler.update(out, result)
    return out, result


def by_id(out: SchedulerOutput) -> dict:
    return {s.request_id: s for s in out.scheduled}


def test_drafts_proposed_after_a_step_are_verified_in_the_next():
    scheduler, speculator = make()
    scheduler.add_request(request("a"))
    out, _ = run_step(scheduler, {}, {"a": [7, 8, 9]})
    a = by_id(out)["a"]
    assert a.sample and a.num_drafts == K and a.spec_token_ids == []
    assert scheduler.requests["a"].spec_token_ids == [7, 8, 9]
    # the next step sends them after the sampled token; two accepted, then the target's
    out, _ = run_step(scheduler, {"a": [7, 8, 6]}, {"a": [1, 2, 3]})
    a = by_id(out)["a"]
    assert (a.token_ids, a.spec_token_ids) == ([5], [7, 8, 9])
    request_a = scheduler.requests["a"]
    assert request_a.output_token_ids == [5, 7, 8, 6]
    assert request_a.num_computed_tokens == 6 + 3  # the rejected draft's slot recomputed
    assert (speculator.stats.num_draft_tokens, speculator.stats.num_accepted_tokens) == (3, 2)
    assert request_a.spec_token_ids == [1, 2, 3]


def test_a_prompt_still_prefilling_asks_for_no_drafts():
    scheduler, _ = make(budget=4)
    scheduler.add_request(request("a", num_prompt=10))
    out, _ = run_step(scheduler, {}, {"a": [7]})
    assert not by_id(out)["a"].sample and by_id(out)["a"].num_drafts == 0
    assert scheduler.requests["a"].spec_token_ids == []


def test_drafts_never_pass_max_tokens_nor_the_context():
    scheduler, _ = make()
    scheduler.add_request(request("a", max_tokens=3))
    out, _ = run_step(scheduler, {}, {"a": [7, 8, 9]})
    # after this step's token, 2 more may be emitted: one draft and the target's token
    assert by_id(out)["a"].num_drafts == 1
    assert scheduler.requests["a"].spec_token_ids == [7]

    scheduler, _ = make(max_model_len=9)
    scheduler.add_request(request("b", num_prompt=6))
    out, _ = run_step(scheduler, {}, {"b": [7, 8, 9]})
    assert by_id(out)["b"].num_drafts == 2  # 7 tokens after this step: 2 more slots

    # a step that emits more than one token leaves less room: the drafts are cut to it
    scheduler, _ = make(max_model_len=12)
    scheduler.add_request(request("c", num_prompt=6))
    run_step(scheduler, {}, {"c": [7, 8, 9]})
    out, _ = run_step(scheduler, {"c": [7, 8, 6]}, {"c": [1, 2, 3]})
    assert by_id(out)["c"].num_drafts == K  # asked for as if one token came
    assert scheduler.requests["c"].num_tokens == 10
    out, _ = run_step(scheduler, {}, {})
    assert by_id(out)["c"].spec_token_ids == [1, 2]  # 2 slots left in the context


def test_grammar_cuts_drafts_once_it_has_advanced():
    class Grammar:
        is_terminated = False

        def num_valid(self, token_ids):
            return token_ids.index(8) if 8 in token_ids else len(token_ids)

    scheduler, _ = make()
    r = request("a")
    r.grammar = Grammar()
    scheduler.add_request(r)
    run_step(scheduler, {}, {"a": [7, 8, 9]})
    assert r.spec_token_ids == [7, 8, 9]  # the grammar has not seen the step's token yet
    out, _ = run_step(scheduler, {"a": [7, 6]}, {"a": [1]})
    assert by_id(out)["a"].spec_token_ids == [7]  # cut where the grammar refuses
    r.grammar.is_terminated = True
    out, _ = run_step(scheduler, {}, {})
    assert by_id(out)["a"].spec_token_ids == [] and by_id(out)["a"].num_drafts == 0


def test_large_batches_ask_for_no_drafts():
    scheduler, _ = make(disable_by_batch_size=2)
    scheduler.add_request(request("a"))
    scheduler.add_request(request("b"))
    out, _ = run_step(scheduler, {}, {"a": [7], "b": [7]})
    assert [s.num_drafts for s in out.scheduled] == [0, 0]
    assert all(not r.spec_token_ids for r in scheduler.requests.values())


def test_adaptive_k_drifts_back_after_rounds_without_drafts():
    scheduler, speculator = make(adaptive=True)
    scheduler.add_request(request("a", max_tokens=200))
    r = scheduler.requests["a"]
    r.draft_acceptance = 0.0  # never accepted: asks for none
    out, _ = run_step(scheduler, {}, {})
    assert by_id(out)["a"].num_drafts == 0
    assert r.draft_acceptance > 0.0  # a round without drafts moves it to the prior


def test_a_preempted_request_drops_its_drafts():
    scheduler, _ = make(num_blocks=4)  # 16 slots for two requests of 6 + drafts
    scheduler.add_request(request("a"))
    scheduler.add_request(request("b"))
    run_step(scheduler, {}, {"a": [7, 8, 9], "b": [7, 8, 9]})
    for _ in range(4):  # their drafts and tokens outgrow the blocks: one is preempted
        out, _ = run_step(scheduler, {}, {"a": [7, 8, 9], "b": [7, 8, 9]})
        if out.num_preempted:
            break
    assert out.num_preempted
    preempted = [r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED]
    assert preempted and all(r.spec_token_ids == [] for r in preempted)
