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

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan, TensorParallel
from llmserve.kernels import native, ptr
from llmserve.models.llama_native import NativeWeight, packed_weight
from llmserve.models.mlp import LlamaMLP
from llmserve.quantization.packed_float import PackedFloatWeight, float_linear


class Router(nn.Module):
    """Scores of every expert for each token: `x @ weight.T`, kept in the model's float
    dtype whatever the linears' quantization (a rounded score could change the experts).
    On the CPU in float32 it runs the native float32 GEMM, whose rows do not depend on the
    batch (torch's GEMM gave a row other last bits in a batch of 7 than alone, and the
    routing weights with them)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self._packed: PackedFloatWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and native() is not None:
            if self._packed is None:  # packed on first use: after the weights were loaded
                self._packed = PackedFloatWeight(self.weight.data)
            return float_linear(x, self._packed)
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
        self.intermediate_size = moe.intermediate_size
        self._native: tuple | None = None  # (gate_up array, down array, workspace width)
        self._native_checked = False
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
        native = self._native_experts(x)
        if native is not None and not self._lora_active():
            slots = self._run_native(native, x, experts, weights)
            slots = self.tp.all_reduce(slots).view(t, self.top_k, hidden)
            return self._sum(x, [slots[:, slot] for slot in range(self.top_k)])
        if t == 1 and self.tp.size == 1:
            return self._one_token(x, experts, weights)
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
        return self._sum(x, [slots[:, slot] for slot in range(self.top_k)])

    def _lora_active(self) -> bool:
        """A LoRA adapter updates the experts this step (`lora/manager.py`'s wrappers)."""
        return getattr(self.experts[0].gate_up_proj.method, "active", False)

    def _native_experts(self, x: torch.Tensor) -> tuple | None:
        """The experts' packed weights as the native kernel reads them (built on first use,
        after the weights were packed), or None: torch's float weights, another device, no
        compiler, a dtype other than float32."""
        if not self._native_checked:
            self._native_checked = True
            lib = native() if x.device.type == "cpu" else None
            weights = [(packed_weight(e.gate_up_proj), packed_weight(e.down_proj))
                       for e in self.experts]
            if lib is not None and all(a is not None and b is not None for a, b in weights):
                gate_up = (NativeWeight * len(weights))(*(a for a, _ in weights))
                down = (NativeWeight * len(weights))(*(b for _, b in weights))
                k_pad = max(getattr(linear.method.weight, "k_pad", 0)
                            for e in self.experts for linear in (e.gate_up_proj, e.down_proj))
                self._native = (lib, gate_up, down, k_pad)
        if self._native is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        return self._native

    def _run_native(self, native: tuple, x: torch.Tensor, experts: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        lib, gate_up, down, k_pad = native
        t, hidden = x.shape
        x = x.contiguous()
        ids, weights = experts.contiguous(), weights.float().contiguous()
        slots = torch.empty(t * self.top_k, hidden)
        scratch = torch.empty(t * (2 * hidden + 3 * self.intermediate_size))
        width = max(k_pad, hidden, self.intermediate_size)
        qscratch = torch.empty(t * (2 * width + width // 4 + 4), dtype=torch.uint8)
        lib.llmserve_moe_experts(
            ptr(x), t, hidden, self.intermediate_size, ctypes.addressof(gate_up),
            ctypes.addressof(down), self.held.start, len(self.held), ptr(ids), ptr(weights),
            self.top_k, ptr(slots), ptr(scratch), ptr(qscratch))
        return slots

    def _one_token(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                   ) -> torch.Tensor:
        """A decode step of one sequence: each chosen expert on the row itself, no
        grouping; the same products and sum order as `forward`'s, so the same bits."""
        outs = [self.experts[expert](x) * weights[:, slot:slot + 1]
                for slot, expert in enumerate(experts[0].tolist())]
        return self._sum(x, outs)

    def _sum(self, x: torch.Tensor, slots: list[torch.Tensor]) -> torch.Tensor:
        """The slots' outputs added in slot (ascending expert) order, then the shared
        expert's."""
        y = slots[0]
        for out in slots[1:]:
            y = y + out
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return y
