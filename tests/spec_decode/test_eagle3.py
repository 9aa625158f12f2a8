"""EAGLE-3 heads: a tiny random head in the published layout (`midlayer.*`, `fc` over three
target layers' hidden states, its own `norm`, `lm_head`, `d2t` and `t2d`; also vLLM's
`model.layers.0.*`) loads and its forward over the paged KV cache, whole and in chunks,
equals a reference written as EAGLE-3's code defines the head; the target's taps (the
hidden states entering the named layers) equal transformers' `hidden_states` on the exact
path and the per-op stack's on the default path, where the native stack runs in pieces; a
head that does not fit is refused by name. In the engine, on the real default model,
greedy output with EAGLE-3 drafts is the target's own on the exact and default paths,
batched, chunked and prefix-cached, with drafts accepted (a head whose draft vocabulary
is one token proposes it always: a run of it is accepted whole).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmserve import SamplingParams
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.spec_decode.eagle import eagle_head_config, load_eagle_head
from llmserve.spec_decode.medusa import HeadsFormatError
from tests.engines import llm_on
from tests.spec_decode.test_eagle import drafts_whole_chunked_and_cached, with_a_grammar

K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=24)
PROMPTS = [
    "Write the word ok twenty times, separated by spaces: ok ok ok ok",
    "The capital of France is",
    "List three fruits:",
    "The old lighthouse stood on the rocks above the harbour, and every night its keeper "
    "climbed the narrow stairs to light the lamp. Ships passing in the dark saw the beam "
    "sweep across the water and knew the coast was near. Repeat after me: ok ok ok ok",
]


def eagle3_config(cfg, draft_vocab_size: int, layer_ids=None) -> dict:
    config = eagle_head_config(cfg, draft_vocab_size=draft_vocab_size)
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids,
                                  "use_aux_hidden_state": True}
    return config


def random_eagle3(cfg, draft_ids: torch.Tensor, seed: int = 0, aux: int = 3,
                  prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {"fc.weight": w(h, aux * h), "norm.weight": 1 + w(h),
               "lm_head.weight": w(len(draft_ids), h),
               "d2t": draft_ids - torch.arange(len(draft_ids)),
               "t2d": torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids,
                                                                                True)}
    layer = {"self_attn.q_proj.weight": w(q, 2 * h), "self_attn.k_proj.weight": w(kv, 2 * h),
             "self_attn.v_proj.weight": w(kv, 2 * h), "self_attn.o_proj.weight": w(h, q),
             "mlp.gate_proj.weight": w(i, h), "mlp.up_proj.weight": w(i, h),
             "mlp.down_proj.weight": w(h, i), "input_layernorm.weight": 1 + w(h),
             "hidden_norm.weight": 1 + w(h), "post_attention_layernorm.weight": 1 + w(h)}
    tensors |= {prefix + k: v for k, v in layer.items()}
    return tensors


def write_eagle3(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_forward(tensors: dict, cfg, embeds: torch.Tensor, aux: torch.Tensor):
    """EAGLE-3's head over one whole sequence, as its code writes it: fc over the
    target's hidden states; attention over [input_layernorm(embedding),
    hidden_norm(feature)] with the feature as residual; the MLP; the final norm. Returns
    (the logits over the draft vocabulary, the pre-norm features)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    t = {k.removeprefix("midlayer."): v for k, v in tensors.items()}
    eps, nh, nkv, d = (cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.head_dim)
    n = embeds.shape[0]
    with torch.no_grad():
        hidden = aux @ t["fc.weight"].T
        x = torch.cat([rms(embeds, t["input_layernorm.weight"], eps),
                       rms(hidden, t["hidden_norm.weight"], eps)], dim=-1)
        q = (x @ t["self_attn.q_proj.weight"].T).view(n, nh, d).transpose(0, 1)[None]
        k = (x @ t["self_attn.k_proj.weight"].T).view(n, nkv, d).transpose(0, 1)[None]
        v = (x @ t["self_attn.v_proj.weight"].T).view(n, nkv, d).transpose(0, 1)[None]
        hf = LlamaConfig(**{k: v for k, v in eagle_head_config(cfg).items()
                            if k not in ("architectures", "model_type")})
        cos, sin = LlamaRotaryEmbedding(hf)(x[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = (z.repeat_interleave(nh // nkv, dim=1) for z in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
        h = hidden + attn.transpose(0, 1).reshape(n, nh * d) @ t["self_attn.o_proj.weight"].T
        m = rms(h, t["post_attention_layernorm.weight"], eps)
        h = h + (F.silu(m @ t["mlp.gate_proj.weight"].T) * (m @ t["mlp.up_proj.weight"].T)) \
            @ t["mlp.down_proj.weight"].T
        return rms(h, t["norm.weight"], eps) @ t["lm_head.weight"].T, h


@pytest.mark.parametrize("prefix", ["midlayer.", "model.layers.0."])
def test_head_over_the_paged_cache_equals_the_reference(tmp_path, float32_model, prefix):
    cfg = float32_model.config
    draft_ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(1))[:300]
    tensors = random_eagle3(cfg, draft_ids, prefix=prefix)
    folder = write_eagle3(tmp_path / "eagle3", eagle3_config(cfg, 300, [1, 10, 20]), tensors)
    head = load_eagle_head(folder, float32_model, torch.device("cpu"), torch.float32, True,
                           int8=False)
    assert head.aux_layers == (1, 10, 20) and head.first_layer == cfg.num_hidden_layers
    assert torch.equal(head.draft_ids, draft_ids)
    t = 37
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(100, 5000, (t,), generator=g)
    aux = torch.randn(t, 3 * cfg.hidden_size, generator=g)
    embeds = float32_model.model.model.embed_tokens(ids)
    plain = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v
             for k, v in tensors.items()}
    want_logits, want_features = reference_forward(plain, cfg, embeds, aux)
    attention = attention_backend(torch.device("cpu"))
    block, table = 16, [list(range(3))]
    for chunks in ([t], [8, 16, 13]):  # whole, and in chunks over the cached K/V
        cache = KVCache.allocate(cfg.num_hidden_layers + 1, 4, block, cfg.num_key_value_heads,
                                 cfg.head_dim, torch.float32, torch.device("cpu"),
                                 zeroed=True)
        rows, features, start = [], [], 0
        with torch.inference_mode():
            for n in chunks:
                meta = AttentionMetadata.build([n], [start], table, block,
                                               torch.device("cpu"), attention)
                r, f = head(embeds[start:start + n], aux[start:start + n],
                            torch.arange(start, start + n), cache, meta)
                rows.append(head.lm_head(r))
                features.append(f)
                start += n
        assert (torch.cat(rows) - want_logits).abs().max() < 2e-5
        assert (torch.cat(features) - want_features).abs().max() < 2e-5


def test_the_targets_taps_are_the_hidden_states_entering_the_layers(float32_model,
                                                                     default_model,
                                                                     reference_model):
    """Exact path: transformers' hidden_states[i] (what enters layer i); default path:
    the native stack run in pieces gives the per-op path's bits."""
    layers = (2, 15, 27)
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 2634, 30, 198, 504, 3458])
    with torch.no_grad():
        states = reference_model(ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in layers], dim=-1)
    got = {}
    for name, loaded in (("exact", float32_model), ("default", default_model)):
        model = loaded.model
        cfg = loaded.config
        for native in (True, False):
            saved = model.native_layers
            if not native:
                model.native_layers = None
            try:
                got[name, native] = _taps(model, cfg, ids, layers)
            finally:
                model.native_layers = saved
    # the residual stream runs to a few hundred in some channels: relative
    torch.testing.assert_close(got["exact", True], want, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got["exact", False], want, rtol=1e-4, atol=1e-3)
    assert torch.equal(got["default", True], got["default", False])


