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
adapters one step may hold, is the scheduler's to keep. A server reads and fits an adapter
off the engine thread when it is registered and `offer`s it: its first use takes it without
touching the disk; only a reload after eviction reads on the engine thread (from under the
root it was offered with, if any).
"""

import ctypes
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from llmserve.kernels import native_for, ptr
from llmserve.layers.linear import Linear, LinearMethod
from llmserve.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from llmserve.lora_request import LoRARequest


@dataclass
class LoRAStep:
    """One step's rows by adapter: adapter -> the row indices it owns (None: every row);
    for the native kernel, each row's slot (an index into `groups`, -1: no adapter) and,
    per linear, the slots' packed weights as ctypes arrays (built on first use)."""

    groups: list[tuple[LoRAAdapter, torch.Tensor | None]]
    slot_of_row: torch.Tensor  # (T,) int32
    # linear path -> its native arguments (or None); shared by every step with the same
    # adapters in the same slots (the manager keeps it), so a decode builds them once
    native_args: dict = field(default_factory=dict)

    def native(self, path: str) -> tuple | None:
        """Linear `path`'s updates as the kernel's `LoraSlot` array (one a slot), what it
        points into, and the widest rank; None where an adapter's update is not packed
        (the torch path then runs)."""
        if path not in self.native_args:
            updates = [adapter.updates.get(path) for adapter, _ in self.groups]
            if any(u is not None and u.packed is None for u in updates):
                self.native_args[path] = None
            else:
                slots = (_LoraSlot * len(updates))()
                keep = []
                for slot, update in zip(slots, updates, strict=True):
                    if update is None:
                        continue  # rank 0: this adapter leaves the linear alone
                    a, pieces = update.packed
                    array = (_LoraPiece * len(pieces))(*(
                        _LoraPiece(ptr(p.b.packed), p.rows.start, p.rows.stop - p.rows.start,
                                   p.ranks.start, p.ranks.stop - p.ranks.start)
                        for p in pieces))
                    keep.append(array)
                    slot.a, slot.rank = ptr(a.packed), update.a.shape[0]
                    slot.num_pieces, slot.pieces = len(pieces), ctypes.addressof(array)
                top = max((u.a.shape[0] for u in updates if u is not None), default=0)
                self.native_args[path] = (slots, keep, top)
        return self.native_args[path]


class _LoraPiece(ctypes.Structure):  # kernels.h
    _fields_ = [("b", ctypes.c_void_p), ("row_start", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("rank_start", ctypes.c_int64),
                ("rank", ctypes.c_int64)]


class _LoraSlot(ctypes.Structure):  # kernels.h
    _fields_ = [("a", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("num_pieces", ctypes.c_int64), ("pieces", ctypes.c_void_p)]


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
        lib = native_for(x, y) if x.dim() == 2 else None
        args = step.native(self.path) if lib is not None else None
        if args is not None:  # one call: the same GEMMs and adds as below
            slots, _, top = args
            if top:
                t, k, n = x.shape[0], x.shape[1], y.shape[1]
                scratch = torch.empty(t * (k + 2 * top + n))
                lib.lora_apply(ptr(x), t, k, ptr(y), n, ptr(step.slot_of_row),
                               len(step.groups), ctypes.addressof(slots),
                               ptr(scratch))
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
        # the steps' native arguments by their adapters (slot order); cleared when an
        # adapter loads or goes
        self._native_args: dict[tuple[int, ...], dict] = {}
        self.load_seconds = 0.0
        # written by the server's thread, read by the engine's (single dict operations):
        # adapters fitted off the engine thread, not used yet (at most max_cpu_loras, the
        # oldest dropped: it then loads on first use); and the --lora-dir they came from
        self._offered: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._roots: dict[int, str] = {}
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
        adapter = self._offered.pop(request.lora_int_id, None)
        if adapter is None or adapter.request != request:
            start = time.perf_counter()
            adapter = load_adapter(request, self.model, self.max_lora_rank,
                                   self._roots.get(request.lora_int_id))
            self.load_seconds += time.perf_counter() - start
        self.adapters[request.lora_int_id] = adapter
        self._native_args.clear()
        while len(self.adapters) > self.max_cpu_loras:
            victim = next((i for i in self.adapters if i not in in_use and
                           i != request.lora_int_id), None)
            if victim is None:
                break
            del self.adapters[victim]
        return adapter

    def holds(self, request: LoRARequest) -> bool:
        """Whether `get(request)` would read nothing from disk."""
        held = self.adapters.get(request.lora_int_id) or self._offered.get(request.lora_int_id)
        return held is not None and held.request == request

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter read and fitted, off the engine thread (a request's reload of
        an adapter dropped from memory: `AsyncEngine` reads it on its own pool and offers
        it), from under the folder it was first loaded from."""
        return load_adapter(request, self.model, self.max_lora_rank,
                            self._roots.get(request.lora_int_id))

    def offer(self, adapter: LoRAAdapter, root: str | None = None) -> None:
        """`adapter`, read and fitted elsewhere, for its first `get` to take; `root`: the
        folder its reloads must read from under."""
        if root is not None:
            self._roots[adapter.lora_int_id] = root
        self._offered[adapter.lora_int_id] = adapter
        while len(self._offered) > self.max_cpu_loras:
            try:
                self._offered.popitem(last=False)
            except KeyError:  # the engine took the last one meanwhile
                break

    def withdraw(self, lora_int_id: int) -> None:
        """An offered adapter is no longer served (unloaded before, or after, its use)."""
        self._offered.pop(lora_int_id, None)

    def remove(self, lora_int_id: int) -> bool:
        self._native_args.clear()
        return self.adapters.pop(lora_int_id, None) is not None

    def begin_step(self, token_adapters: np.ndarray) -> None:
        """`token_adapters` (T,): each row's lora_int_id (0: the base model)."""
        ids = np.unique(token_adapters)
        ids = ids[ids > 0]
        if len(ids) == 0:
            self.context.step = None
            return
        groups = []
        slot_of_row = np.full(len(token_adapters), -1, dtype=np.int32)
        for slot, lora_id in enumerate(ids.tolist()):
            adapter = self.adapters[lora_id]
            mine = token_adapters == lora_id
            slot_of_row[mine] = slot
            rows = None if len(ids) == 1 and mine.all() else \
                torch.from_numpy(np.flatnonzero(mine))
            groups.append((adapter, rows))
        cached = self._native_args.setdefault(tuple(ids.tolist()), {})
        self.context.step = LoRAStep(groups, torch.from_numpy(slot_of_row), cached)

    def end_step(self) -> None:
        self.context.step = None
