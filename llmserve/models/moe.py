"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), one decoder layer's.

A linear router scores every expert for each token; the token goes to its `top_k` best
(softmax over all experts, then the chosen ones' probabilities, renormalised to sum 1 where
the family does it). The step's tokens are grouped by expert, and each expert's gated MLP
runs once over all of its tokens: its GEMMs are the dense path's `Linear`s, so the
quantized formats and every instruction-set level apply to experts unchanged. A token's
output is the sum of its experts' outputs times their weights, added in ascending expert
order (as Hugging Face adds them), plus the shared expert behind its sigmoid gate where the
family has one (Qwen2-MoE).

Batch invariance: a token's experts, weights and sum order depend on its own row alone, and
each expert's GEMM gives a row the same bits whatever other rows it runs with (as every
linear of the dense path). Under tensor parallelism each rank holds a contiguous range of
experts (`ShardPlan.experts`) and fills the (token, slot) outputs of its own experts; the
ranks' slot tensors are summed (every slot is non-zero on one rank only, so the sum is
exact) and each rank adds the slots in the same order as one process does: bit for bit
the single-process output.
"""

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan, TensorParallel
from llmserve.models.mlp import LlamaMLP


class Router(nn.Module):
    """Scores of every expert for each token: `x @ weight.T`, kept in the model's float
    dtype whatever the linears' quantization (a rounded score could change the experts)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Parameter names follow Hugging Face's Qwen-MoE layout: `gate` (the router),
    `experts.{e}.gate_up_proj` / `.down_proj` (gate and up fused, as the dense MLP),
    `shared_expert.*` and `shared_expert_gate`."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None) -> None:
        super().__init__()
        moe = cfg.moe
        self.tp = plan.tp if plan is not None else TensorParallel()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize = moe.norm_topk_prob
        self.held = plan.experts if plan is not None else range(moe.num_experts)
        self.gate = Router(moe.num_experts, cfg.hidden_size)
        self.experts = nn.ModuleList(LlamaMLP(cfg, None, moe.intermediate_size)
                                     for _ in self.held)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:  # every rank holds all of it: no sum across ranks
            self.shared_expert = LlamaMLP(cfg, None, moe.shared_intermediate_size)
            self.shared_expert_gate = Router(1, cfg.hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> each token's experts (T, top_k), ascending, and their weights."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts, order = experts.sort(dim=-1)
        return experts, weights.gather(1, order).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        experts, weights = self.route(x)
        slots = x.new_zeros(t * self.top_k, hidden)  # (token, slot) rows
        flat = experts.flatten()
        by_expert = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        start = 0
        for expert, count in enumerate(counts):
            rows = by_expert[start:start + count]
            start += count
            if count == 0 or expert not in self.held:
                continue
            out = self.experts[expert - self.held.start](x[rows // self.top_k])
            slots[rows] = out * flat_weights[rows, None]
        slots = self.tp.all_reduce(slots).view(t, self.top_k, hidden)
        y = slots[:, 0]
        for slot in range(1, self.top_k):
            y = y + slots[:, slot]
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return y
