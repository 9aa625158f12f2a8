"""The KV tier on the real default model: a block read from the tier gives the output its
recomputation gives (greedy, token for token), after a restart, under memory pressure and
after swap preemption; a damaged or foreign tier folder loads nothing wrong; `cache_salt`
keeps its isolation through the tier."""

import os
import shutil

import pytest

from llmserve import SamplingParams
from tests.engines import llm_on

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = ("You are a careful assistant for a library. Answer in one short sentence, name "
          "your source, and never invent a book. ") * 6
QUESTIONS = ["Where is the atlas?", "Who wrote Dune?", "Is the reading room open?",
             "How do I renew a loan?"]


def chat(llm, question: str, salt: str | None = None, system: str = SYSTEM) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    prompt = {"prompt_token_ids": llm.tokenizer.apply_chat_template(messages, tokenize=True)}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def run(llm, prompts: list[dict]) -> list:
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def restart(loaded, tier_dir, **options):
    """A fresh engine on the same weights and tier folder (what a restarted server is)."""
    return llm_on(loaded, kv_offload_dir=str(tier_dir), **options)


@pytest.fixture(scope="module", params=["default", pytest.param("float32", marks=pytest.mark.slow),
                                        "int8-kv"])
def setup(request, default_model, float32_model):
    loaded = float32_model if request.param == "float32" else default_model
    options = {"kv_cache_memory": "64MiB"}
    if request.param == "int8-kv":
        options["kv_cache_dtype"] = "int8"
    return loaded, options


def test_blocks_from_the_tier_give_the_recomputed_output(setup, tmp_path):
    loaded, options = setup
    plain = llm_on(loaded, **options)
    prompts = [chat(plain, q) for q in QUESTIONS]
    expected = ids(run(plain, prompts))  # no tier, nothing cached: every block computed

    first = restart(loaded, tmp_path, **options)
    assert ids(run(first, prompts)) == expected
    first.engine.shutdown()  # the writer finishes
    assert first.engine.kv_tier.stats.num_saved > 0

    second = restart(loaded, tmp_path, **options)
    outputs = run(second, prompts)
    assert ids(outputs) == expected
    # the first prompt read the shared system prompt from the tier; the others found it
    # (and their own blocks from the first life) in memory or the tier
    tier_tokens = [o.metrics.num_tier_cached_tokens for o in outputs]
    assert tier_tokens[0] >= 128, tier_tokens
    assert all(o.num_cached_tokens >= 128 for o in outputs)
    stats = second.engine.kv_tier.stats
    assert stats.num_loaded > 0 and sum(stats.rejected.values()) == 0
    assert second.engine.kv_manager.num_tier_hits == stats.num_loaded


@pytest.mark.parametrize("kind", ["disk", pytest.param("host", marks=pytest.mark.slow)])
def test_a_working_set_larger_than_memory_is_served_from_the_tier(default_model, tmp_path,
                                                                  kind):
    # 24 blocks of 16 tokens hold one prompt (~200 tokens) at a time, not four
    options = {"kv_cache_memory": 24 * 16 * 46080 // 2}
    plain = llm_on(default_model, **options)
    prompts = [chat(plain, q, system=f"Library {i}. {SYSTEM}") for i, q in enumerate(QUESTIONS)]
    expected = [ids(run(plain, [p]))[0] for p in prompts]
    tier = {"kv_offload_dir": str(tmp_path)} if kind == "disk" else {"kv_offload_gib": 0.05}
    tiered = llm_on(default_model, **tier, **options)
    assert tiered.engine.kv_tier.name == kind
    for p in prompts:  # one at a time: each evicts the one before from memory
        run(tiered, [p])
    again = [run(tiered, [p])[0] for p in prompts]
    assert ids(again) == expected
    assert all(o.metrics.num_tier_cached_tokens > 0 for o in again)


@pytest.mark.parametrize("mode", ["swap", pytest.param("recompute", marks=pytest.mark.slow)])
def test_preemption_by_swap_or_recompute_changes_no_output(default_model, tmp_path, mode):
    plain = llm_on(default_model, kv_cache_memory="64MiB")
    # no prefix in common: a victim's blocks are its own
    prompts = [chat(plain, q, system=f"Library {i}. {SYSTEM}")
               for i, q in enumerate((QUESTIONS * 2)[:6])]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params,
                                                                use_tqdm=False)]
    # 24 blocks (bfloat16 entries) hold two prompts of ~11 blocks, not their outputs:
    # the later one is preempted as the earlier one's outputs fill blocks
    tight = llm_on(default_model, kv_cache_memory=24 * 16 * 46080 // 2,
                   kv_offload_dir=str(tmp_path), preemption_mode=mode)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    swapped = sum(o.metrics.num_swapped_in_tokens for o in outputs)
    assert (swapped > 0) == (mode == "swap"), swapped
    pool = tight.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def flip_payload_bytes(tier_dir) -> int:
    paths = list(tier_dir.rglob("*.kvb"))
    for path in paths:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    return len(paths)


