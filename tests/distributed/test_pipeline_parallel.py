"""Pipeline parallelism (`distributed/pipeline.py`): each stage holds a contiguous range of
the layers and their KV cache, stage 0 the embedding and the LM head; logits and greedy
tokens equal one process's bit for bit, on the exact float32 path and the default path
(unlike tensor parallelism's partial sums, a stage runs whole layers with one process's
kernels). Engines run one step per stage in flight; the engine-level checks go through
prefix-cache hits, chunked prefill, preemption, a grammar and an abort in flight.

PP=2 on the real model runs in the default suite; PP=3, TP=2 x PP=2 and the tiny Llama-3,
Gemma 3 and mixture-of-experts folders under `-m slow`.
"""

import multiprocessing

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.distributed.pipeline import HEAD_SHARE, layer_costs, partition_layers, stage_layers
from tests.distributed.test_tensor_parallel import (
    _logits,
    prompt_lookup_is_lossless,
    split_equals_reference,
    tiny_folder,
    tp_logits,
)
from tests.models.test_compile import NUM_TOKENS, _greedy
from tests.models.test_llama_reference import PROMPTS
from tests.spec_decode.test_eagle import with_a_grammar


def test_stage_layers_balance_what_a_step_reads(float32_model):
    """Contiguous ranges covering every layer once; stage 0 (with the LM head) takes
    fewer layers; no other split has a smaller largest stage."""
    cfg = float32_model.config
    costs, head = layer_costs(cfg)
    for size in (1, 2, 3, 4):
        ranges = stage_layers(cfg, size)
        assert [i for r in ranges for i in r] == list(range(cfg.num_hidden_layers))
        loads = [sum(costs[i] for i in r) + HEAD_SHARE * head * (s == 0)
                 for s, r in enumerate(ranges)]
        # moving one boundary layer either way never lowers the largest stage
        for s in range(size - 1):
            for shift in (-1, 1):
                cut = ranges[s].stop + shift
                if not ranges[s].start < cut < ranges[s + 1].stop:
                    continue
                moved = list(loads)
                delta = costs[cut - 1] if shift < 0 else -costs[cut - 1]
                moved[s], moved[s + 1] = moved[s] - delta, moved[s + 1] + delta
                assert max(moved) >= max(loads)
    two = stage_layers(cfg, 2)
    # SmolLM2's head reads as much as ~7 of its 30 layers, counted at HEAD_SHARE of that
    assert len(two[0]) < len(two[1])
    with pytest.raises(ValueError, match="pipeline_parallel_size 31"):
        stage_layers(cfg, 31)


def test_a_users_partition_is_checked(float32_model):
    """`--pipeline-layer-partition`: one count per stage, each at least one, adding up to
    the model's layers; the ranges follow the counts."""
    cfg = float32_model.config
    assert partition_layers(cfg, (12, 18)) == [range(0, 12), range(12, 30)]
    with pytest.raises(ValueError, match="add up to the model's 30 layers"):
        partition_layers(cfg, (12, 17))
    with pytest.raises(ValueError, match="one layer count per stage"):
        EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=(30,))
    with pytest.raises(ValueError, match="at least one layer"):
        EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=(0, 30))
    # refused before any rank starts
    with pytest.raises(ValueError, match="add up to the model's 30 layers"):
        LLM(pipeline_parallel_size=2, pipeline_layer_partition=(10, 10))
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("tp, pp", [(1, 2), pytest.param(1, 3, marks=pytest.mark.slow),
                                    pytest.param(2, 2, marks=pytest.mark.slow)])
def test_real_model_logits_equal_one_process(smollm2_gguf, chat_ids, tp, pp, default_model,
                                             float32_model):
    """Exact and default paths: every stage runs one process's kernels on whole layers, so
    the logits are its bits (TP=2 x PP=2 on the exact path, whose row-parallel layers
    chain the ranks in k order: tensor parallelism's default path adds partial sums)."""
    formats = [None] if tp > 1 else [None, default_model.quantization]
    got = tp_logits(str(smollm2_gguf), tp * pp, chat_ids, formats, pipeline_size=pp)
    for quantization, ours in zip(formats, got, strict=True):
        model = float32_model if quantization is None else default_model
        reference = _logits(model.model, chat_ids)
        assert torch.equal(ours, reference), (quantization, (ours - reference).abs().max())


