"""Verifying draft tokens against the target model, batched and lossless.

One request has k draft tokens x_1..x_k, proposed with probabilities q_1..q_k (a point mass
for drafts copied from the text, `draft_probs=None`), and the target's probabilities
p_1..p_{k+1} at the same positions, already processed (temperature, top-k/p, min-p,
penalties, grammar masks). The rule (Leviathan et al. 2023; Chen et al. 2023):

* accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order;
* at the first rejection, emit a token drawn from norm(max(0, p_i - q_i)) and stop;
* when all k are accepted, emit a bonus token drawn from p_{k+1}.

Each emitted token is then distributed exactly as the target's would be without drafts.
Greedy rows (temperature 0: p a point mass at the target's argmax) accept exactly the drafts
equal to the argmax and emit the argmax where they stop, so their output is token for token
the non-speculative one.

Randomness: per row, one uniform per draft, then one for the final draw (the sampler's
`draw`), all from the row's generator when it has one, so seeded requests reproduce.
"""

import torch

from llmserve.worker.sampler import draw


def verify(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: list[int],
    greedy: list[bool],
    generators: list[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
) -> list[list[int]]:
    """The tokens each row emits: its accepted drafts, then one more (1 to k + 1 tokens).

    target_probs: (B, K + 1, V); draft_tokens: (B, K) (row b's first num_drafts[b] are
    its drafts); draft_probs: (B, K, V), or None for point-mass drafts. Greedy rows need
    only the target's argmax: `target_argmax` (B, K + 1) when given (the sampler's own
    argmax of the processed logits, ties broken as it breaks them), else that of
    `target_probs`.
    """
    batch, width, vocab = target_probs.shape
    k_max = width - 1
    device = target_probs.device
    counts = torch.tensor(num_drafts, device=device)
    positions = torch.arange(k_max, device=device)
    tokens = draft_tokens.long().clamp(0, vocab - 1)
    p_draft = target_probs[:, :k_max].gather(2, tokens[:, :, None])[:, :, 0]  # (B, K)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, tokens[:, :, None])[:, :, 0]
    uniforms = _uniforms(batch, k_max, num_drafts, generators, device)
    accepted = uniforms * q_draft < p_draft  # u < p / q, without dividing by q
    if target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)  # (B, K + 1)
    greedy_t = torch.tensor(greedy, dtype=torch.bool, device=device)
    accepted = torch.where(greedy_t[:, None], tokens == target_argmax[:, :k_max], accepted)
    accepted &= positions[None, :] < counts[:, None]
    # how many drafts each row keeps: up to its first rejection
    kept = accepted.long().cumprod(dim=1).sum(dim=1)  # (B,)
    rejected = kept < counts
    rows = torch.arange(batch, device=device)
    final = target_probs[rows, kept]  # (B, V): where the row stops
    if k_max > 0:  # a rejected row draws from norm(max(0, p - q)) at its rejected draft
        stop = kept.clamp(max=k_max - 1)
        if draft_probs is None:  # q a point mass at the draft: p without it
            residual = final.clone()
            residual[rows, tokens[rows, stop]] = 0.0
        else:
            residual = (final - draft_probs[rows, stop]).clamp(min=0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final)
        final = torch.where(rejected[:, None], residual, final)
    drawn = draw(final, generators)
    last = torch.where(greedy_t, target_argmax[rows, kept], drawn)
    out = []
    for b in range(batch):
        n = int(kept[b])
        out.append(tokens[b, :n].tolist() + [int(last[b])])
    return out


def _uniforms(batch: int, k: int, num_drafts: list[int],
              generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """(B, K) uniforms; a seeded row takes exactly its num_drafts from its generator (none
    when it has no drafts, so its draw matches the plain sampler's)."""
    u = torch.rand(batch, k, device=device)
    for row, gen in enumerate(generators):
        if gen is not None and num_drafts[row]:
            u[row, : num_drafts[row]] = torch.rand(num_drafts[row], generator=gen,
                                                   device=device)
    return u