def test_a_damaged_tier_loads_nothing_wrong(default_model, tmp_path):
    options = {"kv_cache_memory": "64MiB"}
    plain = llm_on(default_model, **options)
    prompts = [chat(plain, q) for q in QUESTIONS[:2]]
    expected = ids(run(plain, prompts))
    first = restart(default_model, tmp_path, **options)
    run(first, prompts)
    first.engine.shutdown()
    assert flip_payload_bytes(tmp_path) > 0
    second = restart(default_model, tmp_path, **options)
    outputs = run(second, prompts)
    assert ids(outputs) == expected
    assert second.engine.kv_tier.stats.rejected["checksum"] > 0
    assert second.engine.kv_tier.stats.num_loaded == 0
    assert all(o.metrics.num_tier_cached_tokens == 0 for o in outputs)


def test_another_engines_blocks_are_not_loaded(default_model, float32_model, tmp_path):
    """The float32 path's blocks, put where the default path's would be (its folder renamed
    to the default path's namespace), are refused by the manifest, never read."""
    exact = restart(float32_model, tmp_path / "exact", kv_cache_memory="64MiB")
    prompts = [chat(exact, q) for q in QUESTIONS[:2]]
    run(exact, prompts)
    exact.engine.shutdown()
    fast = restart(default_model, tmp_path / "fast", kv_cache_memory="64MiB")
    namespace = fast.engine.kv_tier.layout.namespace
    fast.engine.shutdown()
    shutil.rmtree(tmp_path / "fast" / namespace)
    (exact_ns,) = os.listdir(tmp_path / "exact")
    assert exact_ns != namespace
    shutil.copytree(tmp_path / "exact" / exact_ns, tmp_path / "fast" / namespace)
    plain = llm_on(default_model, kv_cache_memory="64MiB")
    expected = ids(run(plain, prompts))
    fast = restart(default_model, tmp_path / "fast", kv_cache_memory="64MiB")
    outputs = run(fast, prompts)
    assert ids(outputs) == expected
    assert fast.engine.kv_tier.stats.rejected["manifest"] > 0
    assert all(o.metrics.num_tier_cached_tokens == 0 for o in outputs)


def test_cache_salt_isolation_holds_through_the_tier(default_model, tmp_path):
    options = {"kv_cache_memory": "64MiB"}
    first = restart(default_model, tmp_path, **options)
    run(first, [chat(first, QUESTIONS[0], salt="alice")])
    first.engine.shutdown()
    second = restart(default_model, tmp_path, **options)
    (bob,) = run(second, [chat(second, QUESTIONS[0], salt="bob")])
    assert bob.num_cached_tokens == 0 and bob.metrics.num_tier_cached_tokens == 0
    (alice,) = run(second, [chat(second, QUESTIONS[0], salt="alice")])
    assert alice.metrics.num_tier_cached_tokens >= 128
    assert alice.outputs[0].token_ids == bob.outputs[0].token_ids  # the same computation


def test_the_tier_is_refused_where_it_cannot_work():
    from llmserve.config.engine import EngineConfig

    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_offload_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="swap"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="sometimes")
    with pytest.raises(ValueError, match="kv_offload_gib"):
        EngineConfig(kv_offload_gib=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(kv_offload_dir="/tmp/x", tensor_parallel_size=2)
