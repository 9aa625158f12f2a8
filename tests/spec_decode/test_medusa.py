"""Medusa heads: tiny random heads in both public layouts load and give the logits of a
reference implementation of Medusa-1's heads (written here as Medusa's own code defines
them); a checkpoint that does not fit the target is refused by name; and in the engine,
on the real default model, greedy output with Medusa drafts is the output without them,
on the exact and default paths, batched, chunked, prefix-cached, preempted and under a
grammar, with drafts accepted.

Heads that are accepted without training: blocks of zeros (the residual passes the
hidden state through) on the target's own LM head propose the token just sampled again,
at every place, so a run of repeated tokens is accepted whole.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from llmserve import SamplingParams
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.spec_decode.medusa import HeadsFormatError, MedusaProposer, load_medusa_heads
from llmserve.worker.drafts import DraftSeed
from tests.engines import llm_on

NUM_HEADS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=24)


class ResBlock(nn.Module):
    """Medusa's residual block: x + SiLU(Linear(x)), the linear with a bias."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def reference_heads(hidden: int, vocab: int, num_heads: int, num_layers: int) -> nn.ModuleList:
    """Medusa-1's heads: per head, `num_layers` residual blocks and an LM head."""
    torch.manual_seed(0)
    heads = nn.ModuleList(
        nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                      nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads))
    for p in heads.parameters():
        nn.init.normal_(p, std=0.05)
    return heads


def write_heads(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    name = "model.safetensors" if "num_heads" in config else "medusa_lm_head.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    return folder


def repeat_heads(folder: Path, hidden: int, num_heads: int = NUM_HEADS) -> Path:
    """Zero blocks on the target's LM head: every head proposes the token just sampled."""
    tensors = {}
    for i in range(num_heads):
        tensors[f"blocks.{i}.layers.0.weight"] = torch.zeros(hidden, hidden)
    return write_heads(folder, {"architectures": ["MedusaModel"], "num_heads": num_heads,
                                "num_hidden_layers": 1, "original_lm_head": True,
                                "hidden_size": hidden}, tensors)


@pytest.fixture(scope="module")
def hidden_rows(default_model) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(5, default_model.config.hidden_size)


# ---- the heads against a reference ------------------------------------------------------------


def test_medusa_layout_equals_the_reference_heads(tmp_path, default_model, hidden_rows):
    cfg = default_model.config
    ref = reference_heads(cfg.hidden_size, cfg.vocab_size, NUM_HEADS, 1)
    folder = write_heads(tmp_path / "medusa", {
        "medusa_num_heads": NUM_HEADS, "medusa_num_layers": 1,
        "base_model_name_or_path": "the target"}, ref.state_dict())
    heads = load_medusa_heads(folder, default_model, torch.device("cpu"))
    with torch.inference_mode():
        for i in range(NUM_HEADS):
            want = ref[i](hidden_rows)
            got = heads.logits(i, hidden_rows)
            assert (got - want).abs().max() < 1e-5
            assert heads.propose(i, hidden_rows) == want.argmax(-1).tolist()


def test_vllm_layout_with_two_blocks_and_a_truncated_vocabulary(tmp_path, default_model,
                                                                hidden_rows):
    cfg = default_model.config
    hidden, rows = cfg.hidden_size, 1000
    torch.manual_seed(2)
    blocks = [[(torch.randn(hidden, hidden) * 0.05, torch.randn(hidden) * 0.05)
               for _ in range(2)] for _ in range(NUM_HEADS)]
    head = torch.randn(rows, hidden) * 0.05  # one LM head shared by the heads
    token_map = torch.randperm(cfg.vocab_size)[:rows]
    tensors = {"token_map": token_map, "lm_heads.0.weight": head}
    for i, stack in enumerate(blocks):
        for j, (w, b) in enumerate(stack):
            tensors[f"medusa_heads.blocks.{i}.layers.{j}.weight"] = w
            tensors[f"medusa_heads.blocks.{i}.layers.{j}.bias"] = b
    folder = write_heads(tmp_path / "vllm", {
        "architectures": ["MedusaModel"], "num_heads": NUM_HEADS, "num_hidden_layers": 2,
        "medusa_fc_bias": True, "original_lm_head": True, "hidden_size": hidden,
        "vocab_size": cfg.vocab_size, "truncated_vocab_size": rows}, tensors)
    heads = load_medusa_heads(folder, default_model, torch.device("cpu"))
    with torch.inference_mode():
        for i, stack in enumerate(blocks):
            x = hidden_rows
            for w, b in stack:
                x = x + torch.nn.functional.silu(x @ w.T + b)
            small = x @ head.T  # (N, rows)
            got = heads.logits(i, hidden_rows)
            assert torch.isinf(got).sum(-1).tolist() == [cfg.vocab_size - rows] * 5
            assert (got[:, token_map] - small).abs().max() < 1e-5
            assert heads.propose(i, hidden_rows) == token_map[small.argmax(-1)].tolist()


def test_shared_target_head(tmp_path, default_model, hidden_rows):
    """original_lm_head with no LM head in the file: the target's own (quantized) head."""
    heads = load_medusa_heads(repeat_heads(tmp_path / "repeat", default_model.config.hidden_size),
                              default_model, torch.device("cpu"))
    with torch.inference_mode():
        want = default_model.model.compute_logits(hidden_rows)
        assert torch.equal(heads.logits(2, hidden_rows), want)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c, t: c.update(hidden_size=7), "hidden_size 7 does not fit"),
    (lambda c, t: t.pop("2.0.linear.bias"), "missing head weights"),
    (lambda c, t: t.update(extra=torch.zeros(1)), "unexpected tensor 'extra'"),
    (lambda c, t: t.update({"1.1.weight": torch.zeros(3, 3)}), "has shape"),
    (lambda c, t: c.pop("medusa_num_heads"), "names its heads"),
])
def test_heads_that_do_not_fit_are_refused_by_name(tmp_path, default_model, change, message):
    cfg = default_model.config
    config = {"medusa_num_heads": NUM_HEADS, "medusa_num_layers": 1}
    tensors = dict(reference_heads(cfg.hidden_size, cfg.vocab_size, NUM_HEADS, 1).state_dict())
    change(config, tensors)
    folder = write_heads(tmp_path / "bad", config, tensors)
    with pytest.raises(HeadsFormatError, match=message):
        load_medusa_heads(folder, default_model, torch.device("cpu"))


