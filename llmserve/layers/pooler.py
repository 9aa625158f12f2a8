"""Pooling: one vector per prompt from its final hidden states, and the head over it.

A pooling request's prompt is prefilled like any other (chunked, batched, prefix-cached);
the runner hands each chunk's hidden rows to `Pooler.add_chunk`, which keeps what the
pooling type needs (LAST: the last row; MEAN: every row, summed once the prompt is done;
CLS: the first position's row), and `Pooler.finish` turns a batch of pooled states into
the requests' outputs:

    embed     first `dimensions` values, L2-normalised unless asked not to
    classify  logits = the head on the pooled state: a `score` matrix (labels, hidden)
              from the checkpoint, or the LM head's logits at `classifier_from_token`'s
              tokens; softmax probabilities (one label: sigmoid) unless use_activation is
              False

Every output is a function of its own prompt's rows only, summed in one fixed order:
batching, chunked prefill and the thread count change no bit (MEAN sums the whole
(prompt, hidden) matrix at the end, not per chunk; a `score` classifier is a per-row product
and sum, and the LM head runs on one row at a time: a GEMM's blocking depends on the
batch's row count).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmserve.config.pooler import PoolerConfig
from llmserve.pooling_params import PoolingParams


@dataclass
class PooledState:
    """What a request's chunks have left so far: the LAST/CLS row or the MEAN sum."""

    value: torch.Tensor | None = None  # (hidden,) float32: LAST and CLS
    rows: list[torch.Tensor] = field(default_factory=list)  # MEAN: each chunk's rows
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
            state.rows.append(hidden.float())
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
        if self.head is not None:  # (N, 1, hidden) * (labels, hidden), summed per row
            return (pooled.to(self.head.dtype)[:, None, :] * self.head).sum(dim=-1).float()
        if self.label_token_ids is None or self.compute_logits is None:
            raise ValueError("this model has no classifier (a score head, or "
                             "pooler_config classifier_from_token)")
        # one row at a time: the LM head's GEMM always sees the same shape (batch-invariant)
        rows = [self.compute_logits(row[None].to(dtype))[0, self.label_token_ids]
                for row in pooled]
        return torch.stack(rows).float()

    def _pooled(self, state: PooledState) -> torch.Tensor:
        if self.config.pooling_type == "MEAN" and state.rows:
            return torch.cat(state.rows).sum(dim=0) / state.num_tokens
        if state.value is None:
            raise RuntimeError("a pooling request finished without its pooled hidden state")
        return state.value


def activate(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities from one request's label logits: sigmoid for one label, else softmax."""
    return logits.sigmoid() if logits.numel() == 1 else logits.softmax(dim=-1)

