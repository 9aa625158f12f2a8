"""The static scheduling policy: a batch runs to completion before the next is admitted."""

from dataclasses import replace

import pytest

from llmserve.core.request import RequestStatus
from llmserve.core.scheduler import SchedulerConfig
from llmserve.engine.engine import Engine
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams
from tests.core.test_scheduler import make_request, make_scheduler, scheduled, step


def test_a_request_arriving_during_a_batch_waits_for_the_whole_batch():
    sched = make_scheduler(policy="static")
    sched.add_request(make_request("a", 4, max_tokens=2))
    sched.add_request(make_request("b", 4, max_tokens=5))
    assert scheduled(step(sched)) == {"a": 4, "b": 4}
    sched.add_request(make_request("late", 4, max_tokens=2))
    assert scheduled(step(sched)) == {"a": 1, "b": 1}  # a finishes here
    assert sched.requests.get("a") is None
    # continuous batching would admit "late" into a's seat; static waits for b
    for _ in range(3):
        assert scheduled(step(sched)) == {"b": 1}
    assert "b" not in sched.requests and sched.num_waiting == 1
    assert scheduled(step(sched)) == {"late": 4}


def test_fcfs_admits_the_late_request_as_soon_as_a_seat_frees():
    sched = make_scheduler(policy="fcfs")
    sched.add_request(make_request("a", 4, max_tokens=2))
    sched.add_request(make_request("b", 4, max_tokens=5))
    step(sched)
    sched.add_request(make_request("late", 4, max_tokens=2))
    assert scheduled(step(sched)) == {"a": 1, "b": 1, "late": 4}


def test_a_batch_is_cut_at_max_num_seqs_and_the_next_one_follows():
    sched = make_scheduler(policy="static", max_num_seqs=2)
    for name, max_tokens in [("a", 1), ("b", 3), ("c", 2), ("d", 2), ("e", 1)]:
        sched.add_request(make_request(name, 4, max_tokens=max_tokens))
    admitted: list[set[str]] = []
    while sched.has_unfinished_requests():
        out = step(sched)
        new = {s.request_id for s in out.scheduled if s.new is not None}
        if new:
            admitted.append(new)
    assert admitted == [{"a", "b"}, {"c", "d"}, {"e"}]


def test_a_batch_larger_than_one_step_budget_is_admitted_over_several_steps():
    # 16-token budget, 12-token prompts: three members need three steps of prefill, and a
    # request that came meanwhile is still not admitted
    sched = make_scheduler(policy="static", max_num_batched_tokens=16)
    for name in "abc":
        sched.add_request(make_request(name, 12, max_tokens=4))
    assert scheduled(step(sched)) == {"a": 12, "b": 4}
    sched.add_request(make_request("late", 4, max_tokens=2))
    assert scheduled(step(sched)) == {"a": 1, "b": 8, "c": 7}
    assert scheduled(step(sched)) == {"a": 1, "b": 1, "c": 5}
    assert sched.batch == {sched.requests[n] for n in "abc"}
    assert sched.waiting == [sched.requests["late"]]


def test_a_batch_holds_only_what_fits_the_free_blocks():
    # 8 blocks of 4 tokens: two 12-token prompts (3 blocks each) fit, a third does not
    sched = make_scheduler(policy="static", num_blocks=8, max_num_batched_tokens=64)
    for name in "abc":
        sched.add_request(make_request(name, 12, max_tokens=1))
    assert scheduled(step(sched)) == {"a": 12, "b": 12}
    assert scheduled(step(sched)) == {"c": 12}


def test_a_preempted_member_resumes_within_its_batch():
    # 4 blocks: a and b (4 tokens each) fill one block each and grow by decoding until
    # the cache runs out; the preempted one comes back before the late request
    sched = make_scheduler(policy="static", num_blocks=4, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 4, max_tokens=9))
    sched.add_request(make_request("b", 4, max_tokens=9))
    step(sched)
    sched.add_request(make_request("late", 4, max_tokens=1))
    order: list[str] = []
    while sched.has_unfinished_requests():
        out = step(sched)
        order += [s.request_id for s in out.scheduled if s.new is not None]
    assert sched.num_preemptions > 0
    assert order[-1] == "late" and "late" not in order[:-1]


def test_an_aborted_member_leaves_the_batch():
    sched = make_scheduler(policy="static")
    sched.add_request(make_request("a", 4, max_tokens=50))
    step(sched)
    sched.add_request(make_request("late", 4, max_tokens=1))
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduled(step(sched)) == {"late": 4}


def test_the_policy_is_validated():
    with pytest.raises(ValueError, match="static"):
        SchedulerConfig(policy="batch")


def test_static_outputs_equal_continuous_ones(smollm2_llm):
    """Greedy outputs do not depend on how requests were batched."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = replace(smollm2_llm.engine.config, scheduling_policy="static", max_num_seqs=3)
    static = LLM.from_engine(Engine(config, loaded=smollm2_llm.engine.loaded))
    expected = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in static.generate(prompts, params)]
    assert got == expected
