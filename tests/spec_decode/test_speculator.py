"""The speculation policy: k from the acceptance rate and the measured cost, off for large
batches, running counts; the config's validation."""

import pytest

from llmserve.config.engine import EngineConfig, SpeculativeConfig
from llmserve.core.request import Request
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.speculator import (
    PRIOR_ACCEPTANCE,
    Speculator,
    StepCosts,
    best_num_drafts,
)


def request(rid: str = "r") -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=100), 100)


def test_best_num_drafts_follows_acceptance_and_cost():
    assert best_num_drafts(0.95, 8, 0.0) == 8  # free drafts: always the most
    assert best_num_drafts(0.0, 8, 0.01) == 0  # never accepted: none
    assert best_num_drafts(0.2, 8, 0.3) == 0  # 1.2 tokens for 1.3 steps: a loss
    assert best_num_drafts(0.7, 8, 0.31) == 2  # (1 + .7 + .49) / 1.62 beats k = 1 and 3
    assert best_num_drafts(0.9, 4, 0.31) == 4
    # dearer drafts, fewer of them
    assert best_num_drafts(0.8, 8, 0.1) > best_num_drafts(0.8, 8, 0.3) > 0


def test_step_costs_use_the_nearest_calibrated_batch_below():
    costs = StepCosts({1: 0.1, 4: 0.5, 8: 1.0})
    assert [costs.draft_token_cost(b) for b in (1, 3, 4, 7, 8, 64)] == [
        0.1, 0.1, 0.5, 0.5, 1.0, 1.0]


def test_k_follows_what_each_k_was_measured_to_add():
    """Drafts that cost nothing up to 2 and a third of a step from 3 on (the exact path's
    GEMMs stream up to 3 rows): 2, where a line through the same 4-draft cost says 3."""
    assert best_num_drafts(0.7, 4, [0.02, 0.04, 0.36, 0.57]) == 2
    assert best_num_drafts(0.7, 4, 0.57 / 4) == 3
    assert best_num_drafts(0.95, 4, [0.02, 0.04, 0.06, 0.08]) == 4
    costs = StepCosts({1: 0.1, 2: 0.2, 4: 0.5}, {1: (0.01, 0.02, 0.3), 2: (0.1, 0.3, 0.6)})
    assert costs.extra_cost(1, 3) == [0.01, 0.02, 0.3]
    assert costs.extra_cost(1, 2) == [0.01, 0.02]
    assert costs.extra_cost(3, 3) == [0.1, 0.3, 0.6]  # batch 2's
    assert costs.extra_cost(8, 2) == [0.5, 1.0]  # batch 4's line
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert Speculator(config, costs).num_drafts(request("r"), 100) == \
        best_num_drafts(PRIOR_ACCEPTANCE, 3, [0.01, 0.02, 0.3])


def test_calibration_measures_every_k_at_small_batches(float32_model):
    """`measure_step_costs` on the real model: each k at batches 1 and 2, in line from 4;
    more drafts never add less; the line's slope is the last k's share."""
    from llmserve.spec_decode.cost import measure_step_costs
    from tests.engines import llm_on

    runner = llm_on(float32_model, kv_cache_memory="64MiB").engine.executor.runner
    costs = measure_step_costs(runner.model, runner.kv_cache, runner.attention, 3,
                               lambda batch, repeats: 0.001, batches=(1, 2, 4))
    assert set(costs.by_k) == {1, 2} and set(costs.by_batch) == {1, 2, 4}
    for batch, extra in costs.by_k.items():
        assert len(extra) == 3 and 0 < extra[0] < extra[1] < extra[2]
        assert costs.by_batch[batch] == pytest.approx(extra[-1] / 3)
    # a chain whose further drafts cost nothing (an EAGLE head's native chain, nearly):
    # only its first draft's step is charged, at every k
    costs = measure_step_costs(runner.model, runner.kv_cache, runner.attention, 3,
                               lambda batch, repeats: 1.0, batches=(1,),
                               chain_step=lambda batch: 0.0)
    first, *_, last = costs.by_k[1]
    assert first > 1.0 / 0.5 and last < 1.5 * first  # a step takes under 0.5 s here


def test_k_adapts_to_each_requests_acceptance():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=6)
    spec = Speculator(config, StepCosts({1: 0.1}))
    good, bad = request("good"), request("bad")
    start = spec.num_drafts(good, 100)
    assert start == best_num_drafts(PRIOR_ACCEPTANCE, 6, 0.1)
    for _ in range(20):
        spec.record(good, 4, 4)
        spec.record(bad, 4, 0)
    assert spec.num_drafts(good, 100) == 6
    assert spec.num_drafts(bad, 100) == 0
    assert spec.num_drafts(good, 2) == 2  # never past the request's room
    # a request that stopped drafting drifts back towards the prior until it tries again
    rounds = 0
    while spec.num_drafts(bad, 100) == 0:
        spec.drafted_nothing(bad)
        rounds += 1
    assert 1 <= rounds < 100
    stats = spec.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        40, 160, 80)
    assert stats.acceptance_rate == 0.5 and stats.mean_accepted_length == 3.0
    assert stats.accepted_per_position[:5] == [20, 20, 20, 20, 0]


