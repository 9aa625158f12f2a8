"""EAGLE-1 heads: a tiny random head in the published layout (EAGLE's own, fc with a bias,
and vLLM's, with a `model.` prefix) loads and its forward over the paged KV cache, whole and
in chunks, equals a reference built from transformers' Llama layer as EAGLE uses it; a head
that does not fit the target is refused by name. In the engine, on the real default model:
greedy output with EAGLE drafts is the target's own on the exact and default paths,
batched, chunked, prefix-cached and preempted; and the head's K/V, kept in the target's
blocks, is exact: a random head proposes the same drafts whether the prompt ran whole, in
chunks, or came from the prefix cache, and whether or not its rows waited while no drafts
were asked. The head that ships for the default model drafts without a folder named.

A head that is accepted without training: fc passes the target's hidden state through and
the layer adds nothing (o_proj and down_proj zero), so it proposes the target's own choice
at the last position again, the token just sampled: a run of repeats is accepted whole.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from llmserve import SamplingParams
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.spec_decode.eagle import (
    EagleProposer,
    eagle_head_config,
    load_eagle_head,
    shipped_eagle_head,
)
from llmserve.spec_decode.medusa import HeadsFormatError
from llmserve.spec_decode.speculator import Speculator
from tests.engines import llm_on

K = 4
# the share of rounds in which the target keeps the shipped head's first draft in its
# test, at least (a random head's: none; measured: 0.41 on the exact path, 0.50 on the
# default one it was trained on; k drafts every round, no cut)
SHIPPED_HEAD_FIRST_KEPT = 0.3
GREEDY = SamplingParams(temperature=0, max_tokens=24)
PROMPTS = [
    "Write the word ok twenty times, separated by spaces: ok ok ok ok",
    "Count: 1 1 1 1 1 1 1 1 1 1",
    "The capital of France is",
    "List three fruits:",
    # long enough for prefix-cache hits past the block a hit leaves to compute again
    "The old lighthouse stood on the rocks above the harbour, and every night its keeper "
    "climbed the narrow stairs to light the lamp. Ships passing in the dark saw the beam "
    "sweep across the water and knew the coast was near. Repeat after me: yes yes yes yes",
]


def head_config(cfg) -> dict:
    return eagle_head_config(cfg)


def random_tensors(cfg, bias: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {"fc.weight": w(h, 2 * h),
               "layers.0.self_attn.q_proj.weight": w(q, h),
               "layers.0.self_attn.k_proj.weight": w(kv, h),
               "layers.0.self_attn.v_proj.weight": w(kv, h),
               "layers.0.self_attn.o_proj.weight": w(h, q),
               "layers.0.mlp.gate_proj.weight": w(i, h),
               "layers.0.mlp.up_proj.weight": w(i, h),
               "layers.0.mlp.down_proj.weight": w(h, i),
               "layers.0.post_attention_layernorm.weight": 1 + w(h)}
    if bias:
        tensors["fc.bias"] = w(h)
    return tensors


def write_head(folder: Path, cfg, tensors: dict, prefix: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head_config(cfg)))
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    return folder


def repeat_head(folder: Path, cfg) -> Path:
    tensors = random_tensors(cfg, bias=False)
    h = cfg.hidden_size
    tensors["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    return write_head(folder, cfg, tensors)


def reference_forward(tensors: dict, cfg, embeds: torch.Tensor,
                      features: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's head over one whole sequence: fc over [embedding, feature], then
    transformers' Llama decoder layer without its input norm, causal attention."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf = LlamaConfig(**{k: v for k, v in head_config(cfg).items()
                        if k not in ("architectures", "model_type")})
    hf._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf, 0)
    layer.input_layernorm = nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items()
                           if k.startswith("layers.0.")}, strict=False)
    fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias="fc.bias" in tensors)
    fc.weight.data = tensors["fc.weight"]
    if "fc.bias" in tensors:
        fc.bias.data = tensors["fc.bias"]
    t = embeds.shape[0]
    with torch.no_grad():
        x = fc(torch.cat([embeds, features], dim=-1))[None]
        positions = torch.arange(t)[None]
        cos, sin = LlamaRotaryEmbedding(hf)(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=(cos, sin))
    return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize(("bias", "prefix"), [(True, ""), (False, "model.")])
def test_head_over_the_paged_cache_equals_the_reference(tmp_path, float32_model, bias, prefix):
    cfg = float32_model.config
    tensors = random_tensors(cfg, bias)
    folder = write_head(tmp_path / "eagle", cfg, tensors, prefix)
    head = load_eagle_head(folder, float32_model, torch.device("cpu"), torch.float32,
                           int8=False)
    assert head.first_layer == cfg.num_hidden_layers
    t = 37
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(100, 5000, (t,), generator=g)
    features = torch.randn(t, cfg.hidden_size, generator=g)
    embeds = float32_model.model.model.embed_tokens(ids)
    want = reference_forward(tensors, cfg, embeds, features)
    attention = attention_backend(torch.device("cpu"))
    block = 16
    table = [list(range(3))]
    for chunks in ([t], [8, 16, 13]):  # whole, and in chunks over the cached K/V
        cache = KVCache.allocate(cfg.num_hidden_layers + 1, 4, block, cfg.num_key_value_heads,
                                 cfg.head_dim, torch.float32, torch.device("cpu"),
                                 zeroed=True)
        got, start = [], 0
        with torch.inference_mode():
            for n in chunks:
                meta = AttentionMetadata.build([n], [start], table, block,
                                               torch.device("cpu"), attention)
                got.append(head(embeds[start:start + n], features[start:start + n],
                                torch.arange(start, start + n), cache, meta)[0])
                start += n
        assert (torch.cat(got) - want).abs().max() < 2e-5


@pytest.mark.parametrize(("change", "message"), [
    (lambda c, t: c.update(hidden_size=64), "hidden_size 64 does not fit"),
    (lambda c, t: t.pop("layers.0.mlp.up_proj.weight"), "lacks one of its projections"),
    (lambda c, t: t.pop("layers.0.post_attention_layernorm.weight"), "missing head weights"),
    (lambda c, t: t.update({"layers.1.mlp.down_proj.weight": torch.zeros(1)}),
     "unexpected tensor"),
])
def test_heads_that_do_not_fit_are_refused_by_name(tmp_path, float32_model, change, message):
    cfg = float32_model.config
    config, tensors = head_config(cfg), random_tensors(cfg, True)
    change(config, tensors)
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(HeadsFormatError, match=message):
        load_eagle_head(folder, float32_model, torch.device("cpu"), torch.float32)


def spec(folder: Path, **options) -> dict:
    return {"method": "eagle", "model": str(folder), "num_speculative_tokens": K,
            "adaptive": False, "disable_by_batch_size": None} | options


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


@pytest.mark.parametrize("weights", ["float32_model", "default_model"])
def test_greedy_output_is_the_target_own_with_eagle_drafts(request, tmp_path, weights):
    loaded = request.getfixturevalue(weights)
    folder = repeat_head(tmp_path / "repeat", loaded.config)
    want = llm_on(loaded, kv_cache_memory="128MiB").generate(PROMPTS, GREEDY, use_tqdm=False)
    for options in ({}, {"max_num_batched_tokens": 8}):
        llm = llm_on(loaded, kv_cache_memory="128MiB", speculative_config=spec(folder),
                     **options)
        assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want)
        stats = llm.engine.speculator.stats
        assert stats.num_accepted_tokens > 0 and stats.accepted_per_position[-1] > 0
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # prefix-cache hits
        assert_same(again, want)
        assert any(o.num_cached_tokens for o in again)


def test_greedy_equal_with_preemption(tmp_path, float32_model):
    folder = repeat_head(tmp_path / "repeat", float32_model.config)
    plain = llm_on(float32_model, kv_cache_memory="128MiB")
    want = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    plan = plain.engine.kv_plan
    per_token = plan.total_bytes // plan.num_tokens * 31 // 30  # and the head's layer
    llm = llm_on(float32_model, kv_cache_memory=str(6 * plan.block_size * per_token),
                 speculative_config=spec(folder))
    assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


def test_head_kv_is_exact_whole_chunked_and_cached(tmp_path, float32_model, monkeypatch):
    """A random head's drafts depend on every K/V entry it wrote: the same drafts, round
    by round, for a prompt run whole, in chunks of 8, and from the prefix cache."""
    folder = write_head(tmp_path / "random", float32_model.config,
                        random_tensors(float32_model.config, True, seed=5))
    whole, chunked, cached = drafts_whole_chunked_and_cached(float32_model, spec(folder),
                                                            monkeypatch)
    assert len(whole) > 5 and whole == chunked == cached


def test_rows_wait_while_no_drafts_are_asked(tmp_path, float32_model, monkeypatch):
    """While the speculator asks a request for no drafts, the head does not run over its
    rows; they run with the next chunk that asks, in one pass, and that round's drafts
    (and every later one's) are the ones of a head that ran every step: a random head's
    drafts at each position, with and without a wait of 7 tokens."""
    folder = write_head(tmp_path / "random", float32_model.config,
                        random_tensors(float32_model.config, True, seed=5))
    prompt = ("Once upon a time in a quiet village by the sea there lived an old "
              "fisherman who told stories to anyone who would listen.")
    params = SamplingParams(temperature=0, max_tokens=20)

    def drafts_by_position(wait: range) -> tuple[dict[int, list[int]], list[int]]:
        llm = llm_on(float32_model, kv_cache_memory="128MiB", speculative_config=spec(folder))
        speculator = llm.engine.speculator
        asked = speculator.num_drafts

        def num_drafts(request, room, batch_size=1):
            return 0 if request.num_output_tokens in wait else asked(request, room, batch_size)

        monkeypatch.setattr(speculator, "num_drafts", num_drafts)
        proposer = llm.engine.executor.runner.proposer
        propose, run = proposer.propose, proposer._run
        drafts, passes = {}, []

        def recorded(seeds):
            out = propose(seeds)
            for seed, d in zip(seeds, out, strict=True):
                if seed.num_drafts:
                    drafts[seed.start_position + len(seed.hidden)] = d
            return out

        def counted(seqs, ids, features):
            passes.append(len(ids))
            return run(seqs, ids, features)

        monkeypatch.setattr(proposer, "propose", recorded)
        monkeypatch.setattr(proposer, "_run", counted)
        llm.generate([prompt], params, use_tqdm=False)
        return drafts, passes

    every, _ = drafts_by_position(range(0))
    waited, passes = drafts_by_position(range(2, 9))
    after = [p for p in waited if p in every]
    assert len(after) >= 8 and all(waited[p] == every[p] for p in after)
    assert len(waited) == len(every) - 7  # the wait drafted nothing
    assert max(passes[1:]) >= 8  # the 7 waiting rows and the asking chunk's, in one pass


def drafts_whole_chunked_and_cached(loaded, speculative_config: dict, monkeypatch
                                   ) -> tuple[list[list[int]], ...]:
    """The drafts of each round of one greedy request, run whole, then again (from the
    prefix cache), then in an engine computing 8 tokens a step."""
    prompt = ("Once upon a time in a quiet village by the sea there lived an old "
              "fisherman who told stories to anyone who would listen.")

    def drafts_of(options: dict, runs: int = 1) -> list[list[list[int]]]:
        llm = llm_on(loaded, kv_cache_memory="128MiB", speculative_config=speculative_config,
                     **options)
        proposer = llm.engine.executor.runner.proposer
        propose = proposer.propose
        rounds: list[list[int]] = []

        def recorded(seeds):
            drafts = propose(seeds)
            rounds.extend(d for s, d in zip(seeds, drafts, strict=True) if s.num_drafts)
            return drafts

        monkeypatch.setattr(proposer, "propose", recorded)
        out = []
        for _ in range(runs):
            rounds.clear()
            llm.generate([prompt], GREEDY, use_tqdm=False)
            out.append(list(rounds))
        return out

    whole, cached = drafts_of({}, runs=2)
    (chunked,) = drafts_of({"max_num_batched_tokens": 8})
    return whole, chunked, cached


def test_eagle_refusals(tmp_path, float32_model):
    folder = repeat_head(tmp_path / "repeat", float32_model.config)
    with pytest.raises(ValueError, match="does not run with kv_offload"):
        llm_on(float32_model, speculative_config=spec(folder), kv_offload_gib=1)
    with pytest.raises(ValueError, match="no config.json"):
        llm_on(float32_model, speculative_config=spec(tmp_path / "none"))
    # no folder: only a catalog model has a head that ships
    other = SimpleNamespace(source=SimpleNamespace(name="mine.gguf"))
    with pytest.raises(HeadsFormatError, match="a head ships only for smollm2-135m"):
        shipped_eagle_head(other)


@pytest.mark.parametrize("weights", ["float32_model", "default_model"])
def test_the_head_that_ships_drafts_for_the_default_model(request, weights):
    """`{"method": "eagle"}` without a folder: the head `llmserve train-heads` made for the
    default model, shipped in the package (int8, `--compact`), drafts on either path, is
    right often (it was trained, not made up), and the greedy chat answers are the
    target's own."""
    loaded = request.getfixturevalue(weights)
    messages = [[{"role": "user", "content": text}] for text in (
        "Write a short story about a cat who learns to swim.",
        "Explain to a ten year old why the sky is blue.")]
    greedy = SamplingParams(temperature=0, max_tokens=64)
    want = llm_on(loaded, kv_cache_memory="64MiB").chat(messages, greedy, use_tqdm=False)
    llm = llm_on(loaded, kv_cache_memory="64MiB", speculative_config={
        "method": "eagle", "num_speculative_tokens": K, "adaptive": False,
        "disable_by_batch_size": None})
    assert_same(llm.chat(messages, greedy, use_tqdm=False), want)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 20
    assert stats.accepted_per_position[0] / stats.num_drafts > SHIPPED_HEAD_FIRST_KEPT, stats


def test_greedy_equal_under_a_grammar(tmp_path, default_model):
    """A JSON-schema request beside free ones: drafts are cut by the grammar before they
    are verified, and every output is the target's own."""
    folder = repeat_head(tmp_path / "repeat", default_model.config)
    prompts, params = with_a_grammar(PROMPTS)
    want = llm_on(default_model, kv_cache_memory="128MiB").generate(prompts, params,
                                                                     use_tqdm=False)
    llm = llm_on(default_model, kv_cache_memory="128MiB", speculative_config=spec(folder))
    assert_same(llm.generate(prompts, params, use_tqdm=False), want)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


def test_the_head_runs_int8_on_the_native_kernels(tmp_path, float32_model, default_model):
    """The head reads a quarter of its float32 bytes on either path (drafts are only
    proposals); asked, it stays float32 beside a float32 target, equal to the training's
    evaluation; beside a quantized one it is int8 whatever is asked."""
    from llmserve.kernels import native
    from llmserve.quantization.int8 import Int8LinearMethod
    from llmserve.quantization.packed_float import PackedFloatLinearMethod

    folder = write_head(tmp_path / "eagle", float32_model.config,
                        random_tensors(float32_model.config, bias=False))
    if native() is None:
        pytest.skip("no native kernels here: the head stays float")

    def methods(target, **kw):
        head = load_eagle_head(folder, target, torch.device("cpu"), torch.float32, **kw)
        linears = [m for m in head.modules() if hasattr(m, "method")]
        assert len(linears) == 5
        return {type(m.method) for m in linears}

    assert methods(float32_model) == {Int8LinearMethod}
    assert methods(float32_model, int8=False) == {PackedFloatLinearMethod}
    if default_model.quantization is not None:
        assert methods(default_model) == methods(default_model, int8=False) \
            == {Int8LinearMethod}


@pytest.mark.parametrize(("path", "int8"), [("float32", False), ("float32", True),
                                           ("default", True)])
def test_the_head_layer_runs_natively_with_the_per_op_bits(tmp_path, float32_model,
                                                          default_model, path, int8):
    """Beside a target on the native kernels the head's layer runs as one native call (no
    input norm: EAGLE's), giving the per-op path's outputs and K/V bit for bit, whole and
    over the cached K/V."""
    from llmserve.kernels import native

    target = float32_model if path == "float32" else default_model
    cfg = target.config
    folder = write_head(tmp_path / "eagle", cfg, random_tensors(cfg, bias=False))
    head = load_eagle_head(folder, target, torch.device("cpu"), torch.float32, int8=int8)
    if native() is None:
        assert head.native is None
        pytest.skip("no native kernels here")
    assert head.native is not None
    g = torch.Generator().manual_seed(5)
    t = 21
    ids = torch.randint(100, 5000, (t,), generator=g)
    features = torch.randn(t, cfg.hidden_size, generator=g)
    attention = attention_backend(torch.device("cpu"))
    block, table = 16, [list(range(2))]
    runs = {}
    for name, stack in (("native", head.native), ("per op", None)):
        head.native = stack
        cache = KVCache.allocate(cfg.num_hidden_layers + 1, 2, block, cfg.num_key_value_heads,
                                 cfg.head_dim, torch.float32, torch.device("cpu"),
                                 zeroed=True)
        out, start = [], 0
        with torch.inference_mode():
            embeds = target.model.model.embed_tokens(ids).float()
            for n in (13, 1, 7):
                meta = AttentionMetadata.build([n], [start], table, block,
                                               torch.device("cpu"), attention)
                positions = torch.arange(start, start + n)
                assert stack is None or stack.can_run(embeds, positions, cache, meta)
                out.append(head(embeds[start:start + n], features[start:start + n],
                                positions, cache, meta)[0].clone())
                start += n
        runs[name] = (torch.cat(out), cache.key[-1].clone(), cache.value[-1].clone())
    for got, want in zip(runs["native"], runs["per op"], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("weights", ["float32_model", "default_model"])
def test_the_native_chain_drafts_what_the_per_op_chain_drafts(request, weights, monkeypatch):
    """Beside a target on the native kernels, a head with a draft vocabulary (the one that
    ships) drafts in one native call (`NativeEagleChain`), its first pass and its chains:
    batched, cut where the head's own chance along the chain falls below the keep or
    go-on mark, it proposes exactly the per-op chain's drafts, and the output is the
    target's own."""
    from llmserve.kernels import native

    loaded = request.getfixturevalue(weights)
    if native() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setattr(EagleProposer, "min_confidence", 0.15)
    monkeypatch.setattr(EagleProposer, "go_on_confidence", 0.3)
    messages = [[{"role": "user", "content": text}] for text in (
        "Write a short story about a cat who learns to swim.",
        "Explain to a ten year old why the sky is blue.",
        "Name three rivers in Europe.")]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    want = llm_on(loaded, kv_cache_memory="64MiB").chat(messages, greedy, use_tqdm=False)
    runs = {}
    for chain in (True, False):
        monkeypatch.setattr(EagleProposer, "native_chain", chain)
        llm = llm_on(loaded, kv_cache_memory="64MiB", speculative_config={
            "method": "eagle", "num_speculative_tokens": K, "adaptive": False,
            "disable_by_batch_size": None})
        proposer = llm.engine.executor.runner.proposer
        proposed, real = [], proposer.propose

        def recording(seeds, real=real, proposed=proposed):
            drafts = real(seeds)
            proposed.append(drafts)
            return drafts

        proposer.propose = recording
        assert_same(llm.chat(messages, greedy, use_tqdm=False), want)
        assert (proposer._native_chain() is not None) == chain
        runs[chain] = proposed
    assert runs[True] == runs[False]
    chains = [d for step in runs[True] for d in step]
    assert any(len(d) > 1 for d in chains) and any(0 < len(d) < K for d in chains)
    assert any(len(step) > 1 and sum(map(bool, step)) > 1 for step in runs[True])  # batched


def test_the_native_drafting_holds_chunked_cached_and_fed_every_chunk(float32_model,
                                                                      monkeypatch):
    """The native call's first pass writes the head's K/V for every row it is given: the
    shipped head's drafts, round by round, are the per-op path's for a prompt run whole,
    from the prefix cache, in chunks of 8 (the rows of chunks that ask for no drafts
    waiting for the one that does), and in chunks of 8 each fed as it runs (no rows
    waiting: a chunk that drafts nothing still runs its rows)."""
    from llmserve.kernels import native

    if native() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setattr(EagleProposer, "min_confidence", 0.15)
    speculative_config = {"method": "eagle", "num_speculative_tokens": K, "adaptive": False,
                          "disable_by_batch_size": None}
    monkeypatch.setattr(EagleProposer, "native_chain", False)
    per_op, _, _ = drafts_whole_chunked_and_cached(float32_model, speculative_config,
                                                   monkeypatch)
    monkeypatch.setattr(EagleProposer, "native_chain", True)
    native_runs = drafts_whole_chunked_and_cached(float32_model, speculative_config,
                                                  monkeypatch)
    monkeypatch.setattr(EagleProposer, "max_waiting", 0)
    _, fed_every_chunk, _ = drafts_whole_chunked_and_cached(float32_model, speculative_config,
                                                            monkeypatch)
    assert len(per_op) > 5 and any(len(d) > 1 for d in per_op)
    assert all(run == per_op for run in (*native_runs, fed_every_chunk))


def with_a_grammar(prompts: list[str]) -> tuple[list[str], list[SamplingParams]]:
    """`prompts` greedy, and one more under a JSON schema of "ok" words."""
    from llmserve.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"words": {
        "type": "array", "items": {"type": "string", "enum": ["ok"]}, "maxItems": 6}},
        "required": ["words"], "additionalProperties": False}
    params = [GREEDY] * len(prompts) + [SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))]
    return [*prompts, "Give a JSON list of six words, each the word ok:"], params


