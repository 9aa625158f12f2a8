"""Per-request logits processors applied as batched tensor ops: bias, masks and penalties.

In the sampler's order: logit_bias, allowed_token_ids, bans (bad words and, while the
output is shorter than min_tokens, eos and stop token ids), repetition penalty (prompt +
output tokens), frequency and presence penalties (output tokens). Every part is built only
when some row of the step uses it, so a batch of plain requests pays nothing.

The per-row Python in `LogitsProcessing.build` only turns lists into index tensors; the
work on the (N, V) logits is a handful of batched ops. Penalties read (P, V) token counts:
counted here from the histories, or kept up to date token by token by the runner's
persistent batch (`worker/input_batch.py`), which passes them in.
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


class RowHistory(Protocol):
    """What the processors read of a request (a `ScheduledRequest` satisfies it)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Collection[int]
    bad_words_token_ids: Sequence[Sequence[int]]


@dataclass
class History:
    """A plain `RowHistory`, for tests and callers without a scheduler."""

    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_ids: Collection[int] = frozenset()
    bad_words_token_ids: Sequence[Sequence[int]] = field(default_factory=list)


@dataclass
class Penalties:
    """Rows with a penalty, the tokens they have seen, and their penalty values.

    Seen tokens come either as token lists padded with -1 (counted when applied), or as
    counts the runner's persistent batch keeps up to date token by token; the result is
    the same either way. Prompt tokens are given only when a row has a repetition penalty.
    """

    rows: torch.Tensor  # (P,) row indices into the batch
    repetition: torch.Tensor  # (P,) 1 = off
    frequency: torch.Tensor  # (P,) 0 = off
    presence: torch.Tensor  # (P,) 0 = off
    output_tokens: torch.Tensor | None = None  # (P, Lo) long, -1 = pad
    prompt_tokens: torch.Tensor | None = None  # (P, Lp) long, -1 = pad
    output_counts: torch.Tensor | None = None  # (P, V) float, instead of output_tokens
    prompt_seen: torch.Tensor | None = None  # (P, V) bool, instead of prompt_tokens


@dataclass
class LogitsProcessing:
    """Index tensors of one step's processors; a part is None when no row uses it."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, local, ids
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids
    penalties: Penalties | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[RowHistory],
        device: torch.device | str = "cpu",
        penalties: Penalties | None = None,
    ) -> "LogitsProcessing | None":
        """Index tensors for the rows that use a processor; None when no row does.

        `penalties`: the penalised rows' state where the caller keeps it (the runner's
        persistent batch); else it is built from `histories`.
        """
        processing = cls(
            bias=_bias(params, device),
            allowed=_allowed(params, device),
            banned=_banned(params, histories, device),
            penalties=penalties or _penalties(params, histories, device),
        )
        if processing.bias is None and processing.allowed is None and (
            processing.banned is None and processing.penalties is None
        ):
            return None
        return processing

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V) logits -> processed copy, (N, V)."""
        logits = logits.clone()
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.allowed is not None:
            rows, local, ids = self.allowed
            banned = torch.ones(len(rows), logits.shape[-1], dtype=torch.bool,
                                device=logits.device)  # (A, V)
            banned[local, ids] = False
            logits[rows] = logits[rows].masked_fill(banned, NEG_INF)
        if self.banned is not None:
            logits.index_put_(self.banned, torch.tensor(NEG_INF, device=logits.device))
        if self.penalties is not None:
            p = self.penalties
            logits[p.rows] = apply_penalties(logits[p.rows], p)
        return logits


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(P, L) token ids padded with -1 -> (P, V) float count of each id per row."""
    counts = torch.zeros(tokens.shape[0], vocab_size, device=tokens.device)
    return counts.scatter_add_(1, tokens.clamp(min=0), (tokens >= 0).float())


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """(P, V) logits of the penalised rows -> penalised (P, V), as vLLM defines them.

    Repetition: tokens in the prompt or the output have positive logits divided by the
    penalty and negative ones multiplied. Then `logit -= frequency * count + presence *
    (count > 0)` with counts over the output only.
    """
    vocab = logits.shape[-1]
    output_counts = p.output_counts  # (P, V)
    if output_counts is None:
        output_counts = token_counts(p.output_tokens, vocab)
    prompt_seen = p.prompt_seen  # (P, V)
    if prompt_seen is None and p.prompt_tokens is not None:
        prompt_seen = token_counts(p.prompt_tokens, vocab) > 0
    if prompt_seen is not None:
        seen = prompt_seen | (output_counts > 0)
        rep = p.repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    return (logits - p.frequency[:, None] * output_counts
            - p.presence[:, None] * (output_counts > 0).float())


def banned_bad_word_ids(
    output: Sequence[int], bad_words: Sequence[Sequence[int]]
) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output so far."""
    banned = []
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and list(output[len(output) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned


def _bias(params: Sequence[SamplingParams], device) -> tuple | None:
    rows, ids, values = [], [], []
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(row)
            ids.append(token)
            values.append(bias)
    if not rows:
        return None
    return (_long(rows, device), _long(ids, device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _allowed(params: Sequence[SamplingParams], device) -> tuple | None:
    rows, local, ids = [], [], []
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            local.extend([len(rows)] * len(p.allowed_token_ids))
            ids.extend(p.allowed_token_ids)
            rows.append(row)
    if not rows:
        return None
    return _long(rows, device), _long(local, device), _long(ids, device)


def _banned(params: Sequence[SamplingParams], histories: Sequence[RowHistory], device):
    rows, ids = [], []
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        banned = banned_bad_word_ids(h.output_token_ids, h.bad_words_token_ids)
        if len(h.output_token_ids) < p.min_tokens:
            banned.extend(h.eos_token_ids)
            banned.extend(p.stop_token_ids)
        rows.extend([row] * len(banned))
        ids.extend(banned)
    if not rows:
        return None
    return _long(rows, device), _long(ids, device)


def _penalties(
    params: Sequence[SamplingParams], histories: Sequence[RowHistory], device
) -> Penalties | None:
    rows = [i for i, p in enumerate(params) if has_penalty(p)]
    if not rows:
        return None
    use = [params[i] for i in rows]
    repetition = any(p.repetition_penalty != 1 for p in use)
    return Penalties(
        rows=_long(rows, device),
        repetition=_float([p.repetition_penalty for p in use], device),
        frequency=_float([p.frequency_penalty for p in use], device),
        presence=_float([p.presence_penalty for p in use], device),
        output_tokens=_padded([histories[i].output_token_ids for i in rows], device),
        prompt_tokens=_padded([histories[i].prompt_token_ids for i in rows], device)
        if repetition else None,
    )


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def _padded(lists: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Token lists -> (P, max_len) long padded with -1 (at least one column)."""
    width = max(1, max(len(t) for t in lists))
    return _long([list(t) + [-1] * (width - len(t)) for t in lists], device)


def _long(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