def test_pickled_heads_are_refused_naming_safetensors(tmp_path, default_model):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"not read")
    with pytest.raises(HeadsFormatError, match="only safetensors are read"):
        load_medusa_heads(tmp_path, default_model, torch.device("cpu"))


def test_proposer_drafts_each_head_from_the_last_verified_row(tmp_path, default_model,
                                                             hidden_rows):
    cfg = default_model.config
    ref = reference_heads(cfg.hidden_size, cfg.vocab_size, NUM_HEADS, 1)
    folder = write_heads(tmp_path / "m", {"medusa_num_heads": NUM_HEADS}, ref.state_dict())
    proposer = MedusaProposer(load_medusa_heads(folder, default_model, torch.device("cpu")),
                              torch.device("cpu"), torch.float32)
    seeds = [DraftSeed("a", [1, 2], 3, hidden_rows[:2]), DraftSeed("b", [1], 1, hidden_rows[2:5])]
    with torch.inference_mode():
        want_a = [int(ref[i](hidden_rows[1]).argmax()) for i in range(3)]
        want_b = [int(ref[0](hidden_rows[4]).argmax())]
    assert proposer.propose(seeds) == [want_a, want_b]
    assert proposer.step_seconds(4) > 0


# ---- in the engine ------------------------------------------------------------------------------


def spec(folder: Path, **options) -> dict:
    return {"method": "medusa", "model": str(folder), "num_speculative_tokens": NUM_HEADS,
            "adaptive": False, "disable_by_batch_size": None} | options


PROMPTS = [
    "Write the word ok twenty times, separated by spaces: ok ok ok ok",
    "Count: 1 1 1 1 1 1 1 1 1 1",
    "The capital of France is",
    "List three fruits:",
]


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def check_seeds(llm, monkeypatch) -> list:
    """Every seed the runner hands the heads: its last hidden row is the one whose logits
    gave the token it just sampled (greedy: their argmax), one row per verified token."""
    proposer = llm.engine.executor.runner.proposer
    propose, model, seen = proposer.propose, llm.engine.loaded.model, []

    def checked(seeds):
        for seed in seeds:
            with torch.inference_mode():
                logits = model.compute_logits(seed.hidden[-1:])
            assert int(logits.argmax()) == seed.token_ids[-1]
            seen.append(len(seed.hidden))
        return propose(seeds)

    monkeypatch.setattr(proposer, "propose", checked)
    return seen


@pytest.mark.parametrize("weights", ["float32_model", "default_model"])
def test_greedy_output_is_the_target_own_with_medusa_drafts(request, tmp_path, weights,
                                                            monkeypatch):
    loaded = request.getfixturevalue(weights)
    folder = repeat_heads(tmp_path / "repeat", loaded.config.hidden_size)
    plain = llm_on(loaded, kv_cache_memory="128MiB")
    want = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    # batched, and in chunks of 8 prompt tokens
    for options in ({}, {"max_num_batched_tokens": 8}):
        llm = llm_on(loaded, kv_cache_memory="128MiB", speculative_config=spec(folder),
                     **options)
        seen = check_seeds(llm, monkeypatch)
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        # a prompt's last chunk brings its rows, a decode its token's and accepted drafts'
        assert max(seen) > NUM_HEADS and 1 in seen
        assert_same(got, want)
        stats = llm.engine.speculator.stats
        assert stats.num_accepted_tokens > 0 and stats.accepted_per_position[-1] > 0
        # the prefix cache: the same prompts again hit their blocks, the same output
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_same(again, want)
        assert any(o.num_cached_tokens for o in again)


def test_greedy_equal_with_preemption_and_a_grammar(tmp_path, float32_model):
    folder = repeat_heads(tmp_path / "repeat", float32_model.config.hidden_size)
    schema = {"type": "object", "properties": {"words": {
        "type": "array", "items": {"type": "string", "enum": ["ok"]}, "maxItems": 6}},
        "required": ["words"], "additionalProperties": False}
    params = [GREEDY] * len(PROMPTS) + [SamplingParams(
        temperature=0, max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=schema))]
    prompts = [*PROMPTS, "Give a JSON list of six words, each the word ok:"]
    plain = llm_on(float32_model, kv_cache_memory="128MiB")
    want = plain.generate(prompts, params, use_tqdm=False)
    # a cache of 8 blocks for 5 requests: they preempt one another
    block = plain.engine.kv_plan.block_size
    per_token = plain.engine.kv_plan.total_bytes // plain.engine.kv_plan.num_tokens
    llm = llm_on(float32_model, kv_cache_memory=str(8 * block * per_token),
                 speculative_config=spec(folder))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, want)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


def test_medusa_config_refusals(tmp_path, float32_model):
    folder = repeat_heads(tmp_path / "repeat", float32_model.config.hidden_size, num_heads=2)
    with pytest.raises(ValueError, match="more than the 2 Medusa heads"):
        llm_on(float32_model, speculative_config=spec(folder, num_speculative_tokens=3))
    with pytest.raises(ValueError, match="no config.json"):
        llm_on(float32_model, speculative_config=spec(tmp_path / "none"))