@pytest.mark.parametrize("cut_by", ["speculator", "proposer"])
@pytest.mark.parametrize(("confidence", "longest"), [(0.7, 2), (0.3, 0)])
def test_a_chain_stops_where_the_head_doubts_it(tmp_path, float32_model, monkeypatch,
                                                confidence, longest, cut_by):
    """A chain keeps a draft while the product of the head's probabilities along it stays
    at or above the cut (0.45 here: 0.7, 0.49 kept, 0.343 not): the speculator's
    `min_chance`, carried to the proposer with each request's step, or the proposer's own
    `min_confidence` where set; output unchanged."""
    folder = repeat_head(tmp_path / "repeat", float32_model.config)
    want = llm_on(float32_model, kv_cache_memory="128MiB").generate(PROMPTS, GREEDY,
                                                                   use_tqdm=False)
    real = EagleProposer._draft

    def doubtful(self, features, cut=True):
        assert cut
        tokens, _ = real(self, features, cut)
        return tokens, [confidence] * len(tokens)

    monkeypatch.setattr(EagleProposer, "_draft", doubtful)
    if cut_by == "speculator":
        monkeypatch.setattr(Speculator, "min_chance", lambda self, request, k, batch=1: 0.45)
        monkeypatch.setattr(Speculator, "keep_chance", lambda self, request, k, batch=1: 0.45)
    else:
        monkeypatch.setattr(EagleProposer, "min_confidence", 0.45)
    llm = llm_on(float32_model, kv_cache_memory="128MiB", speculative_config=spec(folder))
    assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens <= longest * stats.num_drafts
    if longest:
        assert stats.accepted_per_position[longest - 1] > 0
        assert not any(stats.accepted_per_position[longest:])
    else:
        assert stats.num_draft_tokens == 0