def test_a_chain_is_cut_where_one_more_draft_stops_paying():
    """`min_chance`: the chance c at which one more draft (its share d = X / k of what k
    drafts add) leaves the round's tokens per step where they were, (E + c) / (1 + X + d)
    = E / (1 + X); drafts that cost next to nothing (the exact path's rows at batch 1) are
    kept at a few hundredths, dear ones (the int4 kernels') only when fairly sure."""
    config = SpeculativeConfig(method="eagle", model="head", num_speculative_tokens=4)
    cheap = Speculator(config, StepCosts({1: 0.02}, {1: (0.02, 0.04, 0.06, 0.08)}))
    dear = Speculator(config, StepCosts({1: 0.4}, {1: (0.4, 0.8, 1.2, 1.6)}))
    r = request()
    r.draft_acceptance = 0.5
    for spec, k in ((cheap, 4), (dear, 2)):
        extra = spec.costs.extra_cost(1, k)[-1]
        expected = sum(0.5 ** i for i in range(k + 1))
        cut = spec.min_chance(r, k)
        assert cut == pytest.approx(expected * extra / k / (1 + extra))
        rate = expected / (1 + extra)
        for c, pays in ((cut * 1.01, True), (cut * 0.99, False)):
            assert ((expected + c) / (1 + extra + extra / k) > rate) == pays
    assert cheap.min_chance(r, 4) == pytest.approx(1.9375 * 0.02 / 1.08)  # 0.036
    assert dear.min_chance(r, 2) == pytest.approx(1.75 * 0.4 / 1.8)  # 0.39
    assert cheap.min_chance(r, 0) == 0.0
    # k drafts every round: no cut
    fixed = SpeculativeConfig(method="eagle", model="head", adaptive=False)
    assert Speculator(fixed, dear.costs).min_chance(r, 4) == 0.0


def test_a_draft_already_made_is_kept_for_its_verification_alone():
    """`keep_chance`: once the proposer has paid for a draft's step, keeping it costs only
    its verification row (d = V / k of what verifying k drafts adds), so the proposer keeps
    drafts down to a lower chance than the one at which it runs another step; where the
    verification was not measured apart, the two are one."""
    config = SpeculativeConfig(method="eagle", model="head", num_speculative_tokens=4)
    costs = StepCosts({1: 0.4}, {1: (0.4, 0.8, 1.2, 1.6)}, {1: (0.15, 0.3, 0.5, 0.7)})
    spec = Speculator(config, costs)
    r = request()
    r.draft_acceptance = 0.5
    assert spec.keep_chance(r, 2) == pytest.approx(1.75 * (0.3 / 2) / 1.8)  # 0.146
    assert spec.min_chance(r, 2) == pytest.approx(1.75 * 0.4 / 1.8)  # 0.39, as before
    assert spec.keep_chance(r, 0) == 0.0
    unmeasured = Speculator(config, StepCosts({1: 0.4}, {1: (0.4, 0.8, 1.2, 1.6)}))
    assert unmeasured.keep_chance(r, 2) == pytest.approx(unmeasured.min_chance(r, 2))
    fixed = SpeculativeConfig(method="eagle", model="head", adaptive=False)
    assert Speculator(fixed, costs).keep_chance(r, 4) == 0.0


def test_costlier_batches_draft_less():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    spec = Speculator(config, StepCosts({1: 0.05, 8: 2.0}))
    r = request()
    assert spec.num_drafts(r, 100, batch_size=1) == 4
    assert spec.num_drafts(r, 100, batch_size=8) == 0


def test_fixed_k_and_the_batch_size_limit():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False,
                               disable_by_batch_size=4)
    spec = Speculator(config)
    assert [spec.num_drafts(request("a"), 100), spec.num_drafts(request("b"), 1)] == [3, 1]
    assert spec.enabled_for(3) and not spec.enabled_for(4)
    assert Speculator(SpeculativeConfig(method="ngram", disable_by_batch_size=None)
                      ).enabled_for(10_000)


@pytest.mark.parametrize("options, message", [
    ({"method": "lookahead"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "ngram", "model": "x.gguf"}, "'model' is for methods draft_model, medusa, eagle"),
    ({"method": "medusa"}, "method medusa needs 'model'"),
    ({"method": "eagle3"}, "method eagle3 needs 'model'"),
    ({"method": "ngram", "k": 3}, "unknown key 'k'"),
    ({"num_speculative_tokens": 3}, "needs 'method'"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_invalid_speculative_config_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=options)


def test_disable_by_batch_size_defaults_to_the_measured_crossover():
    assert SpeculativeConfig(method="ngram").disable_by_batch_size == 2
    assert SpeculativeConfig(method="self_draft").disable_by_batch_size == 8
    assert SpeculativeConfig(method="ngram", disable_by_batch_size=None).disable_by_batch_size \
        is None
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(method="ngram", disable_by_batch_size="never")


def test_speculative_config_from_a_dict():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config == SpeculativeConfig(method="ngram",
                                                          num_speculative_tokens=3)


def test_new_requests_start_from_what_the_methods_drafts_met_here():
    """A proposer rarely right on this workload stops costing new requests drafts; with
    nothing drafted for a while its evidence fades and requests try again."""
    config = SpeculativeConfig(method="eagle", model="heads", num_speculative_tokens=4)
    spec = Speculator(config, StepCosts({1: 0.25}))
    assert spec.prior == PRIOR_ACCEPTANCE and spec.num_drafts(request("first"), 100) > 0
    for i in range(30):  # a first draft right one round in ten
        spec.record(request(f"old{i}"), 4, 1 if i % 10 == 0 else 0)
    assert spec.prior < 0.25
    new = request("new")
    assert spec.num_drafts(new, 100) == 0  # 1.2 tokens for 1.25 steps at best
    rounds = 0
    while spec.num_drafts(new, 100) == 0:
        spec.drafted_nothing(new)
        rounds += 1
    assert 20 <= rounds < 2000
    # a method that is often right keeps drafting from the start
    good = Speculator(config, StepCosts({1: 0.2}))
    for i in range(30):
        good.record(request(f"g{i}"), 4, 3)
    assert good.prior > 0.7 and good.num_drafts(request("next"), 100) >= 3
