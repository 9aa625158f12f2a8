"""Phi-3 (fused qkv and gate_up, LongRoPE, a sliding window) and Gemma 2 (soft-capped
attention and logits, sliding windows on every other layer, the (1 + w) norms) against
`transformers` on tiny random checkpoints made here: float32 logits within 1e-3, greedy
tokens equal, and batching, chunked prefill and the prefix cache change no token."""

import pytest
import torch
import transformers

from llmserve import LLM, SamplingParams
from llmserve.loader.hf import load_hf_folder
from llmserve.models.registry import model_class
from tests.models.test_llama_reference import LOGIT_TOLERANCE, full_logits, reference_greedy
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


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_reference(checkpoint):
    kind, folder, reference = checkpoint
    loaded = load_hf_folder(folder)
    model = model_class(loaded.config)(loaded.config)
    model.load_weights(loaded.tensors)
    model.eval()
    # inside Phi-3's pre-training context (where Hugging Face keeps the short factors), and
    # past both windows
    ids = random_ids(ORIGINAL if kind == "phi3" else 100, 1)
    ours = full_logits(model, ids)
    with torch.inference_mode():
        ref = reference(torch.tensor([ids])).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"{kind}: max |logit diff| vs transformers = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE


def test_greedy_tokens_and_invariance(checkpoint):
    kind, folder, reference = checkpoint
    prompts = [random_ids(n, seed) for n, seed in ((30, 2), (17, 3), (45, 4))]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [reference_greedy(reference, p, NUM_TOKENS) for p in prompts]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")
    chunked = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB",
                  max_num_batched_tokens=16, enable_prefix_caching=False)

    def tokens(engine: LLM, batch: list) -> list[list[int]]:
        outputs = engine.generate([{"prompt_token_ids": p} for p in batch], params,
                                  use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    assert tokens(llm, prompts) == expected
    assert [tokens(llm, [p])[0] for p in prompts] == expected  # prefix-cache hits
    assert tokens(chunked, prompts) == expected


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
