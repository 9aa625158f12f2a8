"""Many LoRA adapters on one base model, batched in one step.

`LoRAManager.enable(model)` wraps each of the model's linears (`LoRALinearMethod`): the
base method runs as before over all of the step's rows, then each adapter present in the
step adds its low-rank update to its own rows only (its rows gathered, one shrink GEMM to
the ranks, one expand GEMM back, added: the shape of Punica's segmented SGMV, one pair of
GEMMs per adapter and linear, never a forward per adapter). A row without an adapter (the
base model's requests) gets nothing added, so base requests batched with adapters give the
base model's bits; and a row's update depends on its own row alone (the native float32
GEMM's rows do not depend on the batch), so an adapter's requests give the same bits in
any batch.

Adapters load on first use from their folder (`adapter.py`) and stay, up to `max_cpu_loras`
(the least recently used one not in the current step goes first); `max_loras`, the most
adapters one step may hold, is the scheduler's to keep.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from llmserve.layers.linear import Linear, LinearMethod
from llmserve.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from llmserve.lora_request import LoRARequest


@dataclass
class LoRAStep:
    """One step's rows by adapter: adapter -> the row indices it owns (None: every row)."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]]


class LoRAContext:
    """What every wrapped linear reads: the current step's adapters (None: none)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinearMethod(LinearMethod):
    """A linear's own method plus the step's adapter updates for this linear (`path`)."""

    def __init__(self, base: LinearMethod, context: LoRAContext, path: str) -> None:
        self.base = base
        self.context = context
        self.path = path

    @property
    def active(self) -> bool:
        return self.context.step is not None

    def __getattr__(self, name: str):  # the base method's packed weight and the like
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        step = self.context.step
        if step is None:
            return y
        for adapter, rows in step.groups:
            update = adapter.updates.get(self.path)
            if update is None:
                continue
            if rows is None:
                y = y + update(x)
            else:
                y = y.index_copy(0, rows, y.index_select(0, rows) +
                                 update(x.index_select(0, rows)))
        return y


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or 0, max_loras)
        self.context = LoRAContext()
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.load_seconds = 0.0
        for name, module in model.named_modules():
            if isinstance(module, Linear) and not isinstance(module.method, LoRALinearMethod):
                module.method = LoRALinearMethod(module.method, self.context, name)
        model.lora_context = self.context  # the model skips its fused native stack in a step

    def get(self, request: LoRARequest, in_use: set[int] = frozenset()) -> LoRAAdapter:
        """The adapter, loaded (and checked against the model) on first use."""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is not None:
            if adapter.request.lora_path != request.lora_path:
                raise LoRAError(f"lora_int_id {request.lora_int_id} is adapter "
                                f"{adapter.request.lora_name}, not {request.lora_name}")
            self.adapters.move_to_end(request.lora_int_id)
            return adapter
        start = time.perf_counter()
        adapter = load_adapter(request, self.model, self.max_lora_rank)
        self.load_seconds += time.perf_counter() - start
        self.adapters[request.lora_int_id] = adapter
        while len(self.adapters) > self.max_cpu_loras:
            victim = next((i for i in self.adapters if i not in in_use and
                           i != request.lora_int_id), None)
            if victim is None:
                break
            del self.adapters[victim]
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        return self.adapters.pop(lora_int_id, None) is not None

    def begin_step(self, token_adapters: np.ndarray) -> None:
        """`token_adapters` (T,): each row's lora_int_id (0: the base model)."""
        ids = np.unique(token_adapters)
        ids = ids[ids > 0]
        if len(ids) == 0:
            self.context.step = None
            return
        groups = []
        for lora_id in ids.tolist():
            adapter = self.adapters[lora_id]
            rows = None if len(ids) == 1 and (token_adapters == lora_id).all() else \
                torch.from_numpy(np.flatnonzero(token_adapters == lora_id))
            groups.append((adapter, rows))
        self.context.step = LoRAStep(groups)

    def end_step(self) -> None:
        self.context.step = None