@pytest.fixture(scope="module")
def chat_ids(smollm2_llm) -> list[int]:
    from tests.models.test_llama_reference import CHAT

    return smollm2_llm.tokenizer.apply_chat_template(CHAT, tokenize=True)[:64]


def _busy_engine_outputs(llm: LLM, prompts: list[str], params: list[SamplingParams],
                         abort_in_flight: bool = False) -> list[list[int]]:
    """All prompts at once through the engine's own loop (several steps in flight); with
    `abort_in_flight` an extra request is aborted while a step holds it."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    victim = engine.add_request("A request aborted while in flight.", params[0]) \
        if abort_in_flight else None
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        if victim is not None and steps == 2:
            assert engine.scheduler._in_flight, "nothing in flight to abort"
            engine.abort_request(victim)
            victim = None
    return [done[i] for i in ids]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("auto", marks=pytest.mark.slow)])
def test_engine_greedy_equals_one_process(smollm2_gguf, smollm2_llm, default_llm, dtype):
    """PP=2 through the engine: chunked prefill (32-token chunks), prefix-cache hits (the
    prompts share a system turn), preemption (a KV cache too small for all at once), a
    JSON-schema grammar and an abort while in flight; tokens equal one process's."""
    single = smollm2_llm if dtype == "float32" else default_llm
    tokenizer = single.tokenizer
    system = "You are a careful assistant who answers in plain words. "
    texts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": system + p[-1]["content"]}], tokenize=False)
        for p in PROMPTS]
    prompts, params = with_a_grammar(texts)
    params = [p if p.structured_outputs else SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True) for p in params]
    expected = [list(o.outputs[0].token_ids)
                for o in single.generate(prompts, params, use_tqdm=False)]
    # room for about three of the five at once (the default path's KV cache is int8)
    memory = {"float32": "6MiB", "auto": "2MiB"}[dtype]
    # the exact path on a user's partition
    partition = {"float32": (13, 17), "auto": None}[dtype]
    llm = LLM(str(smollm2_gguf), dtype=dtype, kv_cache_memory=memory,
              max_num_batched_tokens=32, pipeline_parallel_size=2,
              pipeline_layer_partition=partition)
    try:
        assert llm.engine.executor.pipeline_depth == 2
        if partition:
            assert llm.engine.loaded.model.held_layers == range(13)
        assert _busy_engine_outputs(llm, prompts, params, abort_in_flight=True) == expected
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv_manager.num_hits > 0
        # one at a time (nothing to overlap) as well; every rank dropped finished rows
        alone = llm.generate(prompts[:1], params[:1], use_tqdm=False)
        assert list(alone[0].outputs[0].token_ids) == expected[0]
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)
        assert llm.engine.executor.rows_held() == [1]
    finally:
        llm.engine.shutdown()
    assert all(not p.is_alive() for p in llm.engine.executor.processes)


@pytest.mark.slow
def test_tp2_pp2_engine_and_speculation(smollm2_gguf, smollm2_llm):
    """TP=2 x PP=2 (four ranks; stage 0's second rank finishes each step's logits when
    told), and prompt lookup at PP=2 (drafts from rank 0, verified through the pipeline):
    greedy tokens equal one process's."""
    tokenizer = smollm2_llm.tokenizer
    prompts = [tokenizer.apply_chat_template(p, tokenize=True) for p in PROMPTS]
    expected = _greedy(smollm2_llm, prompts)
    llm = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory="64MiB",
              tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert _greedy(llm, prompts) == expected
    finally:
        llm.engine.shutdown()
    prompt_lookup_is_lossless(smollm2_gguf, smollm2_llm, 3, pipeline_parallel_size=2)


@pytest.fixture(scope="module", params=["llama3", "gemma3", "qwen3_moe"])
def tiny4(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny4-{request.param}")
    return folder, tiny_folder(folder, request.param, num_layers=4)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 3), (2, 2)])