def _taps(model, cfg, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    attention = attention_backend(torch.device("cpu"))
    cache = KVCache.allocate(cfg.num_hidden_layers, 2, 16, cfg.num_key_value_heads,
                             cfg.head_dim, torch.float32, torch.device("cpu"), zeroed=True)
    meta = AttentionMetadata.build([len(ids)], [0], [[0]], 16, torch.device("cpu"), attention)
    model.aux_layers = layers
    try:
        with torch.inference_mode():
            final = model(ids, torch.arange(len(ids)), cache, meta)
        assert final.shape == (len(ids), cfg.hidden_size)
        return model.aux_hidden.clone()
    finally:
        model.aux_layers, model.aux_hidden = (), None


@pytest.mark.parametrize(("change", "message"), [
    (lambda c, t: c.update(num_hidden_layers=2), "an EAGLE-3 head has one decoder layer"),
    (lambda c, t: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 40, 2]}),
     "must be distinct layers of the target's 30"),
    (lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[3, 3, 4]),
     "must be distinct layers"),
    (lambda c, t: c.update(target_hidden_size=4096), "target_hidden_size 4096 does not fit"),
    (lambda c, t: t.pop("midlayer.hidden_norm.weight"), "missing head weights"),
    (lambda c, t: t.update({"fc.weight": torch.zeros(576, 2 * 576)}), "fc.weight has shape"),
    (lambda c, t: t.pop("d2t"), "needs 'd2t'"),
])
def test_heads_that_do_not_fit_are_refused_by_name(tmp_path, float32_model, change, message):
    cfg = float32_model.config
    config = eagle3_config(cfg, 50)
    tensors = random_eagle3(cfg, torch.arange(100, 150))
    change(config, tensors)
    folder = write_eagle3(tmp_path / "bad", config, tensors)
    with pytest.raises(HeadsFormatError, match=message):
        load_eagle_head(folder, float32_model, torch.device("cpu"), torch.float32, True)


