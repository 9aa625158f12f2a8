"""The attention backend: native unless torch is faster at both phases in every round, once
per machine; a busy machine keeps native and caches nothing."""

import torch

from llmserve.loader import attention_choice, decision_cache
from llmserve.loader.attention_choice import choose_attention, pick_attention
from llmserve.loader.quiet_timing import Timing
from tests.loader.test_kernel_choice import TINY, decisions_in, machine


def test_native_unless_torch_is_faster_at_both_phases_in_every_round():
    ms = {"native": {"prefill": 30.0, "decode": 15.0}, "torch": {"prefill": 20.0, "decode": 200.0}}
    assert pick_attention(Timing([ms])) == "native"  # one backend serves both phases
    fast = {**ms, "torch": {"prefill": 20.0, "decode": 10.0}}
    assert pick_attention(Timing([fast, fast])) == "torch"
    assert pick_attention(Timing([fast, ms])) == "native"  # not in every round
    assert pick_attention(Timing([{"native": ms["native"]}])) == "native"  # an int8 cache


def test_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    decisions_in(monkeypatch, tmp_path)
    machine(monkeypatch, 0.1)
    first = choose_attention(TINY, torch.bfloat16)
    assert first.source == "measured" and set(first.ms) == {"native", "torch"}
    assert all(first.ms[b][p] > 0 for b in first.ms for p in ("prefill", "decode"))
    int8 = choose_attention(TINY, torch.int8)  # torch cannot read int8 entries
    assert set(int8.ms) == {"native"} and int8.backend == "native"

    def no_timing(*args):
        raise AssertionError("a warm start times nothing")

    monkeypatch.setattr(attention_choice, "time_attention", no_timing)
    again = choose_attention(TINY, torch.bfloat16)
    assert again.cached and again.backend == first.backend and again.ms == first.ms
    assert f"attention: {first.backend} (cached" in again.describe()


def test_a_busy_machine_keeps_native_and_caches_nothing(tmp_path, monkeypatch):
    decisions_in(monkeypatch, tmp_path)
    monkeypatch.setattr(decision_cache, "_BUSY_HERE", {})
    monkeypatch.setattr(attention_choice, "pick_attention", lambda timing: "torch")
    machine(monkeypatch, 1.5)
    choice = choose_attention(TINY, torch.bfloat16)
    assert choice.backend == "native" and choice.source == "busy"
    assert ("attention: native (the default: the machine was busy while timing (others used "
            "1.5 of 2 cores); not cached, a quiet start decides; ms ") in choice.describe()
    assert not list(tmp_path.rglob("attention-*.json"))
    assert choose_attention(TINY, torch.bfloat16) is choice  # for the rest of the process


def test_the_engine_runs_the_chosen_backend(tmp_path, monkeypatch, default_model):
    from llmserve import SamplingParams
    from tests.engines import llm_on

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    machine(monkeypatch, 0.1)
    monkeypatch.setattr(attention_choice, "pick_attention", lambda timing: "torch")
    llm = llm_on(default_model, kv_cache_memory="32MiB")
    assert llm.engine.attention_backend_name == "torch"
    assert type(llm.engine.attention).__name__ == "TorchBackend"
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
