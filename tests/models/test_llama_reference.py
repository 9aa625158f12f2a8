"""The Llama-family model against `transformers` on the same weights: logits and greedy tokens."""

import pytest
import torch
import transformers

from llmserve import SamplingParams
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.loader.hf import load_hf_folder
from llmserve.models.registry import model_class

LOGIT_TOLERANCE = 1e-3

CHAT = [
    {"role": "system", "content": "You are a concise assistant who answers in one sentence."},
    {"role": "user", "content": "Explain why the sky is blue, and mention Rayleigh scattering."},
    {"role": "assistant", "content": "Air molecules scatter short blue wavelengths of sunlight "
     "far more than long red ones, so blue light reaches our eyes from every direction."},
    {"role": "user", "content": "Then why are sunsets red and orange instead?"},
]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about autumn leaves."}],
    [{"role": "user", "content": "List three prime numbers greater than 10."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
]


def full_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence through the paged path (one prefill)."""
    cfg = model.config
    n = len(token_ids)
    block_size = 16
    num_blocks = -(-n // block_size)
    kv = KVCache.allocate(
        cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
        torch.float32,
    )
    meta = AttentionMetadata.build([n], [0], [list(range(num_blocks))], block_size,
                                   backend=attention_backend(torch.device("cpu")))
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), kv, meta)
        return model.compute_logits(hidden)


def per_op_logits(model, token_ids: list[int]) -> torch.Tensor:
    """`full_logits` with the one-call native stack set aside: the per-op path's."""
    stack, model.native_layers = model.native_layers, None
    try:
        return full_logits(model, token_ids)
    finally:
        model.native_layers = stack


def test_logits_match_reference_on_default_model(smollm2_llm, reference_model):
    tokenizer = smollm2_llm.tokenizer
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True)[:64]
    assert len(ids) == 64
    ours = full_logits(smollm2_llm.engine.loaded.model, ids)
    with torch.inference_mode():
        ref = reference_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"default model: max |logit diff| vs transformers over 64 positions = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff:.2e} over {LOGIT_TOLERANCE:.0e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_generation_matches_reference(smollm2_llm, reference_model):
    """64 greedy tokens for 4 prompts, the last two run in one batch by llmserve."""
    tokenizer = smollm2_llm.tokenizer
    prompts = [tokenizer.apply_chat_template(p, tokenize=True) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ours = [smollm2_llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
            for p in prompts[:2]]
    ours += smollm2_llm.generate([{"prompt_token_ids": p} for p in prompts[2:]], params,
                                 use_tqdm=False)
    for prompt, out in zip(prompts, ours, strict=True):
        ours = out.outputs[0].token_ids
        assert ours == reference_greedy(reference_model, prompt, 64, draft=ours)


def test_a_checked_draft_gives_the_reference_own_tokens(smollm2_llm, reference_model):
    """The draft check of `reference_greedy` returns what token-by-token decoding returns:
    for a right draft, one wrong at token 3, and one too short."""
    prompt = smollm2_llm.tokenizer.apply_chat_template(PROMPTS[0], tokenize=True)
    alone = reference_greedy(reference_model, prompt, 8)
    wrong = alone[:3] + [(alone[3] + 1) % 1000] + alone[4:]
    for draft in (alone, wrong, alone[:5]):
        assert reference_greedy(reference_model, prompt, 8, draft=draft) == alone


def reference_greedy(reference_model, prompt: list[int], num_tokens: int,
                     draft: list[int] | None = None) -> list[int]:
    """`transformers` greedy continuation of `prompt`, never stopping early.

    With `draft` (a continuation to check, e.g. llmserve's), one forward pass scores all of
    it: its tokens are kept while each is the reference's argmax after the ones before, and
    the rest is generated from the first the reference would not pick. That is the tokens
    the reference picks one by one (speculative decoding's check), in one pass instead of
    `num_tokens` when the draft is right: a reference decode step costs about 50 ms here.
    """
    kept: list[int] = []
    if draft:
        draft = list(draft[:num_tokens])
        with torch.inference_mode():
            logits = reference_model(torch.tensor([prompt + draft])).logits[0]
        picks = logits[len(prompt) - 1:].argmax(-1).tolist()  # the pick after each prefix
        for token, pick in zip(draft, picks, strict=False):
            kept.append(pick)
            if pick != token:
                break
        kept = kept[:num_tokens]
    if len(kept) == num_tokens:
        return kept
    with torch.inference_mode():
        start = torch.tensor([prompt + kept])
        out = reference_model.generate(
            start, max_new_tokens=num_tokens - len(kept), do_sample=False,
            attention_mask=torch.ones_like(start), pad_token_id=0, eos_token_id=None,
        )
    return kept + out[0, start.shape[1]:].tolist()


def first_divergence_gap(reference_model, prompt: list[int], ours: list[int],
                         ref: list[int]) -> tuple[int, float]:
    """Where a quantized path's greedy tokens first leave the reference's (len(ref) if
    never) and the reference's log-prob gap there between its token and ours (0 if never):
    a quantized path may take the other branch only where the reference itself nearly
    hesitates."""
    i = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), len(ref))
    if i == len(ref):
        return i, 0.0
    with torch.inference_mode():
        logits = reference_model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
    logprobs = logits.log_softmax(-1)
    return i, (logprobs[ref[i]] - logprobs[ours[i]]).item()


