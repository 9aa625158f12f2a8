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

On the CPU in float32 with the native kernels the whole layer is one call
(`kernels/moe.cpp`: router, routing, experts, shared expert, sums), the one the decoder
stack makes (`llama_native.py`); under tensor parallelism its pieces run with the slots'
all-reduce between them. The routing and the sums are the native ones wherever the native
kernels run, so every path gives the same bits.
"""

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan, TensorParallel
from llmserve.kernels import Kernels, native, ptr
from llmserve.layers.linear import Linear
from llmserve.models.llama_native import NativeWeight, float_weight, packed_weight
from llmserve.models.mlp import LlamaMLP
from llmserve.quantization.packed_float import PackedFloatWeight, float_linear

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


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

    def packed(self) -> PackedFloatWeight:
        """The weight packed for the native GEMM (on first use: after the weights were
        loaded)."""
        if self._packed is None:
            self._packed = PackedFloatWeight(self.weight.data)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and native() is not None:
            return float_linear(x, self.packed())
        return F.linear(x, self.weight)


class _MoeLayer(ctypes.Structure):
    """`kernels/packed_weight.h`'s MoeLayer, field by field."""

    _fields_ = [("router", NativeWeight), ("gate_up", _P), ("down", _P),
                ("num_experts", _I64), ("top_k", _I64), ("first", _I64), ("num_held", _I64),
                ("intermediate", _I64), ("renormalize", ctypes.c_int32),
                ("shared_gate_up", NativeWeight), ("shared_down", NativeWeight),
                ("shared_gate", NativeWeight), ("shared_intermediate", _I64)]


