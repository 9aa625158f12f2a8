"""The compiled model step (`models/compile.py`): same greedy tokens as the eager step and
as `transformers`; `enforce_eager` compiles nothing; a failing compiler falls back to eager.

The suite runs engines eagerly (`LLMSERVE_ENFORCE_EAGER=1` in conftest); these tests lift
that. The float32 model here runs the per-op path (the native GEMM is switched off by
patching `can_pack`), which is what compiles: on CPUs with AVX-512 the default float32
path is the one-call native stack, which never compiles.
"""

import logging

import pytest
import torch

import llmserve.loader.model_loader as model_loader
from llmserve import LLM, SamplingParams
from llmserve.config.model import ModelConfig
from llmserve.layers.attention.backend import AttentionMetadata, TorchBackend
from llmserve.layers.attention.flex import FlexAttentionBackend
from llmserve.layers.attention.native import NativeCPUBackend
from llmserve.layers.kv_cache import KVCache
from llmserve.models import compile as compile_mod
from llmserve.models.compile import CompiledForward, compile_model, is_compiled
from llmserve.models.llama import LlamaForCausalLM
from tests.models.test_llama_reference import (
    CHAT,
    LOGIT_TOLERANCE,
    PROMPTS,
    full_logits,
    reference_greedy,
)

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def per_op_float32():
    """float32 weights on torch's matmul (no packing for the native GEMM), compile allowed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_loader, "can_pack", lambda model, dtype: False)
        mp.delenv("LLMSERVE_ENFORCE_EAGER", raising=False)
        yield mp


@pytest.fixture(scope="module")
def compiled_llm(per_op_float32, smollm2_gguf):
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    llm = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory="256MiB")
    assert is_compiled(llm.engine.loaded.model), "the float32 per-op step did not compile"
    # one decoder layer compiled for all 30 (no graph per layer)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
    return llm


@pytest.fixture(scope="module")
def eager_llm(per_op_float32, smollm2_gguf):
    """The same per-op float32 model with `enforce_eager`: torch.compile is never called."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", lambda *a, **k: calls.append(a) or a[0])
        llm = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory="256MiB",
                  enforce_eager=True)
    assert not is_compiled(llm.engine.loaded.model)
    assert calls == []
    return llm


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The first prompt alone, the others as one batch (prefill and decode mixed)."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params,
                         use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# the real model compiled (a cold inductor compile of ~20 s, then the model per-op) is
# slow-tier: the default CPU paths never compile; the compiled graph's pieces are checked on
# a tiny model below in the default tier
@pytest.mark.slow
def test_compiled_greedy_matches_reference(compiled_llm, reference_model):
    tokenizer = compiled_llm.tokenizer
    prompts = [tokenizer.apply_chat_template(p, tokenize=True) for p in PROMPTS]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _greedy(compiled_llm, prompts)
    # the warm-up's graph served every layer, decode (T == 1), prefill and mixed steps
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "recompiled"
    reference = [reference_greedy(reference_model, p, NUM_TOKENS, draft=c)
                 for p, c in zip(prompts, compiled, strict=True)]
    for i, (c, r) in enumerate(zip(compiled, reference, strict=True)):
        assert c == r, f"prompt {i}: compiled {c} != transformers {r}"
    assert is_compiled(compiled_llm.engine.loaded.model)  # no fallback happened on the way


@pytest.mark.slow
def test_compiled_greedy_matches_eager(compiled_llm, eager_llm):
    tokenizer = compiled_llm.tokenizer
    prompts = [tokenizer.apply_chat_template(p, tokenize=True) for p in PROMPTS]
    compiled, eager = _greedy(compiled_llm, prompts), _greedy(eager_llm, prompts)
    for i, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        assert c == e, f"prompt {i}: compiled {c} != eager {e}"


@pytest.mark.slow
def test_compiled_logits_match_reference(compiled_llm, reference_model):
    ids = compiled_llm.tokenizer.apply_chat_template(CHAT, tokenize=True)[:64]
    ours = full_logits(compiled_llm.engine.loaded.model, ids)
    with torch.inference_mode():
        ref = reference_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"compiled step: max |logit diff| vs transformers over 64 positions = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _tiny_model() -> LlamaForCausalLM:
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model.eval()


def _step(model: LlamaForCausalLM, backend=None) -> tuple:
    cfg = model.config
    kv = KVCache.allocate(cfg.num_hidden_layers, 4, 16, cfg.num_key_value_heads, cfg.head_dim,
                          torch.float32)
    meta = AttentionMetadata.build([5, 1], [0, 3], [[0], [1]], 16, backend=backend)
    return torch.arange(6) % 64, torch.tensor([0, 1, 2, 3, 4, 3]), kv, meta


def test_enforce_eager_compiles_nothing(monkeypatch):
    """Here on a tiny model; the `eager_llm` fixture checks an engine's load too."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a) or a[0])
    assert not compile_model(_tiny_model(), "cpu", None, enforce_eager=True)
    assert calls == []


def test_quantized_or_native_stack_compiles_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a) or a[0])
    monkeypatch.delenv("LLMSERVE_ENFORCE_EAGER", raising=False)
    assert not compile_model(_tiny_model(), "cpu", "int8")
    model = _tiny_model()
    model.native_layers = object()  # the one-call native stack took the model
    assert not compile_model(model, "cpu", None)
    assert calls == []


def test_compiler_failure_falls_back_to_eager(monkeypatch, caplog):
    """torch.compile raising at once, or when the compiled step first runs: eager, one
    warning, the same output."""
    monkeypatch.delenv("LLMSERVE_ENFORCE_EAGER", raising=False)
    model = _tiny_model()
    with torch.inference_mode():
        expected = model(*_step(model))

    def broken_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger=compile_mod.__name__):
        assert not compile_model(model, "cpu", None)
    assert not is_compiled(model)
    assert "no compiler here" in caplog.text

    def compile_failing_at_run(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("inductor failed")
        return run

    monkeypatch.setattr(torch, "compile", compile_failing_at_run)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=compile_mod.__name__):
        assert compile_model(model, "cpu", None)
        with torch.inference_mode():
            first = model(*_step(model))
            second = model(*_step(model))
    assert isinstance(model.compiled_layers, CompiledForward) and model.compiled_layers.failed
    assert not is_compiled(model)
    assert caplog.text.count("inductor failed") == 1
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)


def eager_flex() -> FlexAttentionBackend:
    return FlexAttentionBackend(compiled=False)


@pytest.mark.parametrize("backend", [TorchBackend, NativeCPUBackend, eager_flex])
def test_attention_ops_under_compile_match_eager(backend):
    """The backends' custom ops (cache write + attention) inside a compiled graph give the
    eager step's hidden states and cache contents, with no graph break (flex: its algorithm
    uncompiled, on the CPU; the compiled kernel was checked on CUDA)."""
    if backend is NativeCPUBackend and compile_mod.missing_compiler(torch.device("cpu")):
        pytest.skip("no C++ compiler")
    model = _tiny_model()
    args = _step(model, backend())
    eager_args = _step(model, backend())
    with torch.inference_mode():
        expected = model(*eager_args)
        compiled = torch.compile(model.forward, dynamic=True, fullgraph=True,
                                 backend="aot_eager")
        got = compiled(*args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(args[2].key + args[2].value, eager_args[2].key + eager_args[2].value,
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
