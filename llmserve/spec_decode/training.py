"""Training Medusa heads by self-distillation on the CPU (`llmserve train-heads`).

The data is the target's own: its answers (greedy, so each next token is the target's
argmax), its final hidden state at every position of them, and the tokens that follow.
Head i at position p learns the token i + 2 places on, x[p + i + 2], from the hidden state
f[p], where x[p + 1] is the target's own output: what it will see when drafting (the token
just sampled is x[p + 1], head i's draft is the one i + 1 places after it). Medusa-1's
recipe: the target frozen, each head's residual block starting at zero (the head begins as
the target's own next-token guess), the heads sharing the target's LM head (so a head is
one H x H block, a few MB), a cross entropy per head weighted 0.8^i, AdamW.

The acceptance figure is measured on held-out answers the heads never trained on: a round
of k drafts keeps the leading drafts the target's greedy choice agrees with, so the mean
tokens per round is 1 + the mean number of leading heads that are right.
"""

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.nn import functional as F

from llmserve.spec_decode.medusa import MedusaConfig, MedusaHeads

HEAD_WEIGHT_DECAY = 0.8  # head i's loss weighs 0.8^i (Medusa-1)
IGNORE = -100


@dataclass
class Answer:
    """One training sequence: `tokens` (prompt, then the target's answer) and the target's
    final hidden states at each position (T, H); positions before `first` hold the prompt."""

    tokens: list[int]
    hidden: torch.Tensor
    first: int  # the answer's first token
    prompt: int = 0  # which prompt it answers (answers to one prompt are held out together)
    sampled: bool = False  # a sampled answer, not the greedy one (trained on, not measured)


def save_answers(answers: list[Answer], path: str | Path, meta: dict[str, str]) -> None:
    """Answers in one safetensors file (their tokens and hidden states end to end), so
    that training can run again without generating them (`load_answers`)."""
    tensors = {
        "tokens": torch.tensor([t for a in answers for t in a.tokens], dtype=torch.long),
        "lengths": torch.tensor([len(a.tokens) for a in answers], dtype=torch.long),
        "firsts": torch.tensor([a.first for a in answers], dtype=torch.long),
        "prompts": torch.tensor([a.prompt for a in answers], dtype=torch.long),
        "sampled": torch.tensor([a.sampled for a in answers], dtype=torch.bool),
        "hidden": torch.cat([a.hidden.float() for a in answers]).contiguous()}
    save_file(tensors, str(path), metadata=meta)