def test_tiny_folders(tiny4, tp, pp):
    """Four-layer Llama-3, Gemma 3 (local and global layers in turn) and Qwen3-MoE folders:
    logits equal one process's and the reference's within its tolerance, greedy tokens
    the reference's."""
    split_equals_reference(*tiny4, tensor_parallel_size=tp, pipeline_parallel_size=pp)


@pytest.mark.parametrize("options, named", [
    ({"enable_lora": True}, "enable_lora"),
    ({"runner": "pooling"}, "pipeline_parallel_size > 1"),
    ({"kv_offload_gib": 1.0}, "KV tier"),
    ({"kv_role": "prefill", "kv_transfer_address": "127.0.0.1:1"}, "pipeline_parallel_size"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be at least 1"),
])
def test_what_does_not_run_on_a_pipeline_is_refused_by_name(options, named):
    options = {"pipeline_parallel_size": 2} | options
    with pytest.raises(ValueError, match=named):
        EngineConfig(model="x", **options)


def test_eagle_heads_are_refused_on_a_pipeline(tmp_path):
    from llmserve.engine.loading import speculative_kv_layers

    config = EngineConfig(model="x", pipeline_parallel_size=2, speculative_config={
        "method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        speculative_kv_layers(config, None)


def test_bench_scaling_reports_each_stage_busy(tmp_path):
    """`llmserve bench scaling` on one process and on two stages: every stage's busy time
    is counted (positive, within the generation's time) and shown per stage."""
    from llmserve.bench.scaling import format_tp_row, run_tp

    folder = tmp_path / "tiny"
    tiny_folder(folder, "llama3", num_layers=4)
    lines: list[str] = []
    results = run_tp(str(folder), "float32", [(1, 1), (1, 2)], [4], 16, 8, lines.append)
    one, two = results
    assert one.stage_busy_seconds == () and len(two.stage_busy_seconds) == 2
    assert all(0 < busy <= two.seconds for busy in two.stage_busy_seconds)
    assert one.rank0_cpu_seconds > 0 and two.rank0_cpu_seconds > 0
    assert lines[1] == format_tp_row(two, results) and lines[1].count("%") == 3


def test_the_plan_of_a_step_over_hosts(float32_model, smollm2_gguf):
    """`plan_step`: the stages' weights read one after another, the link crossed once per
    stage (out, on, and back to stage 0); tensor parallelism across hosts adds its 2 x
    layers + 2 exchanges. `llmserve memory -pp 2` prints each stage and the plan."""
    from llmserve.distributed.pipeline import plan_step
    from llmserve.entrypoints.cli.memory_report import memory_report

    cfg = float32_model.config
    hidden = cfg.hidden_size * 4
    plan = plan_step(cfg, 100_000_000, 2, 1, 10e9, 125e6, 0.05)
    assert plan.link_hops == 2 and sum(plan.stage_weight_bytes) == pytest.approx(1e8, abs=2)
    assert plan.compute_s == pytest.approx(0.01, rel=1e-6)
    assert plan.link_s == pytest.approx(2 * (0.05 + hidden / 125e6))
    across = plan_step(cfg, 100_000_000, 2, 2, 10e9, 125e6, 0.05, tensor_across_hosts=True)
    exchanges = 2 * cfg.num_hidden_layers + 2
    assert across.link_s == pytest.approx(plan.link_s + exchanges * (0.05 + hidden / 125e6))
    assert across.compute_s == pytest.approx(plan.compute_s / 2)
    lines = memory_report(str(smollm2_gguf), 1, 512, "float32", None, "64MiB", 16,
                          pipeline_parallel_size=2, link=(125e6, 0.05),
                          read_bandwidth=10e9).splitlines()
    stages = [line for line in lines if line.startswith("stage ")]
    assert len(stages) == 2 and "the embedding and LM head" in stages[0]
    step = next(line for line in lines if line.startswith("step plan"))
    assert "100.0 ms" in step  # two crossings of 50 ms (and 2,304 bytes at 1 Gbit/s)
