"""Training an EAGLE-1 head by self-distillation on the CPU (`llmserve train-heads --method
eagle`).

The data is the target's own, as for Medusa (`training.Answer`): token sequences, the
target's final hidden state f[p] at every position, and the embedding of every token. The
head reads (x[p + 1], f[p]) at position p and is trained, teacher-forced over whole
sequences with causal attention, as EAGLE-1 is: its output g[p] regresses onto the
target's next feature f[p + 1] (smooth L1, weight 1) and its logits onto the target's own
distribution there, softmax(lm_head(f[p + 1])) (cross entropy, weight 0.1), with uniform
noise on the input features so that it keeps drafting from its own, imperfect ones.

Logits are over a draft vocabulary: the training answers' most frequent tokens (EAGLE-3's
`d2t` layout, `eagle.py`), the target's distribution renormalised over them. The LM head
rows are the target's, frozen; on a small model they are most of a draft step's cost.

The held-out figure drafts chains as the proposer does: at every answer position p, with
the head's K/V over the true sequence up to p, the first draft from g[p], then each next
one from (the draft, the head's own output) one position on, attending to the true prefix
and the chain so far; a round keeps the leading drafts equal to the target's tokens.
"""

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

from llmserve.config.model import ModelConfig
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.quantization.int8 import quantize_rows
from llmserve.spec_decode.eagle import WEIGHT_FILE, eagle_head_config
from llmserve.spec_decode.training import Answer, after_step, autocast, warmup_cosine

FEATURE_LOSS, TOKEN_LOSS = 1.0, 0.1  # EAGLE-1's weights
NOISE = 0.2  # uniform noise of this width on the input features (EAGLE-1's)
STEP_WEIGHT = 0.8  # chain step s's loss weighs 0.8^s (EAGLE-3's)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, d)
        self.q_proj = nn.Linear(h, self.heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)


@dataclass
class Keys:
    """Rotated keys and values (B, kv_heads, T, head_dim) of some positions."""

    k: torch.Tensor
    v: torch.Tensor


class TrainableEagle(nn.Module):
    """An EAGLE-1 head (fc, one Llama decoder layer without its input norm) in plain torch,
    over whole float32 sequences with causal attention; its `state_dict` holds the
    checkpoint's names (`fc.weight`, `layers.0.*`), which `eagle.load_eagle_head` reads.
    Rotary positions are the runtime head's own tables."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([_Layer(cfg)])
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        self.register_buffer("cos", rotary.cos_cache.float(), persistent=False)
        self.register_buffer("sin", rotary.sin_cache.float(), persistent=False)
        with torch.no_grad():  # Hugging Face's initialisation of a Llama layer
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.02)
                    if module.bias is not None:
                        module.bias.zero_()

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, heads, T, d) turned by positions (T,) or (B, T)."""
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.dim() == 1:
            cos, sin = cos[None, None], sin[None, None]
        else:
            cos, sin = cos[:, None], sin[:, None]
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + turned * sin

    def _project(self, embeds: torch.Tensor, features: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Keys]:
        """(B, T, H) inputs -> fc's output x, the queries and this step's keys."""
        attn = self.layers[0].self_attn
        x = self.fc(torch.cat([embeds, features], dim=-1))
        b, t, _ = x.shape

        def heads(proj: nn.Linear, n: int) -> torch.Tensor:
            return proj(x).view(b, t, n, attn.head_dim).transpose(1, 2)

        q = self._rotate(heads(attn.q_proj, attn.heads), positions)
        k = self._rotate(heads(attn.k_proj, attn.kv_heads), positions)
        return x, q, Keys(k, heads(attn.v_proj, attn.kv_heads))

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual, the MLP block: attended (B, heads, T, d) -> (B, T, H)."""
        layer = self.layers[0]
        b, _, t, _ = attended.shape
        x = x + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _grouped(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.repeat_interleave(self.config.num_attention_heads
                                    // self.config.num_key_value_heads, dim=1)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor,
                return_keys: bool = False) -> torch.Tensor | tuple[torch.Tensor, Keys]:
        """(B, T, H) embeddings of x[p + 1] and features f[p] at positions 0 .. T - 1 ->
        the head's outputs g (B, T, H) [and its keys]."""
        positions = torch.arange(embeds.shape[1], device=embeds.device)
        x, q, keys = self._project(embeds, features, positions)
        attended = F.scaled_dot_product_attention(q, self._grouped(keys.k),
                                                  self._grouped(keys.v), is_causal=True)
        out = self._finish(x, attended)
        return (out, keys) if return_keys else out

    def chain_step(self, embeds: torch.Tensor, features: torch.Tensor,
                   positions: torch.Tensor, prefix: Keys, chain: list[Keys]
                   ) -> tuple[torch.Tensor, Keys]:
        """One draft step at every position of B sequences at once: row p (of T) is the
        chain drafted after position p, now at `positions[p]`; it attends to the true
        prefix's keys 0 .. p (`prefix`, (B, kv, T, d)) and to its own chain's earlier
        steps (`chain`, each (B, kv, T, d)) and itself. Returns (B, T, H) and its keys."""
        x, q, keys = self._project(embeds, features, positions[None])
        scale = self.config.head_dim ** -0.5
        t = q.shape[2]
        true_scores = q @ self._grouped(prefix.k).transpose(-1, -2) * scale  # (B, h, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        true_scores = true_scores.masked_fill(~causal, float("-inf"))
        steps = [*chain, keys]
        own = torch.stack([(q * self._grouped(s.k)).sum(-1) * scale for s in steps],
                          dim=-1)  # (B, h, T, steps)
        weights = torch.cat([true_scores, own], dim=-1).softmax(dim=-1)
        attended = weights[..., :t] @ self._grouped(prefix.v)
        for i, s in enumerate(steps):
            attended = attended + weights[..., t + i, None] * self._grouped(s.v)
        return self._finish(x, attended), keys


