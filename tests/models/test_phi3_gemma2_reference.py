"""Phi-3 (fused qkv and gate_up, LongRoPE, a sliding window) and Gemma 2 (soft-capped
attention and logits, sliding windows on every other layer, the (1 + w) norms) against
`transformers` on tiny random checkpoints made here: float32 logits within 1e-3, greedy
tokens equal, and batching, chunked prefill and the prefix cache change no token."""

import pytest
import torch
import transformers

from llmserve.loader.hf import load_hf_folder
from llmserve.models.registry import model_class
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.reference_checks import check_engine_tokens, logit_diff, model_from, random_ids
from tests.tiny_models import save_tiny

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)
ORIGINAL = 64  # Phi-3's pre-training context here: LongRoPE's short factors inside it
NUM_TOKENS = 12


def longrope(head_dim: int) -> dict:
    half = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}


def tiny(kind: str) -> transformers.PreTrainedModel:
    if kind == "phi3":  # LongRoPE (short factors below 64 positions) and a window of 40
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **COMMON, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
            rope_parameters=longrope(16), sliding_window=40, pad_token_id=0, bos_token_id=1,
            eos_token_id=2))
    if kind == "phi3-plain":  # Phi-3-mini-4k's shape: no rope scaling, no window
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **COMMON, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2))
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, head_dim=16, max_position_embeddings=256, sliding_window=24,
        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0))


@pytest.fixture(scope="module", params=["phi3", "phi3-plain", "gemma2"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny(tiny(request.param), folder)


def test_logits_match_reference(checkpoint):
    kind, folder, reference = checkpoint
    # inside Phi-3's pre-training context (where Hugging Face keeps the short factors), and
    # past both windows
    ids = random_ids(ORIGINAL if kind == "phi3" else 100, 1)
    diff = logit_diff(model_from(load_hf_folder(folder)), reference, ids)
    print(f"{kind}: max |logit diff| vs transformers = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE


def test_greedy_tokens_and_invariance(checkpoint):
    _, folder, reference = checkpoint
    prompts = [random_ids(n, seed) for n, seed in ((30, 2), (17, 3), (45, 4))]
    check_engine_tokens(folder, reference, prompts, NUM_TOKENS)


def test_longrope_past_the_context_uses_the_long_factors(tmp_path):
    """Beyond the pre-training context each position turns by the long factors, with the
    attention factor sqrt(1 + ln(256 / 64) / ln(64)) on cos and sin: Hugging Face's table
    for a sequence that long, position by position."""
    reference = save_tiny(tiny("phi3"), tmp_path)
    config = load_hf_folder(tmp_path).config
    rotary = model_class(config)(config).model.rotary
    positions = torch.arange(ORIGINAL, 200)
    x = torch.zeros(1, len(positions), 16)
    cos, sin = reference.model.rotary_emb(x, positions[None])
    torch.testing.assert_close(rotary.cos_cache[positions], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.sin_cache[positions], sin[0], rtol=0, atol=1e-6)
