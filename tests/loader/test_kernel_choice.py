""""auto" picks the linears' format by timing it against float32, once per machine."""

import json

import pytest

from llmserve.config.model import ModelConfig
from llmserve.loader import kernel_choice
from llmserve.loader.kernel_choice import choose_quantization, pick

TINY = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def test_the_checkpoint_format_when_never_slower_than_float32():
    ms = {"int4": {1: 1.0, 32: 9.0}, "int8": {1: 0.5, 32: 5.0}, "float32": {1: 3.0, 32: 10.0}}
    assert pick(("int4", "int8", None), ms) == "int4"  # its own format first, not the fastest


def test_another_format_or_float32_when_slower_at_a_serving_batch():
    ms = {"int4": {1: 1.0, 32: 12.5}, "int8": {1: 2.0, 32: 9.0}, "float32": {1: 3.0, 32: 10.0}}
    assert pick(("int4", "int8", None), ms) == "int8"
    ms["int4"][32] = 11.5  # within the serving batch's margin of float32: not slower
    assert pick(("int4", "int8", None), ms) == "int4"
    ms["int4"][32] = 12.5
    assert pick(("int4", "int8", None), ms) == "int8"
    ms["int8"][1] = 3.5  # int8 now slower than float32 at batch 1
    assert pick(("int4", "int8", None), ms) is None


def test_8_bit_activations_where_15_bits_cost_int4_its_lead():
    candidates = ("int4", "int4-a8", "int8", None)
    ms = {"int4": {1: 4.0, 32: 18.0}, "int4-a8": {1: 4.0, 32: 12.0},
          "int8": {1: 5.0, 32: 17.0}, "float32": {1: 8.0, 32: 32.0}}
    assert pick(candidates, ms) == "int4"  # 1.78x float32 at batch 32: the 15 bits stay
    ms["int4"][32] = 30.0  # AVX2 without VNNI: about float32's time
    assert pick(candidates, ms) == "int4-a8"
    ms["int4-a8"][32] = 40.0  # and if 8 bits were no better, int8 next
    assert pick(candidates, ms) == "int8"
    # without int4-a8 among the candidates, int4 stays while not slower than float32
    assert pick(("int4", "int8", None), ms) == "int4"
    # where neither 8-bit format holds up, int4 after all, never float32 (this machine's
    # cached timings once made "auto" run float32, 2.7x slower at batch 1)
    ms = {"int4": {1: 16.7, 32: 125.7}, "int4-a8": {1: 11.1, 32: 189.4},
          "int8": {1: 13.0, 32: 218.1}, "float32": {1: 45.2, 32: 139.2}}
    assert pick(candidates, ms) == "int4"
    ms["int4"][32] = 180.0  # slower than float32 at a serving batch: float32
    assert pick(candidates, ms) is None


def test_timed_once_then_read_from_the_cache(tmp_path, monkeypatch, kernel_level):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    first = choose_quantization("int4", TINY)
    assert not first.cached
    assert set(first.ms) == {"int4", "int4-a8", "int8", "float32"}
    assert all(first.ms[name][b] > 0 for name in first.ms for b in (1, 32))
    assert first.quantization == pick(("int4", "int4-a8", "int8", None), first.ms)
    files = list((tmp_path / "kernels").glob("choice-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["ms"]

    def no_timing(*args):
        raise AssertionError("a warm start times nothing")

    monkeypatch.setattr(kernel_choice, "time_candidates", no_timing)
    again = choose_quantization("int4", TINY)
    assert again.cached and again.quantization == first.quantization
    assert again.ms == first.ms
    assert f"auto runs {first.quantization or 'float32'} (cached" in again.describe()


def test_a_corrupt_cache_entry_is_timed_again(tmp_path, monkeypatch, kernel_level):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    choose_quantization("int8", TINY)
    (entry,) = (tmp_path / "kernels").glob("choice-*.json")
    entry.write_text("{not json")
    assert not choose_quantization("int8", TINY).cached


@pytest.mark.parametrize("stored", [None, "int2"])
def test_nothing_to_choose(stored):
    assert choose_quantization(stored, TINY) is None


def test_attention_native_unless_torch_is_faster_at_both_phases():
    from llmserve.loader.kernel_choice import pick_attention

    ms = {"native": {"prefill": 30.0, "decode": 15.0}, "torch": {"prefill": 20.0, "decode": 200.0}}
    assert pick_attention(ms) == "native"  # one backend serves both phases
    ms["torch"]["decode"] = 10.0
    assert pick_attention(ms) == "torch"
    assert pick_attention({"native": ms["native"]}) == "native"  # an int8 cache: native only


def test_attention_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    import torch

    from llmserve.loader.kernel_choice import choose_attention, pick_attention

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    first = choose_attention(TINY, torch.bfloat16)
    assert not first.cached and set(first.ms) == {"native", "torch"}
    assert all(first.ms[b][p] > 0 for b in first.ms for p in ("prefill", "decode"))
    assert first.backend == pick_attention(first.ms)
    int8 = choose_attention(TINY, torch.int8)  # torch cannot read int8 entries
    assert set(int8.ms) == {"native"} and int8.backend == "native"

    def no_timing(*args):
        raise AssertionError("a warm start times nothing")

    monkeypatch.setattr(kernel_choice, "time_attention", no_timing)
    again = choose_attention(TINY, torch.bfloat16)
    assert again.cached and again.backend == first.backend and again.ms == first.ms
    assert f"attention: {first.backend} (cached" in again.describe()


def test_the_engine_runs_the_chosen_backend(tmp_path, monkeypatch, default_model):
    from llmserve import SamplingParams
    from tests.engines import llm_on

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_choice, "pick_attention", lambda ms: "torch")
    llm = llm_on(default_model, kv_cache_memory="32MiB")
    assert llm.engine.attention_backend_name == "torch"
    assert type(llm.engine.attention).__name__ == "TorchBackend"
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
