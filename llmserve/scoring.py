"""Scores of text pairs (vLLM's `LLM.score`, `/v1/score`, `/rerank`), two ways:

* an embedding model (`convert` embed): the cosine similarity of the two texts' embeddings;
* a classifier (`convert` classify, a cross-encoder): the pair as one input (the
  tokenizer's pair encoding), scored by the classifier: one label, its sigmoid; two labels
  (Qwen3-Reranker's no / yes tokens), the second one's softmax probability.

Pairs are `text_1` x `text_2` as vLLM pairs them: one first text against each second text,
or two lists of the same length, element by element.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from llmserve.tokenizer import Tokenizer


def pair_up(text_1: str | Sequence[str], text_2: str | Sequence[str]
            ) -> list[tuple[str, str]]:
    """The (first, second) pairs to score; ValueError for lists of different lengths."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("nothing to score: both sides need at least one text")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"{len(firsts)} first texts against {len(seconds)} second texts: "
                         "give one first text or as many as second texts")
    return list(zip(firsts, seconds, strict=True))


def cross_encoder_prompt(tokenizer: Tokenizer, first: str, second: str) -> dict:
    return {"prompt_token_ids": tokenizer.encode_pair(first, second)}


def classifier_score(probs: torch.Tensor) -> float:
    """A pair's score from its class probabilities (see the module's docstring)."""
    if probs.numel() == 1:
        return float(probs[0])
    if probs.numel() == 2:
        return float(probs[1])
    raise ValueError(f"scoring needs a classifier of one or two labels, not {probs.numel()}")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float(), b.float(), dim=0))