@dataclass
class DraftVocabulary:
    """The tokens a head drafts: target ids in ascending order, their LM head rows and
    their embedding rows (a draft's input to the next step)."""

    ids: torch.Tensor  # (D,) long
    lm_head: torch.Tensor  # (D, H), the target's rows
    embeds: torch.Tensor  # (D, H)

    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(len(self.ids))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lm_head)


def draft_vocabulary(answers: list[Answer], lm_head: torch.Tensor,
                     embed: Callable[[list[int]], torch.Tensor], size: int
                     ) -> DraftVocabulary:
    """The `size` most frequent tokens of the answers (ties: the lower id), all of them if
    fewer, in ascending id order, with the target's LM head rows (V, H) and embedding
    rows (`embed`, as for `eagle_sequences`)."""
    counts = Counter(t for a in answers for t in a.tokens)
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    ids = sorted(t for t, _ in top)
    return DraftVocabulary(torch.tensor(ids, dtype=torch.long),
                           lm_head.detach().float()[ids].contiguous(), embed(ids))


@dataclass
class EagleSequence:
    """One answer as the head sees it: inputs (x[p + 1], f[p]) at p = 0 .. n - 2 and the
    next features f[p + 1]; `first` the first position drafting happens at."""

    embeds: torch.Tensor  # (n - 1, H)
    features: torch.Tensor  # (n - 1, H)
    targets: torch.Tensor  # (n - 1, H)
    tokens: list[int]
    first: int


def eagle_sequences(answers: list[Answer], embed: Callable[[list[int]], torch.Tensor]
                    ) -> list[EagleSequence]:
    """Answers of 3 tokens or more as training sequences; `embed` gives the target's
    embedding rows of token ids, as float32."""
    out = []
    for a in answers:
        if len(a.tokens) < 3:
            continue
        hidden = a.hidden.float()
        out.append(EagleSequence(embed(a.tokens[1:]), hidden[:-1], hidden[1:], a.tokens,
                                 max(a.first - 1, 0)))
    return out