def load_answers(path: str | Path, hidden_size: int) -> tuple[list[Answer], dict[str, str]]:
    """What `save_answers` wrote, checked against the target's hidden size."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path}: {e}") from None
    names = ("tokens", "lengths", "firsts", "prompts", "sampled", "hidden")
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{path}: not a train-heads dataset (no {missing[0]!r})")
    hidden, lengths = tensors["hidden"], tensors["lengths"]
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"{path}: hidden states of width {tuple(hidden.shape)[1:]}, the "
                         f"model's are {hidden_size}")
    if int(lengths.sum()) != len(tensors["tokens"]) or len(hidden) != len(tensors["tokens"]):
        raise ValueError(f"{path}: its tokens, hidden states and lengths disagree")
    answers, at = [], 0
    for n, first, prompt, sampled in zip(lengths.tolist(), tensors["firsts"].tolist(),
                                         tensors["prompts"].tolist(),
                                         tensors["sampled"].tolist(), strict=True):
        answers.append(Answer(tensors["tokens"][at:at + n].tolist(), hidden[at:at + n],
                              first, prompt, sampled))
        at += n
    return answers, meta


class HiddenRecorder:
    """Stands in for the runner's proposer while the target answers (`train-heads`): it
    drafts nothing and keeps the final hidden rows of every position the target computes,
    per request, so the answers' hidden states come out of their own generation (a
    second forward over them cost train-heads a third of its data time). Each chunk is
    kept by its first position: a preempted request's recomputed chunks replace or sit
    beside the earlier ones, the same rows either way. Prefix caching must be off (a
    cached prefix is never computed)."""

    needs_hidden = True
    reads_aux_hidden = False
    feeds_every_chunk = True

    def __init__(self) -> None:
        self.chunks: dict[str, dict[int, torch.Tensor]] = {}

    def propose(self, seeds) -> list[list[int]]:
        for s in seeds:
            if s.hidden is not None and len(s.hidden):
                self.chunks.setdefault(s.request_id, {})[s.start_position] = \
                    s.hidden.float().clone()
        return [[] for _ in seeds]

    def remove(self, request_id: str) -> None:
        pass  # the rows are kept until `take` reads them

    def take(self, request_id: str, count: int) -> torch.Tensor:
        """The rows (count, H) of positions 0 .. count - 1 of a request, dropped here;
        a ValueError if one was never computed."""
        chunks = self.chunks.pop(request_id, {})
        rows, at = [], 0
        while at < count:
            chunk = chunks.get(at)
            if chunk is None:
                raise ValueError(f"request {request_id}: no hidden state computed at "
                                 f"position {at}")
            rows.append(chunk[: count - at])
            at += len(rows[-1])
        return torch.cat(rows)


def split_held_out(answers: list[Answer], share: float) -> tuple[list[Answer], list[Answer]]:
    """(train, held out): the answers to round(share x the prompts) prompts are kept from
    training, and their greedy ones measure the acceptance (a greedy round verifies
    against the target's greedy choice). A prompt is its tokens, and the ones held out are
    the first by a hash of them: the same prompt falls on the same side whichever file
    and place it comes from (a split by prompt number held out a prompt in one
    `--dataset` that another trained on: two self-prompted datasets shared 279 of 306)."""
    prompts = sorted({tuple(a.tokens[:a.first]) for a in answers}, key=_prompt_digest)
    held = set(prompts[:round(len(prompts) * share)]) if share > 0 else set()
    return ([a for a in answers if tuple(a.tokens[:a.first]) not in held],
            [a for a in answers if tuple(a.tokens[:a.first]) in held and not a.sampled])


def _prompt_digest(tokens: tuple[int, ...]) -> bytes:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()


@dataclass
class TrainingResult:
    heads: MedusaHeads
    steps: int
    seconds: float
    train_positions: int
    held_out_positions: int
    losses: list[float] = field(default_factory=list)  # per step
    # mean tokens per round with all heads drafting, on the held-out answers (1 = none kept)
    held_out_tokens_per_round: float = 1.0
    held_out_accuracy: list[float] = field(default_factory=list)  # per head


def positions(answers: list[Answer], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position whose next token is the target's own: its hidden state (N, H) and
    the tokens each head should propose there (N, num_heads; IGNORE past the end)."""
    rows, labels = [], []
    for a in answers:
        n = len(a.tokens)
        start = max(a.first - 1, 0)
        if n - start < 3:
            continue
        ps = torch.arange(start, n - 2)  # head 0 needs x[p + 2]
        rows.append(a.hidden[ps])
        tokens = torch.tensor(a.tokens + [IGNORE] * num_heads)
        labels.append(torch.stack([tokens[ps + i + 2] for i in range(num_heads)], dim=1))
    if not rows:
        hidden = answers[0].hidden.shape[1] if answers else 0
        return torch.zeros(0, hidden), torch.zeros(0, num_heads, dtype=torch.long)
    return torch.cat(rows).float(), torch.cat(labels)


def new_heads(num_heads: int, hidden_size: int, vocab_size: int,
              lm_head: torch.Tensor) -> MedusaHeads:
    """Heads on the frozen LM head `lm_head` (V, H), each block zero: the identity."""
    config = MedusaConfig(num_heads, 1, True, True, None, hidden_size, vocab_size)
    weight = lm_head.detach().float()
    heads = MedusaHeads(config, hidden_size, vocab_size, lambda x: F.linear(x, weight), False)
    with torch.no_grad():
        for p in heads.parameters():
            p.zero_()
    return heads


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int
                  ) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate over `steps`: a warm-up over the first 5 %, then a cosine decay
    to a tenth of the peak."""
    warmup = max(1, steps // 20)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, rate)


def training_dtype(name: str = "auto") -> torch.dtype:
    """The dtype the heads' matrix products train in: `auto` is bfloat16 where the CPU
    multiplies bf16 matrices in hardware (AMX, AVX512-BF16: an EAGLE step of SmolLM2-135M's
    shape 1.57 -> 0.50 s on a 2-core Sapphire Rapids), float32 elsewhere (bf16 is emulated
    there). The weights and the optimiser stay float32 either way (autocast)."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    from llmserve.cpu_info import cpu_features

    fast = {"amx_bf16", "avx512_bf16"} & cpu_features()
    return torch.bfloat16 if fast else torch.float32


