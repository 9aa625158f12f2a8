"""The engine on a CUDA GPU: the exact path against `transformers` on the same GPU, and the
default path (bfloat16, compiled step, flex_attention) against the exact one.

These need a GPU, so CI (CPU only) skips them; the flex backend's algorithm is tested on
the CPU in tests/layers/test_attention.py and tests/engine/test_default_path.py.
"""

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.layers.attention.flex import FlexAttentionBackend
from tests.engine.test_transparency import TOPICS, chat_ids
from tests.models.test_llama_reference import PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def cuda_llm(smollm2_gguf) -> LLM:
    return LLM(str(smollm2_gguf), dtype="float32", device="cuda", kv_cache_memory="1GiB")


@pytest.fixture(scope="module")
def prompts(cuda_llm) -> list[dict]:
    tokenizer = cuda_llm.tokenizer
    return ([{"prompt_token_ids": tokenizer.apply_chat_template(c, tokenize=True)}
             for c in PROMPTS] + [chat_ids(cuda_llm, f"Tell me about {t}.") for t in TOPICS])


def test_exact_path_on_cuda_matches_transformers(cuda_llm, prompts, smollm2_gguf):
    from transformers import AutoModelForCausalLM

    assert isinstance(cuda_llm.engine.executor.runner.attention, FlexAttentionBackend)
    reference = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).cuda().eval()
    outputs = cuda_llm.generate(prompts, GREEDY)  # one continuous batch
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = prompt["prompt_token_ids"]
        with torch.inference_mode():
            ref = reference.generate(
                torch.tensor([ids], device="cuda"), max_new_tokens=GREEDY.max_tokens,
                do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                           device="cuda"),
                pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref


def test_exact_path_logits_on_cuda(cuda_llm, prompts, smollm2_gguf):
    """Prompt logprobs of the paged, batched path equal the reference's log-softmax."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).cuda().eval()
    ids = prompts[0]["prompt_token_ids"]
    out = cuda_llm.generate([{"prompt_token_ids": ids}],
                            SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    with torch.inference_mode():
        logits = reference(torch.tensor([ids], device="cuda")).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    worst = max(abs(out.prompt_logprobs[i][tok].logprob - ref[i - 1, tok].item())
                for i, tok in enumerate(ids) if i)
    print(f"max |prompt logprob diff| vs transformers on cuda: {worst:.2e}")
    assert worst <= 1e-3


def test_default_path_on_cuda_follows_the_exact_one(smollm2_gguf, cuda_llm, prompts,
                                                    monkeypatch):
    """dtype auto on CUDA: bfloat16 weights and cache, the compiled step (the tests
    elsewhere run eager), flex attention; greedy output agrees with float32 on most."""
    monkeypatch.setenv("LLMSERVE_ENFORCE_EAGER", "0")
    llm = LLM(str(smollm2_gguf), device="cuda", kv_cache_memory="1GiB")
    assert llm.engine.kv_cache_dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    exact = [o.outputs[0].token_ids for o in cuda_llm.generate(prompts, params)]
    agree = sum(f == e for f, e in zip(fast, exact, strict=True))
    print(f"default path on cuda: {agree}/{len(prompts)} prompts agree with float32 on 16 "
          f"greedy tokens")
    assert agree >= len(prompts) // 2
    # the same prompts again, one at a time: a sequence's tokens do not need the others
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:4]]
    assert sum(a == f for a, f in zip(alone, fast, strict=False)) >= 3


def test_host_memory_tier_on_cuda_gives_the_recomputed_output(smollm2_gguf, cuda_llm):
    """`kv_offload_gib` alone on CUDA: a pinned host-memory tier behind a cache too small
    for the working set (24 blocks of 16 tokens, whatever the model's depth); every prompt
    read back equals its recomputation."""
    from llmserve.memory import kv_bytes_per_token

    plain = cuda_llm
    per_token = kv_bytes_per_token(plain.engine.loaded.config, torch.float32)
    tiered = LLM(str(smollm2_gguf), kv_offload_gib=0.5, dtype="float32", device="cuda",
                 kv_cache_memory=24 * 16 * per_token)
    assert tiered.engine.kv_tier.name == "host" and tiered.engine.kv_tier.pin
    prompts = [chat_ids(plain, f"Library {i}. " + "Tell me about the books here. " * 20 + t)
               for i, t in enumerate(TOPICS[:4])]
    expected = [plain.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    for p in prompts:  # each evicts the one before from the GPU cache
        tiered.generate(p, GREEDY)
    again = [tiered.generate(p, GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.metrics.num_tier_cached_tokens > 0 for o in again)
