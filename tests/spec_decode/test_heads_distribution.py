"""Sampling through EAGLE, EAGLE-3 and Medusa heads is lossless: on the real default
model, in the engine, the token a verification round emits is distributed as the target's
own next token (temperature 0.8), chi-square over the rounds.

Each head drafts a point mass it always proposes (a draft vocabulary of one token: EAGLE's
and EAGLE-3's `d2t`, Medusa's `token_map` in vLLM's layout), the target's second most
likely token after the prompt and its most likely first answer token, so a round accepts
it some of the time and otherwise draws from the residual: both paths of the rejection
rule run, with the drafts made by the proposer after the forward, scheduled the next step
and verified in a batch. A request's first token is the prefill's (no drafts yet), so the
round's tokens are checked per first token, each group against the target's distribution
after it, and its second token after an accepted draft likewise.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from llmserve import SamplingParams
from llmserve.bench.quality import full_hidden_states
from llmserve.spec_decode.eagle import eagle_head_config
from tests.engines import llm_on
from tests.spec_decode.test_eagle import random_tensors
from tests.spec_decode.test_medusa import write_heads
from tests.spec_decode.test_real_model_distribution import chi_square_critical

TEMPERATURE = 0.8
K = 2


def point_mass_eagle(folder, cfg, token: int):
    folder.mkdir(parents=True, exist_ok=True)
    tensors = random_tensors(cfg, bias=False)
    tensors["d2t"] = torch.tensor([token])  # draft id 0 is target id 0 + token
    tensors["lm_head.weight"] = torch.randn(1, cfg.hidden_size) * 0.05
    (folder / "config.json").write_text(
        json.dumps(eagle_head_config(cfg, draft_vocab_size=1)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def point_mass_eagle3(folder, cfg, token: int):
    from tests.spec_decode.test_eagle3 import eagle3_config, random_eagle3, write_eagle3

    return write_eagle3(folder, eagle3_config(cfg, 1), random_eagle3(cfg, torch.tensor([token])))


def point_mass_medusa(folder, cfg, token: int):
    h = cfg.hidden_size
    tensors = {"token_map": torch.tensor([token]), "lm_heads.0.weight": torch.randn(1, h)}
    for i in range(K):
        tensors[f"blocks.{i}.layers.0.weight"] = torch.randn(h, h) * 0.05
    return write_heads(folder, {"architectures": ["MedusaModel"], "num_heads": K,
                                "num_hidden_layers": 1, "original_lm_head": True,
                                "hidden_size": h, "vocab_size": cfg.vocab_size,
                                "truncated_vocab_size": 1}, tensors)


def target_probs(llm, tokens: list[int]) -> torch.Tensor:
    """The target's next-token distribution after `tokens` at TEMPERATURE (V,), through
    the engine's own runner and weights."""
    hidden = full_hidden_states(llm, tokens)[-1:]
    with torch.inference_mode():
        logits = llm.engine.loaded.model.compute_logits(hidden)[0].double()
    return torch.softmax(logits / TEMPERATURE, -1)


def chi_square(tokens: list[int], p: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()
    expected = p * len(tokens)
    big = expected >= 5  # lump the tail so every cell expects at least 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expect = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expect > 0
    return (float(((observed[keep] - expect[keep]) ** 2 / expect[keep]).sum()),
            int(keep.sum()) - 1)


@pytest.fixture(scope="module")
def plain(default_model):
    return llm_on(default_model, kv_cache_memory="256MiB")


@pytest.mark.parametrize("requests", [300, pytest.param(3000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_sampled_tokens_through_the_heads_follow_the_target(tmp_path, default_model, plain,
                                                            method, requests):
    torch.manual_seed(requests)  # the unseeded requests draw from the global generator
    prompt = plain.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
        tokenize=True)
    likeliest = int(target_probs(plain, prompt).argmax())
    draft = int(target_probs(plain, prompt + [likeliest]).topk(2).indices[1])
    make = {"eagle": point_mass_eagle, "eagle3": point_mass_eagle3,
            "medusa": point_mass_medusa}[method]
    folder = make(tmp_path / method, default_model.config, draft)
    llm = llm_on(default_model, kv_cache_memory="256MiB", speculative_config={
        "method": method, "model": str(folder), "num_speculative_tokens": K,
        "adaptive": False, "disable_by_batch_size": None})
    outs = llm.generate([{"prompt_token_ids": prompt}] * requests,
                        SamplingParams(temperature=TEMPERATURE, max_tokens=2 + K), use_tqdm=False)
    assert sum(o.metrics.num_draft_tokens for o in outs) >= K * len(outs)  # every request
    # a round's first token, per first answer token (each group against its own
    # conditional; the groups are independent, so their chi-squares add up); then its
    # second token where the first was the accepted draft
    groups: dict[tuple[int, ...], list[int]] = {}
    for o in outs:
        t = o.outputs[0].token_ids
        groups.setdefault((t[0],), []).append(t[1])
        if t[1] == draft and len(t) > 2:
            groups.setdefault((t[0], draft), []).append(t[2])
    chi2 = df = counted = accepted = 0
    for before, tokens in groups.items():
        if len(tokens) < 20:
            continue
        c, d = chi_square(tokens, target_probs(plain, prompt + list(before)))
        chi2, df, counted = chi2 + c, df + d, counted + len(tokens)
        accepted += tokens.count(draft) if len(before) == 1 else 0
    print(f"{method}: {counted} of {requests} requests' tokens in groups; chi2 {chi2:.1f} "
          f"over {df} (critical {chi_square_critical(df):.1f}); drafts accepted {accepted}")
    assert counted >= 0.4 * requests and df >= 4 and chi2 < chi_square_critical(df)
    assert 0.05 < accepted / counted < 0.95  # the draft was both accepted and rejected