@dataclass
class EagleResult:
    head: TrainableEagle
    vocabulary: DraftVocabulary
    steps: int
    seconds: float
    train_positions: int
    held_out_positions: int
    losses: list[float] = field(default_factory=list)
    held_out_tokens_per_round: float = 1.0
    # the share of rounds whose first i + 1 drafts are all right, i = 0 .. depth - 1
    held_out_accuracy: list[float] = field(default_factory=list)
    train_tokens_per_round: float | None = None  # the same on training answers


def _batch(seqs: list[EagleSequence]) -> tuple[torch.Tensor, ...]:
    """Sequences padded at the end (causal attention: padding never reaches a real
    position) -> embeds, features, targets (B, T, H) and a mask of the positions the loss
    counts: from each sequence's `first` (the prompt's last position; as EAGLE, the loss
    covers the answers, the prompt only feeds attention) to its end."""
    t = max(len(s.embeds) for s in seqs)
    h = seqs[0].embeds.shape[1]
    embeds, features, targets = (torch.zeros(len(seqs), t, h) for _ in range(3))
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s.embeds)
        embeds[b, :n], features[b, :n], targets[b, :n] = s.embeds, s.features, s.targets
        mask[b, s.first:n] = True
    return embeds, features, targets, mask


def train_eagle(train: list[EagleSequence], held_out: list[EagleSequence],
                cfg: ModelConfig, vocabulary: DraftVocabulary, steps: int = 600,
                batch_size: int = 4, lr: float = 3e-4, depth: int = 4, seed: int = 0,
                progress: Callable[[int, float], None] | None = None,
                checkpoint: Callable[[TrainableEagle, int], None] | None = None,
                checkpoint_every: int = 200, unroll: int = 1,
                train_measured: list[EagleSequence] | None = None,
                dtype: torch.dtype = torch.float32,
                init: TrainableEagle | None = None) -> EagleResult:
    """Train a head on `train` (`batch_size` sequences a step); the held-out chains draft
    up to `depth` tokens. `unroll` > 1 also trains the chain's next steps from the
    head's own features (`chain_losses`); `train_measured`: training sequences whose
    figure is reported beside the held-out one (how far the head overfits); `dtype` the
    matrix products' (`training.training_dtype`); `init`: a head to go on training
    (`resume_eagle`, with its own vocabulary) instead of a fresh one."""
    if not train:
        raise ValueError("no answer is long enough to train on (each needs 3 tokens)")
    torch.manual_seed(seed)
    head = TrainableEagle(cfg) if init is None else init
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    scheduler = warmup_cosine(optimizer, steps)
    result = EagleResult(head, vocabulary, steps, 0.0,
                         sum(len(s.embeds) - s.first for s in train), 0)
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    start = time.perf_counter()
    for step in range(steps):
        if len(order) < batch_size:  # epochs in a fresh order each
            order += torch.randperm(len(train), generator=generator).tolist()
        picked, order = order[:batch_size], order[batch_size:]
        embeds, features, targets, mask = _batch([train[i] for i in picked])
        noise = (torch.rand(features.shape, generator=generator) - 0.5) * NOISE
        with autocast(dtype):
            losses = chain_losses(head, vocabulary, embeds, features + noise, targets, mask,
                                  unroll)
            loss = sum(STEP_WEIGHT ** s * term for s, term in enumerate(losses))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        after_step(result.losses, loss, step, steps, head, progress, checkpoint,
                   checkpoint_every)
    result.seconds = time.perf_counter() - start
    result.held_out_positions, result.held_out_tokens_per_round, result.held_out_accuracy = \
        measure(head, vocabulary, held_out, depth)
    if train_measured:
        result.train_tokens_per_round = measure(head, vocabulary, train_measured, depth)[1]
    return result


def _shifted(x: torch.Tensor, s: int) -> torch.Tensor:
    """x (B, T, ...) moved s places earlier along T, the end padded with zeros."""
    return torch.cat([x[:, s:], torch.zeros_like(x[:, :s])], dim=1)


