"""Pooling: one vector per prompt from its final hidden states, and the head over it.

A pooling request's prompt is prefilled like any other (chunked, batched, prefix-cached);
the runner hands each chunk's hidden rows to `Pooler.add_chunk`, which keeps what the
pooling type needs (LAST: the last row; MEAN: a float32 running sum; CLS: the first
position's row), and `Pooler.finish` turns a batch of pooled states into the requests'
outputs:

    embed     first `dimensions` values, L2-normalised unless asked not to
    classify  logits = the head on the pooled state: a `score` matrix (labels, hidden)
              from the checkpoint, or the LM head's logits at `classifier_from_token`'s
              tokens; softmax probabilities (one label: sigmoid) unless use_activation is
              False
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.config.pooler import PoolerConfig
from llmserve.pooling_params import PoolingParams


@dataclass
class PooledState:
    """What a request's chunks have left so far: the LAST/CLS row or the MEAN sum."""

    value: torch.Tensor | None = None  # (hidden,) float32
    num_tokens: int = 0
    dtype: torch.dtype = torch.float32  # the model's hidden states' (its LM head's input)


class Pooler:
    """`head`: a (labels, hidden) classifier matrix; or `label_token_ids` with
    `compute_logits` (the model's LM head) to take those tokens' logits as the labels'."""

    def __init__(self, config: PoolerConfig, head: torch.Tensor | None = None,
                 label_token_ids: list[int] | None = None,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.config = config
        self.head = head
        self.label_token_ids = label_token_ids
        self.compute_logits = compute_logits

    @property
    def num_labels(self) -> int | None:
        """Labels of the classifier (None: this model has no classifier)."""
        if self.head is not None:
            return int(self.head.shape[0])
        return len(self.label_token_ids) if self.label_token_ids else None

    def add_chunk(self, state: PooledState, hidden: torch.Tensor, start_position: int,
                  ends_prompt: bool) -> None:
        """Take a prefill chunk's hidden rows (n, hidden) computed from `start_position`."""
        kind = self.config.pooling_type
        state.dtype = hidden.dtype
        if kind == "MEAN":
            chunk = hidden.float().sum(dim=0)
            state.value = chunk if state.value is None else state.value + chunk
        elif kind == "CLS":
            if start_position == 0:
                state.value = hidden[0].float()
        elif ends_prompt:
            state.value = hidden[-1].float()
        state.num_tokens = start_position + hidden.shape[0]

    def finish(self, states: list[PooledState], params: list[PoolingParams]
               ) -> list[torch.Tensor]:
        """Each request's output (a float32 vector on the CPU), from its pooled state."""
        pooled = torch.stack([self._pooled(s) for s in states])  # (N, hidden)
        outputs: list[torch.Tensor | None] = [None] * len(states)
        embed = [i for i, p in enumerate(params) if p.task == "embed"]
        classify = [i for i, p in enumerate(params) if p.task == "classify"]
        for i in embed:
            vector, p = pooled[i], params[i]
            if p.dimensions is not None:
                vector = vector[: p.dimensions]
            normalize = self.config.normalize if p.normalize is None else p.normalize
            outputs[i] = F.normalize(vector, dim=0) if normalize else vector
        if classify:
            logits = self.classify_logits(pooled[classify], states[classify[0]].dtype)
            for row, i in enumerate(classify):
                outputs[i] = (activate(logits[row]) if params[i].use_activation
                              else logits[row])
        return [o.cpu() for o in outputs]

    def classify_logits(self, pooled: torch.Tensor, dtype: torch.dtype = torch.float32
                        ) -> torch.Tensor:
        """(N, hidden) -> (N, labels) float32 logits of the classifier (`dtype`: the
        model's hidden states', which its LM head takes)."""
        if self.head is not None:
            return F.linear(pooled.to(self.head.dtype), self.head).float()
        if self.label_token_ids is None or self.compute_logits is None:
            raise ValueError("this model has no classifier (a score head, or "
                             "pooler_config classifier_from_token)")
        logits = self.compute_logits(pooled.to(dtype))
        return logits[:, self.label_token_ids].float()

    def _pooled(self, state: PooledState) -> torch.Tensor:
        if state.value is None:
            raise RuntimeError("a pooling request finished without its pooled hidden state")
        if self.config.pooling_type == "MEAN":
            return state.value / state.num_tokens
        return state.value


def activate(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities from one request's label logits: sigmoid for one label, else softmax."""
    return logits.sigmoid() if logits.numel() == 1 else logits.softmax(dim=-1)

