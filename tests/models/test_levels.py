"""The real model at every instruction-set level this CPU runs (the machine's own level is
what the other model tests run): the exact path equals `transformers`, and the default
path (int4, or int4-a8 where the timing picks it) follows the exact one.

Slow tier: each level builds its kernels and loads the model again. The default tier keeps
what these imply: every kernel gives the same bits at every level (tests/kernels/), and at
the machine's own level the exact path equals the reference and int4 and int4-a8 follow it
(tests/models/test_llama_reference.py, tests/engine/test_default_path.py)."""

import pytest

from llmserve import LLM, SamplingParams
from llmserve.kernels import level_of, native
from llmserve.loader.kernel_choice import choose_quantization
from tests.engine.test_default_path import agreement
from tests.models.test_llama_reference import PROMPTS, first_divergence_gap, reference_greedy

pytestmark = pytest.mark.slow

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


def test_exact_and_default_paths_at_the_level(kernel_level, smollm2_gguf, reference_tokens,
                                              reference_model):
    prompts, reference = reference_tokens
    exact = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory="32MiB")
    assert level_of(native()).split("+")[0] == kernel_level
    assert exact.engine.loaded.quantization is None
    assert greedy(exact, prompts) == reference
    default = LLM(str(smollm2_gguf), kv_cache_memory="32MiB")
    # what the timing chose at this level (kernel_choice.pick: int4, or int4-a8 where it is
    # clearly faster; int4 where the machine was busy, held for the process)
    choice = choose_quantization("int4", default.engine.loaded.config)
    assert default.engine.loaded.quantization == choice.quantization
    print(f"{kernel_level}: {choice.describe()}")
    ours = greedy(default, prompts)
    full, mean_prefix = agreement(ours, reference)
    print(f"{kernel_level}: default path agrees with the reference on {full:.0%} of "
          f"{len(prompts)} prompts, mean agreeing prefix {mean_prefix:.1f} of 16 tokens")
    gaps = [first_divergence_gap(reference_model, p, o, r)[1]
            for p, o, r in zip(prompts, ours, reference, strict=True)]
    print(f"{kernel_level}: the reference's log-prob gaps where the default path leaves it: "
          + ", ".join(f"{g:.2f}" for g in gaps))
    # a quantized path may take the other branch only where the reference nearly hesitates
    # (measured: int4 at avx512+vnni 0.08, 0.07 on the two prompts that leave; int4-a8, which
    # the timing picks at avx2 here, 0.08, 0.33, 0.07, 0.44: it leaves all four)
    assert max(gaps) <= 0.5
    if choice.quantization == "int4":
        # at the machine's own level (test_default_path.py): 85 % of 20 prompts agree fully
        assert full >= 0.5 and mean_prefix >= 12
