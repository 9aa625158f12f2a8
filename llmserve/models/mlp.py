"""The gated MLP of the Llama family (and each expert of a mixture, `moe.py`)."""

import torch
from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan, TensorParallel
from llmserve.layers.activation import gelu_tanh_and_mul, silu_and_mul
from llmserve.layers.linear import Linear

ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class LlamaMLP(nn.Module):
    """Gated MLP (SiLU, or tanh-GELU for Gemma) over this rank's intermediate channels;
    down_proj's partial sums are all-reduced over the ranks."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None,
                 intermediate_size: int | None = None) -> None:
        """`intermediate_size`: another width than the config's (an expert's), whole on
        every rank (no `plan`)."""
        super().__init__()
        self.tp = plan.tp if plan is not None else TensorParallel()
        self.intermediate_size = len(plan.mlp) if plan else (
            intermediate_size or cfg.intermediate_size)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size)
        self.act_and_mul = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.row_parallel(self.down_proj, self.act_and_mul(self.gate_up_proj(x)))