def autocast(dtype: torch.dtype):
    """A training step's forward in `dtype` (bfloat16: torch's CPU autocast; float32: as
    written)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def after_step(losses: list[float], loss: torch.Tensor, step: int, steps: int, model,
               progress: Callable[[int, float], None] | None,
               checkpoint: Callable | None, checkpoint_every: int) -> None:
    """Record a step's loss, report it, and write a checkpoint every `checkpoint_every`
    steps (not at the last: the caller writes the result)."""
    losses.append(loss.item())
    if progress is not None:
        progress(step, losses[-1])
    if checkpoint is not None and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
        checkpoint(model, step + 1)


def train_medusa(train: list[Answer], held_out: list[Answer], lm_head: torch.Tensor,
                 num_heads: int = 4, steps: int = 600, batch_size: int = 64,
                 lr: float = 1e-3, seed: int = 0,
                 progress: Callable[[int, float], None] | None = None,
                 checkpoint: Callable[[MedusaHeads, int], None] | None = None,
                 checkpoint_every: int = 200,
                 dtype: torch.dtype = torch.float32) -> TrainingResult:
    """Train `num_heads` Medusa heads on `train`; `progress(step, loss)` after each step,
    `checkpoint(heads, step)` every `checkpoint_every` steps."""
    torch.manual_seed(seed)
    hidden_size, vocab_size = lm_head.shape[1], lm_head.shape[0]
    heads = new_heads(num_heads, hidden_size, vocab_size, lm_head)
    rows, labels = positions(train, num_heads)
    if not len(rows):
        raise ValueError("no answer is long enough to train on (each needs 3 tokens)")
    weights = [HEAD_WEIGHT_DECAY ** i for i in range(num_heads)]
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    scheduler = warmup_cosine(optimizer, steps)
    result = TrainingResult(heads, steps, 0.0, len(rows), 0)
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = torch.randint(len(rows), (batch_size,), generator=generator)
        x, y = rows[batch], labels[batch]
        loss = torch.zeros(())
        with autocast(dtype):
            for i in range(num_heads):
                keep = y[:, i] != IGNORE
                if keep.any():
                    logits = heads.logits(i, x[keep])
                    loss = loss + weights[i] * F.cross_entropy(logits, y[keep, i])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        after_step(result.losses, loss, step, steps, heads, progress, checkpoint,
                   checkpoint_every)
    result.seconds = time.perf_counter() - start
    rows, labels = positions(held_out, num_heads)
    if len(rows):
        result.held_out_positions = len(rows)
        result.held_out_tokens_per_round, result.held_out_accuracy = evaluate(
            heads, rows, labels)
    return result


@torch.no_grad()
def evaluate(heads: MedusaHeads, rows: torch.Tensor, labels: torch.Tensor,
             chunk: int = 256) -> tuple[float, list[float]]:
    """(Mean tokens per round with every head drafting, each head's accuracy) at these
    positions: a round keeps the leading heads that are right, then the target's token."""
    num_heads = labels.shape[1]
    right = torch.zeros(len(rows), num_heads, dtype=torch.bool)
    for lo in range(0, len(rows), chunk):
        x = rows[lo:lo + chunk]
        for i in range(num_heads):
            right[lo:lo + chunk, i] = heads.logits(i, x).argmax(-1) == labels[lo:lo + chunk, i]
    valid = labels != IGNORE
    leading = torch.cumprod((right & valid).int(), dim=1).sum(dim=1)  # leading heads right
    accuracy = [float(right[valid[:, i], i].float().mean()) if valid[:, i].any() else 0.0
                for i in range(num_heads)]
    return 1.0 + float(leading.float().mean()), accuracy
