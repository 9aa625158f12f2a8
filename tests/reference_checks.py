"""The checks every new model family's reference tests make on a tiny checkpoint: logits
against `transformers`, and the engine's greedy tokens batched, alone (prefix-cache hits)
and chunked against the reference's."""

import torch
from torch import nn

from llmserve import LLM, SamplingParams
from llmserve.loader.weights import LoadedWeights
from llmserve.models.registry import model_class
from tests.models.test_llama_reference import LOGIT_TOLERANCE, full_logits, reference_greedy


def random_ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def model_from(loaded: LoadedWeights) -> nn.Module:
    """The model class of `loaded`'s config with its weights, in eval mode."""
    model = model_class(loaded.config)(loaded.config)
    model.load_weights(loaded.tensors)
    return model.eval()


def logit_diff(model: nn.Module, reference: nn.Module, ids: list[int]) -> float:
    """The largest |logit| difference from the reference at every position of `ids`."""
    ours = full_logits(model, ids)
    with torch.inference_mode():
        ref = reference(torch.tensor([ids])).logits[0]
    return (ours - ref).abs().max().item()


def check_engine_tokens(folder, reference: nn.Module, prompts: list[list[int]],
                        num_tokens: int) -> list:
    """The float32 engine's greedy tokens equal the reference's batched, for each prompt
    alone (after the batch: from its prefix-cache blocks) and with a chunked prefill of 16
    tokens a step; returns the outputs alone (their cache hits, for the caller)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    expected = [reference_greedy(reference, p, num_tokens) for p in prompts]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")
    chunked = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB",
                  max_num_batched_tokens=16, enable_prefix_caching=False)

    def generate(engine: LLM, batch: list) -> list:
        return engine.generate([{"prompt_token_ids": p} for p in batch], params,
                               use_tqdm=False)

    def tokens(outputs: list) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outputs]

    assert tokens(generate(llm, prompts)) == expected  # batched
    alone = [generate(llm, [p])[0] for p in prompts]
    assert tokens(alone) == expected
    assert tokens(generate(chunked, prompts)) == expected
    return alone


def assert_greedy_follows(reference: nn.Module, ids: list[int], tokens: list[int],
                          image_token: int | None = None, tolerance: float = LOGIT_TOLERANCE,
                          type_ids: str = "token_type_ids", **inputs: torch.Tensor) -> None:
    """Greedy `tokens` after the prompt `ids`, checked on the reference's whole forwards
    over the sequence so far (`inputs`: its image inputs; `image_token`: the token whose
    positions go in `type_ids`: Gemma 3's `token_type_ids`, Qwen2.5-VL's
    `mm_token_type_ids`): each token is the
    reference's argmax, or within `tolerance` of it, a near tie that the order of float
    sums breaks either way (a prefill chunked at an image against one whole forward)."""
    sequence = list(ids)
    with torch.inference_mode():
        for k, token in enumerate(tokens):
            input_ids = torch.tensor([sequence])
            extra = {} if image_token is None else {
                type_ids: (input_ids == image_token).long()}
            logits = reference(input_ids=input_ids, **inputs, **extra).logits[0, -1]
            best = int(logits.argmax())
            assert logits[token] >= logits[best] - tolerance, (
                f"token {k}: ours {token} (logit {logits[token]:.6f}), the reference's "
                f"{best} ({logits[best]:.6f})")
            if token == image_token:
                break  # a random model's greedy image token: no image rows follow it
            sequence.append(token)