class NativeMoe:
    """A mixture layer's weights as the native calls take them (`kernels/moe.cpp`), built
    once its weights are packed; the ctypes arrays are kept alive here."""

    def __init__(self, block: "SparseMoeBlock", lib: Kernels,
                 experts: list[tuple[NativeWeight, NativeWeight]],
                 shared: tuple[NativeWeight, NativeWeight] | None) -> None:
        self.lib = lib
        self.gate_up = (NativeWeight * len(experts))(*(a for a, _ in experts))
        self.down = (NativeWeight * len(experts))(*(b for _, b in experts))
        shared_gate = (float_weight(block.shared_expert_gate.packed()) if shared is not None
                       else NativeWeight())
        self.layer = _MoeLayer(
            float_weight(block.gate.packed()), ctypes.addressof(self.gate_up),
            ctypes.addressof(self.down), block.num_experts, block.top_k, block.held.start,
            len(block.held), block.intermediate_size, int(block.renormalize),
            *(shared or (NativeWeight(), NativeWeight())), shared_gate,
            block.shared_expert.intermediate_size if shared is not None else 0)
        methods = [getattr(m.method, "base", m.method)  # under a LoRA wrapper: its own
                   for m in block.modules() if isinstance(m, Linear)]
        k_pad = max(getattr(m.weight, "k_pad", 0) for m in methods)
        self.widest = max(k_pad, block.gate.weight.shape[1], block.intermediate_size,
                          self.layer.shared_intermediate)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.layer)

    def qscratch(self, t: int) -> torch.Tensor:
        """The GEMMs' workspace for t rows (the int8 or int4 one, whichever is wider)."""
        return torch.empty(t * (2 * self.widest + self.widest // 4 + 4), dtype=torch.uint8)


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
        self._native: NativeMoe | None = None
        self._native_checked = False
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:  # every rank holds all of it: no sum across ranks
            self.shared_expert = LlamaMLP(cfg, None, moe.shared_intermediate_size)
            self.shared_expert_gate = Router(1, cfg.hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> each token's experts (T, top_k), ascending, and their weights. On the
        CPU in float32 the native routing (`llmserve_moe_route`), which the one-call layer
        runs too."""
        scores = self.gate(x)
        lib = _native_lib(x)
        if lib is not None:
            t, scores = x.shape[0], scores.contiguous()  # (held: ptr keeps no reference)
            experts = torch.empty(t, self.top_k, dtype=torch.long)
            weights = torch.empty(t, self.top_k)
            lib.moe_route(ptr(scores), t, self.num_experts, self.top_k,
                          int(self.renormalize), ptr(experts), ptr(weights))
            return experts, weights
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts, order = experts.sort(dim=-1)
        return experts, weights.gather(1, order).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        native = self.native_layer() if x.dtype == torch.float32 else None
        if native is not None and not self._lora_active():
            if self.tp.size == 1:  # the whole layer in one call, as the decoder stack runs it
                x, y, qscratch = x.contiguous(), torch.empty_like(x), native.qscratch(t)
                native.lib.moe_block(ptr(x), t, hidden, native.address, ptr(y), ptr(qscratch))
                return y
            experts, weights = self.route(x)
            slots = self._run_native(native, x, experts, weights)
            return self._sum(x, self.tp.all_reduce(slots).view(t, self.top_k, hidden))
        experts, weights = self.route(x)
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
        return self._sum(x, self.tp.all_reduce(slots).view(t, self.top_k, hidden))

    def _lora_active(self) -> bool:
        """A LoRA adapter updates the experts this step (`lora/manager.py`'s wrappers)."""
        return getattr(self.experts[0].gate_up_proj.method, "active", False)

    def native_layer(self) -> NativeMoe | None:
        """The layer's packed weights as the native calls read them (built on first use,
        after the weights were packed), or None: torch's float weights, another device, no
        compiler, a router not in float32."""
        if not self._native_checked:
            self._native_checked = True
            lib = native() if self.gate.weight.device.type == "cpu" else None
            experts = [(packed_weight(e.gate_up_proj), packed_weight(e.down_proj))
                       for e in self.experts]
            mlps = [w for pair in experts for w in pair]
            shared = None
            if self.shared_expert is not None:
                shared = (packed_weight(self.shared_expert.gate_up_proj),
                          packed_weight(self.shared_expert.down_proj))
                mlps += shared
            if (lib is not None and self.gate.weight.dtype == torch.float32
                    and all(w is not None for w in mlps)):
                self._native = NativeMoe(self, lib, experts, shared)
        return self._native

    def _run_native(self, native: NativeMoe, x: torch.Tensor, experts: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts' (token, slot) outputs, zero where another rank's expert."""
        t, hidden = x.shape
        x = x.contiguous()
        ids, weights = experts.contiguous(), weights.float().contiguous()
        slots = torch.empty(t * self.top_k, hidden)
        scratch = torch.empty(t * (2 * hidden + 3 * self.intermediate_size))
        qscratch = native.qscratch(t)
        native.lib.moe_experts(
            ptr(x), t, hidden, self.intermediate_size, ctypes.addressof(native.gate_up),
            ctypes.addressof(native.down), self.held.start, len(self.held), ptr(ids),
            ptr(weights), self.top_k, ptr(slots), ptr(scratch), ptr(qscratch))
        return slots

    def _one_token(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                   ) -> torch.Tensor:
        """A decode step of one sequence: each chosen expert on the row itself, no
        grouping; the same products and sum order as `forward`'s, so the same bits."""
        outs = [self.experts[expert](x) * weights[:, slot:slot + 1]
                for slot, expert in enumerate(experts[0].tolist())]
        return self._sum(x, torch.stack(outs, dim=1))

    def _sum(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The slots' outputs (T, top_k, H) added in slot (ascending expert) order, then
        the shared expert's behind its gate (on the CPU in float32: `llmserve_moe_combine`,
        the one-call layer's)."""
        shared = gate = None
        if self.shared_expert is not None:
            shared, gate = self.shared_expert(x), self.shared_expert_gate(x)
        lib = _native_lib(x)
        if lib is not None:  # (the tensors held: ptr keeps no reference)
            t, _, hidden = slots.shape
            slots, y = slots.contiguous(), torch.empty(t, hidden)
            if shared is not None:
                shared, gate = shared.contiguous(), gate.contiguous()
            lib.moe_combine(ptr(slots), t, self.top_k, hidden, ptr(shared), ptr(gate), ptr(y))
            return y
        y = slots[:, 0]
        for slot in range(1, self.top_k):
            y = y + slots[:, slot]
        if shared is not None:
            y = y + torch.sigmoid(gate) * shared
        return y


def _native_lib(x: torch.Tensor) -> Kernels | None:
    """The native library where x's routing and sums run natively (float32 on the CPU)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return native()
