"""The real model at every instruction-set level this CPU runs (the machine's own level is
what the other model tests run): the exact path equals `transformers`, and the default
(int4) path follows the exact one, as at the machine's own level."""

import pytest

from llmserve import LLM, SamplingParams
from llmserve.kernels import level_of, native
from llmserve.loader.kernel_choice import choose_quantization
from tests.engine.test_default_path import agreement
from tests.models.test_llama_reference import PROMPTS, reference_greedy

GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(reference_model, smollm2_llm):
    tokenizer = smollm2_llm.tokenizer
    prompts = [tokenizer.apply_chat_template(c, tokenize=True) for c in PROMPTS]
    return prompts, [reference_greedy(reference_model, p, 16) for p in prompts]


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_16,
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_exact_and_default_paths_at_the_level(kernel_level, smollm2_gguf, reference_tokens):
    prompts, reference = reference_tokens
    exact = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory="32MiB")
    assert level_of(native()).split("+")[0] == kernel_level
    assert exact.engine.loaded.quantization is None
    assert greedy(exact, prompts) == reference
    default = LLM(str(smollm2_gguf), kv_cache_memory="32MiB")
    # what the timing chose at this level (int4 where it is no slower than float32)
    choice = choose_quantization("int4", default.engine.loaded.config)
    assert default.engine.loaded.quantization == choice.quantization
    print(f"{kernel_level}: {choice.describe()}")
    full, mean_prefix = agreement(greedy(default, prompts), reference)
    print(f"{kernel_level}: default path agrees with the reference on {full:.0%} of "
          f"{len(prompts)} prompts, mean agreeing prefix {mean_prefix:.1f} of 16 tokens")
    # at the machine's own level (test_default_path.py): 85 % of 20 prompts agree fully
    assert full >= 0.5 and mean_prefix >= 12