def chain_losses(head: TrainableEagle, vocabulary: DraftVocabulary, embeds: torch.Tensor,
                 features: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                 unroll: int) -> list[torch.Tensor]:
    """The loss of each of `unroll` chain steps over a batch (`_batch`), each a mean over
    its positions: step 0 is EAGLE-1's, teacher-forced; step s > 0 (as HASS and EAGLE-3
    train) at row p reads the true token x[p + 1 + s] beside the head's own step s - 1
    output, at position p + s, attending to the true prefix and its chain
    (`chain_step`), and learns f[p + 1 + s]. Training weighs step s STEP_WEIGHT^s."""
    out, prefix = head(embeds, features, return_keys=True)
    # step s learns the rows of the same positions q (those `mask` counts) that are at
    # least s: the target's distribution there is computed once
    wanted = targets[mask]
    with torch.no_grad():
        target_p = vocabulary.logits(wanted).softmax(dim=-1)
    t = embeds.shape[1]
    q = torch.arange(t).expand(mask.shape)[mask]
    losses = [_step_loss(vocabulary, out[mask], wanted, target_p)]
    chain: list[Keys] = []
    for s in range(1, unroll):
        valid = _shifted(mask, s)
        if not valid.any():
            break
        positions = (torch.arange(t) + s).clamp(max=head.cos.shape[0] - 1)
        out, keys = head.chain_step(_shifted(embeds, s), out, positions, prefix, chain)
        chain.append(keys)
        rows = q >= s
        losses.append(_step_loss(vocabulary, out[valid], wanted[rows], target_p[rows]))
    return losses


def _step_loss(vocabulary: DraftVocabulary, out: torch.Tensor, targets: torch.Tensor,
               target_p: torch.Tensor) -> torch.Tensor:
    """The head's rows `out` against the target's features `targets` there and its
    distribution over the draft vocabulary `target_p`."""
    feature_loss = F.smooth_l1_loss(out, targets)
    token_loss = -(target_p * vocabulary.logits(out).log_softmax(dim=-1)).sum(-1).mean()
    return FEATURE_LOSS * feature_loss + TOKEN_LOSS * token_loss


def measure(head: TrainableEagle, vocabulary: DraftVocabulary, seqs: list[EagleSequence],
            depth: int) -> tuple[int, float, list[float]]:
    """(Positions, mean tokens per round, the share of rounds whose first i + 1 drafts are
    right) of chains of `depth` drafted after every answer position of `seqs`."""
    if not seqs:
        return 0, 1.0, []
    right = torch.cat([chain_drafts(head, vocabulary, s, depth)[1] for s in seqs])
    if not len(right):
        return 0, 1.0, []
    leading = torch.cumprod(right.int(), dim=1)
    return (len(right), 1.0 + float(leading.sum(1).float().mean()),
            leading.float().mean(0).tolist())