def _tiny_folder(tmp_path, kind: str):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                  max_position_embeddings=256)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama3-rope":
        config = transformers.LlamaConfig(
            **common, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, head_dim=32)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    model.apply(_randomize)
    model.save_pretrained(tmp_path)
    return model.eval()


@torch.no_grad()
def _randomize(module: torch.nn.Module) -> None:
    """Random norms and biases too, so that every weight's placement is tested."""
    for p in module.parameters(recurse=False):
        p.normal_(0, 0.5 if p.dim() == 1 else 0.08)


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "qwen3"])
def test_logits_match_reference_on_tiny_hf_folders(tmp_path, kind):
    reference = _tiny_folder(tmp_path, kind)
    loaded = load_hf_folder(tmp_path)
    model = model_class(loaded.config)(loaded.config)
    model.load_weights(loaded.tensors)
    model.eval()
    ids = torch.randint(0, 320, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = full_logits(model, ids)
    with torch.inference_mode():
        ref = reference(torch.tensor([ids])).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"{kind}: max |logit diff| vs transformers = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE, f"{kind}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_qwen_families_run_on_the_native_stack(tmp_path, kind, quantization):
    """Qwen2's qkv biases and Qwen3's per-head q/k norms run inside the one-call native
    stack: the same logits as the per-op path, bit for bit (float32: the reference's too)."""
    check_native_stack(tmp_path, _tiny_folder(tmp_path, kind), kind, quantization)


def check_native_stack(folder, reference, kind: str, quantization: str | None,
                       **reference_args) -> None:
    """The tiny checkpoint saved in `folder` (`reference`, a transformers model) loaded
    with `quantization` runs on the one-call native stack with the per-op path's logits,
    bit for bit; float32 also within LOGIT_TOLERANCE of the reference."""
    from llmserve.loader.model_loader import load_model
    from tests.tiny_models import save_byte_tokenizer

    save_byte_tokenizer(folder)
    model = load_model(str(folder), quantization=quantization).model
    assert model.native_layers is not None
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    stacked = full_logits(model, ids)
    assert torch.equal(stacked, per_op_logits(model, ids))
    if quantization is None:
        with torch.inference_mode():
            ref = reference(torch.tensor([ids]), **reference_args).logits[0]
        diff = (stacked - ref).abs().max().item()
        print(f"{kind} on the native stack: max |logit diff| vs transformers = {diff:.2e}")
        assert diff <= LOGIT_TOLERANCE
