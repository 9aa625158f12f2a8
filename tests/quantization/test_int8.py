"""The int8 (W8A8) path: close to the reference, and still batch invariant (exactly)."""

import pytest
import torch
import torch.nn.functional as F

from llmserve import LLM, SamplingParams
from llmserve.kernels import native
from llmserve.quantization.int8 import (
    PackedInt8Weight,
    _int8_linear_torch,
    int8_linear,
)
from tests.engines import llm_on
from tests.models.test_llama_reference import (
    CHAT,
    PROMPTS,
    first_divergence_gap,
    full_logits,
    reference_greedy,
)


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    weight = torch.randn(300, 250) * 0.05  # neither dimension a multiple of the tiles
    x = torch.randn(16, 250)
    x[:, 3] *= 40  # an outlier channel, as in real residual streams
    ours = int8_linear(x, PackedInt8Weight(weight))
    ref = F.linear(x, weight)
    assert (ours - ref).abs().max() <= 0.01 * ref.abs().max()


def test_int8_linear_rows_do_not_depend_on_the_batch(kernel_level):
    torch.manual_seed(1)
    weight = PackedInt8Weight(torch.randn(64, 128))
    x = torch.randn(40, 128)  # more rows than the fused kernel takes: the oneDNN path
    together = int8_linear(x, weight)
    for i in range(40):
        assert torch.equal(int8_linear(x[i : i + 1], weight)[0], together[i])


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
def test_int8_kernels_agree_bit_for_bit(rows, kernel_level):
    """The native kernel (at every level) and the plain torch ops compute the same numbers."""
    lib = native()
    assert lib is not None, "the native kernels must build on the CPU test machines"
    torch.manual_seed(rows)
    weight = torch.randn(90, 200) * 0.1  # 90 channels: a partial block of 16
    vnni, plain = PackedInt8Weight(weight), PackedInt8Weight(weight, layout="plain")
    assert vnni.layout == "vnni"
    bias = torch.randn(90)
    x = torch.randn(rows, 200)
    x[:, 7] *= 30
    assert torch.equal(int8_linear(x, vnni, bias), _int8_linear_torch(x, plain, bias))
    ids = torch.tensor([0, 17, 89, 42])
    assert torch.equal(vnni.rows(ids), plain.rows(ids))
    # the embedding lookup (a native gather for the packed layout) dequantizes the same way
    assert torch.equal(vnni.embedding_rows(ids), plain.embedding_rows(ids))


def test_int8_embedding_refuses_an_id_outside_the_table():
    table = PackedInt8Weight(torch.randn(90, 200))
    for bad in (90, -1) if table.layout == "vnni" else (90,):  # torch's index wraps -1
        with pytest.raises(IndexError):
            table.embedding_rows(torch.tensor([3, bad]))
    assert table.embedding_rows(torch.tensor([], dtype=torch.long)).shape == (0, 200)


@pytest.fixture(scope="module")
def int8_llm(int8_model) -> LLM:
    return llm_on(int8_model, kv_cache_memory="128MiB")


def test_int8_logits_are_close_to_reference(int8_llm, reference_model):
    ids = int8_llm.tokenizer.apply_chat_template(CHAT, tokenize=True)[:64]
    ours = full_logits(int8_llm.engine.loaded.model, ids).log_softmax(-1)
    with torch.inference_mode():
        ref = reference_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    kl = (ref.exp() * (ref - ours)).sum(-1).mean().item()
    agreement = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"int8: mean KL(reference || int8) = {kl:.4f}, top-1 agreement = {agreement:.3f}")
    assert kl <= 0.02
    assert agreement >= 0.9


def test_int8_greedy_follows_reference(int8_llm, reference_model):
    """Not bit-exact: 16 greedy tokens match, or the first other token is one the reference
    rates within 0.5 nats of its own. Measured (int8 on the default model): 3 of 4 prompts
    equal at every level; the fourth leaves at token 9 with a gap of 0.33 at avx2 (its
    attention sums in another order than avx512's, enough to tip a near-tie of int8's own)."""
    tokenizer = int8_llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    equal = 0
    for conversation in PROMPTS:
        prompt = tokenizer.apply_chat_template(conversation, tokenize=True)
        ours = int8_llm.generate({"prompt_token_ids": prompt}, params,
                                 use_tqdm=False)[0].outputs[0].token_ids
        ref = reference_greedy(reference_model, prompt, 16, draft=ours)
        index, gap = first_divergence_gap(reference_model, prompt, ours, ref)
        print(f"int8: {index} of 16 tokens equal, reference's gap there {gap:.3f}")
        assert gap <= 0.5
        equal += index == 16
    assert equal >= len(PROMPTS) - 1


def test_int8_batch_invariance(int8_llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [f"Tell me about {topic}." for topic in
               ("the ocean", "volcanoes", "jazz", "honey bees", "old libraries", "trains")]
    alone = [int8_llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    together = [o.outputs[0].token_ids for o in int8_llm.generate(prompts, params,
                                                                  use_tqdm=False)]
    assert together == alone