def ok_head(folder: Path, loaded, tokenizer) -> Path:
    """A random head whose draft vocabulary is the one token " ok": it always drafts it."""
    ok = tokenizer.encode(" ok", add_special_tokens=False)
    assert len(ok) == 1
    tensors = random_eagle3(loaded.config, torch.tensor(ok))
    return write_eagle3(folder, eagle3_config(loaded.config, 1), tensors)


def spec(folder: Path, **options) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K,
            "adaptive": False, "disable_by_batch_size": None} | options


@pytest.mark.parametrize("path", ["float32", "default"])
def test_greedy_output_with_eagle3_equals_the_targets(tmp_path, float32_model, default_model,
                                                      path):
    loaded = float32_model if path == "float32" else default_model
    plain = llm_on(loaded, kv_cache_memory="128MiB")
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    folder = ok_head(tmp_path / "ok", loaded, plain.tokenizer)
    for options in ({}, {"max_num_batched_tokens": 8}):
        llm = llm_on(loaded, kv_cache_memory="128MiB", speculative_config=spec(folder),
                     **options)
        assert llm.engine.executor.runner.aux_layers == (2, 15, 27)  # default, 30 layers
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        stats = llm.engine.speculator.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # prefix-cache hits
        assert [o.outputs[0].token_ids for o in again] == want
        assert any(o.num_cached_tokens for o in again)
    # the engine without a head, on the same loaded model, taps nothing
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)] \
        == want
    assert loaded.model.aux_layers == ()


def test_drafts_are_the_same_whole_chunked_and_cached(tmp_path, float32_model, monkeypatch):
    """A random head's drafts depend on every tap and K/V entry it read: the same drafts,
    round by round, for a prompt run whole, in chunks of 8, and from the prefix cache."""
    cfg = float32_model.config
    draft_ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(2))[:500]
    folder = write_eagle3(tmp_path / "random", eagle3_config(cfg, 500),
                          random_eagle3(cfg, draft_ids, seed=5))
    whole, chunked, cached = drafts_whole_chunked_and_cached(float32_model, spec(folder),
                                                            monkeypatch)
    assert len(whole) > 3 and whole == chunked == cached


def test_greedy_equal_under_a_grammar(tmp_path, default_model):
    prompts, params = with_a_grammar(PROMPTS)
    plain = llm_on(default_model, kv_cache_memory="128MiB")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    folder = ok_head(tmp_path / "ok", default_model, plain.tokenizer)
    llm = llm_on(default_model, kv_cache_memory="128MiB", speculative_config=spec(folder))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