@torch.no_grad()
def chain_drafts(head: TrainableEagle, vocabulary: DraftVocabulary, seq: EagleSequence,
                 depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafts (P, depth) of a chain after every answer position p >= `seq.first` whose
    token after next is known, as the proposer drafts them, whether each is the
    sequence's own token there (False past its end), and the head's own chance that the
    chain is right through each (the product of its drafts' probabilities, what the
    proposer cuts its chains by: `DraftSeed.min_chance`)."""
    n = len(seq.embeds)  # inputs at p = 0 .. n - 1; x[p + 2] is known for p <= n - 2
    out, prefix = head(seq.embeds[None], seq.features[None], return_keys=True)
    g = out[0]  # (n, H)
    tokens = torch.tensor(seq.tokens)
    drafts = torch.zeros(n, depth, dtype=torch.long)
    chance = torch.ones(n, depth)
    chain: list[Keys] = []
    features = g
    for step in range(depth):
        logits = vocabulary.logits(features)
        rows = logits.argmax(-1)  # draft vocabulary rows
        p = logits.softmax(-1).gather(-1, rows[:, None])[:, 0]
        drafts[:, step] = vocabulary.ids[rows]
        chance[:, step] = p * (chance[:, step - 1] if step else 1.0)
        if step + 1 == depth:
            break
        # the next input: (this draft, these features) one position further on
        positions = (torch.arange(n) + step + 1).clamp(max=head.cos.shape[0] - 1)
        x, keys = head.chain_step(vocabulary.embeds[rows][None], features[None], positions,
                                  prefix, chain)
        chain.append(keys)
        features = x[0]
    rows = torch.arange(seq.first, max(seq.first, n - 1))
    index = rows[:, None] + 2 + torch.arange(depth)[None]  # the token each draft guesses
    known = index < len(tokens)
    right = known & (drafts[rows] == tokens[index.clamp(max=len(tokens) - 1)])
    return drafts[rows], right, chance[rows]



def resume_eagle(folder: str | Path, cfg: ModelConfig, lm_head: torch.Tensor,
                 embed: Callable[[list[int]], torch.Tensor]
                 ) -> tuple[TrainableEagle, DraftVocabulary]:
    """A head `save_eagle_head` wrote (full or compact) for the target of `cfg`, to go on
    training, with its draft vocabulary (`d2t`'s ids, the target's `lm_head` rows (V, H)
    and `embed` rows); a HeadsFormatError where it is not such a head."""
    from safetensors.torch import load_file

    from llmserve.spec_decode.eagle import dequantized_head_tensors, read_eagle_config
    from llmserve.spec_decode.medusa import HeadsFormatError

    folder = Path(folder)
    head_cfg, _ = read_eagle_config(folder)
    if head_cfg.hidden_size != cfg.hidden_size or head_cfg.num_hidden_layers != 1:
        raise HeadsFormatError(f"{folder}: not a one-layer head of hidden size "
                               f"{cfg.hidden_size}")
    try:
        tensors = dequantized_head_tensors(load_file(folder / WEIGHT_FILE), folder)
    except (OSError, ValueError) as e:
        raise HeadsFormatError(f"{folder / WEIGHT_FILE}: {e}") from None
    if "d2t" not in tensors:
        raise HeadsFormatError(f"{folder}: no draft vocabulary (d2t) to go on with")
    ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"].long()
    head = TrainableEagle(cfg)
    state = {k: v for k, v in tensors.items() if k not in ("d2t", "lm_head.weight")}
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise HeadsFormatError(f"{folder}: {e}") from None
    ids_list = ids.tolist()
    return head, DraftVocabulary(ids, lm_head[ids].contiguous(), embed(ids_list))


def save_eagle_head(head: TrainableEagle, vocabulary: DraftVocabulary, target: ModelConfig,
                    folder: str | Path, extra: dict | None = None,
                    compact: bool = False) -> Path:
    """Write a head as `eagle.load_eagle_head` reads it: config.json (a one-layer Llama
    config with `draft_vocab_size`; `extra` under "llmserve", how it was made) and
    model.safetensors (`fc`, `layers.0.*`, the draft vocabulary's `lm_head.weight` and
    `d2t`). `compact`: its matrices in int8 with a float scale per row (`name_scale`;
    the engine runs them in int8 anyway) and no `lm_head.weight`, the target's own rows
    (an eighth of the size: SmolLM2-135M's head 34 -> 4.3 MiB). Each file is replaced
    whole (a checkpoint written while training is never half a file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous() for k, v in head.state_dict().items()}
    if compact:
        for name in [n for n, t in tensors.items() if t.dim() == 2]:
            codes, scale = quantize_rows(tensors[name])
            tensors[name], tensors[name + "_scale"] = codes, scale[:, 0].contiguous()
    else:
        tensors["lm_head.weight"] = vocabulary.lm_head.contiguous()
    tensors["d2t"] = vocabulary.d2t()
    weights = folder / WEIGHT_FILE
    save_file(tensors, str(weights) + ".tmp")
    Path(str(weights) + ".tmp").replace(weights)
    config = eagle_head_config(target, 1, len(vocabulary.ids))
    if extra:
        config["llmserve"] = extra
    config_file = folder / "config.json"
    Path(str(config_file) + ".tmp").write_text(json.dumps(config, indent=2) + "\n")
    Path(str(config_file) + ".tmp").replace(config_file)
    return folder

