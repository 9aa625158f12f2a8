"""PEFT LoRA adapters, read and fitted to a loaded model's (fused) linears.

An adapter folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, the
target modules) and `adapter_model.safetensors` (`...<module>.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r) per target). Its update of a target is
`(x A^T) B^T * scale`, scale = alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT computes it.

The model runs q/k/v and gate/up as fused linears, so an adapter's updates of one fused
linear are stacked into one pair: A of all its targets' rows (sum of ranks, in), and B
(out, sum of ranks) with each target's B (scale folded in) on its own output rows and
columns, zeros elsewhere: one shrink and one expand GEMM per adapter and linear, and the
rows no target touches get exactly + 0. Anything the adapter asks that the model cannot do
is refused by name at load: a module the model lacks, a shape that does not fit, a rank
above `max_lora_rank`, DoRA, trained biases, `modules_to_save`, per-module rank patterns.

Files are read only if they are regular files (a FIFO or a device is refused at once, never
waited on). Given a `root` (the server's `--lora-dir`), a file is read only if it lies under
root once resolved, and it is then opened one component at a time from root with no symlink
followed: a link inside root to inside root works, one leading out never does, not even one
swapped in between the check and the open.
"""

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from llmserve.errors import LLMServeError
from llmserve.kernels import native
from llmserve.layers.linear import Linear
from llmserve.lora_request import LoRARequest
from llmserve.quantization.packed_float import PackedFloatWeight, float_linear

FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
PEFT_PREFIX = "base_model.model."


class LoRAError(LLMServeError, ValueError):
    """An adapter that cannot run on this model (named in the message)."""


class AdapterNotFound(LoRAError):
    """No adapter file can be read there: missing, not a regular file, outside the root,
    unreadable (a server tells a client no more than that; the message is the operator's)."""


@dataclass
class Piece:
    """One target's share of a fused linear's update: output rows `rows`, ranks `ranks` of
    the stacked A, its B (len(rows), len(ranks)) packed for the native GEMM."""

    rows: slice
    ranks: slice
    b: PackedFloatWeight


@dataclass
class LinearUpdate:
    """One adapter's update of one linear: `x @ a.T @ b.T`, the scale in `b` (b holds each
    target's B on its rows and ranks, zeros elsewhere). `packed`: A for the native GEMM,
    and each target's own B (the zeros are not multiplied: a piece's sums over its own
    ranks give the same bits as over all, the others adding exact zeros)."""

    a: torch.Tensor  # (ranks, in)
    b: torch.Tensor  # (out, ranks)
    packed: tuple[PackedFloatWeight, list[Piece]] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            # the native float32 GEMM: a row's bits do not depend on the rows beside it
            shrunk = float_linear(x, self.packed[0])
            delta = x.new_zeros(x.shape[0], self.b.shape[0])
            for piece in self.packed[1]:
                delta[:, piece.rows] = float_linear(shrunk[:, piece.ranks].contiguous(),
                                                    piece.b)
            return delta
        return (x @ self.a.to(x.dtype).t()) @ self.b.to(x.dtype).t()


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    updates: dict[str, LinearUpdate]  # the model's linear (module path) -> its update

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def load_adapter(request: LoRARequest, model: nn.Module, max_rank: int,
                 root: str | None = None) -> LoRAAdapter:
    """Read `request`'s folder and fit it to `model` (LoRAError naming what does not fit;
    AdapterNotFound where a file cannot be read). `root`: read only from under this
    resolved folder (see the module's docstring)."""
    folder = Path(request.lora_path)
    root_path = None if root is None else Path(root)
    config = _read_config(folder, root_path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter {request.lora_name}: r must be a positive integer, got "
                        f"{rank!r}")
    if rank > max_rank:
        raise LoRAError(f"adapter {request.lora_name}: rank {rank} exceeds max_lora_rank "
                        f"{max_rank} (--max-lora-rank)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"adapter {request.lora_name}: lora_alpha must be a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(folder, request.lora_name, root_path)
    pieces: dict[str, list[tuple[slice, torch.Tensor, torch.Tensor]]] = {}
    for name in sorted(tensors):
        if not name.endswith(".lora_A.weight"):
            if not name.endswith(".lora_B.weight"):
                raise LoRAError(f"adapter {request.lora_name}: tensor {name!r} is not a LoRA "
                                f"A or B weight")
            continue
        module = name.removesuffix(".lora_A.weight")
        a, b = tensors[name].float(), tensors.get(f"{module}.lora_B.weight")
        if b is None:
            raise LoRAError(f"adapter {request.lora_name}: {module} has lora_A but no lora_B")
        target, rows, linear = _target(model, module.removeprefix(PEFT_PREFIX),
                                       request.lora_name)
        width = rows.stop - rows.start
        if a.shape != (rank, linear.in_features) or b.shape != (width, rank):
            raise LoRAError(f"adapter {request.lora_name}: {module} has lora_A "
                            f"{tuple(a.shape)} and lora_B {tuple(b.shape)}; the model's "
                            f"{module.rsplit('.', 1)[-1]} needs ({rank}, "
                            f"{linear.in_features}) and ({width}, {rank})")
        pieces.setdefault(target, []).append((rows, a, b.float() * scale))
    if not pieces:
        raise LoRAError(f"adapter {request.lora_name}: no LoRA weights in {folder}")
    updates = {target: _stack(model.get_submodule(target), parts)
               for target, parts in pieces.items()}
    return LoRAAdapter(request, rank, updates)


def _read_config(folder: Path, root: Path | None) -> dict:
    path = folder / "adapter_config.json"
    data = _read_file(path, root)
    try:
        config = json.loads(data)
    except ValueError as e:
        raise LoRAError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{path} is not a JSON object")
    refused = {
        "peft_type": config.get("peft_type", "LORA") not in ("LORA", "lora"),
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for field, bad in refused.items():
        if bad:
            raise LoRAError(f"{path}: {field} {config.get(field)!r} is not supported (plain "
                            f"LoRA on linear layers is)")
    return config


def _read_tensors(folder: Path, name: str, root: Path | None) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    try:
        data = _read_file(path, root)
    except AdapterNotFound:
        try:
            os.close(_open_regular(folder / "adapter_model.bin", root))
        except AdapterNotFound:
            raise AdapterNotFound(f"adapter {name}: no adapter_model.safetensors in "
                                  f"{folder}") from None
        raise LoRAError(f"adapter {name}: adapter_model.bin is not read (save the adapter "
                        f"as safetensors)") from None
    try:
        return load_safetensors(data)
    except SafetensorError as e:
        raise LoRAError(f"adapter {name}: cannot read {path}: {e}") from None


def _read_file(path: Path, root: Path | None = None) -> bytes:
    """The bytes of the regular file at `path` (under `root` when given); AdapterNotFound
    where there is none to read."""
    with open(_open_regular(path, root), "rb", closefd=True) as f:
        return f.read()


def _open_regular(path: Path, root: Path | None) -> int:
    # O_NONBLOCK: opening a FIFO returns at once (to be refused) instead of waiting for a
    # writer; it changes nothing for a regular file's reads
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags) if root is None else _open_under(root, path, flags)
    except FileNotFoundError:
        raise AdapterNotFound(f"no {path.name} in {path.parent}") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise AdapterNotFound(f"cannot open {path}: {getattr(e, 'strerror', None) or e}"
                              ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise AdapterNotFound(f"{path} is not a regular file")
    return fd


def _open_under(root: Path, path: Path, flags: int) -> int:
    """`path` opened from `root` one component at a time, never through a symlink; only
    if it resolves to a path under root (a link inside root to inside root is fine)."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(root):
        raise FileNotFoundError(path)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    parts = real.relative_to(root).parts
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        try:
            next_fd = os.open(part, flags | os.O_NOFOLLOW | (0 if last else os.O_DIRECTORY),
                              dir_fd=fd)
        finally:
            os.close(fd)
        fd = next_fd
    return fd


def _target(model: nn.Module, module: str, name: str) -> tuple[str, slice, Linear]:
    """The model's linear a PEFT module name updates, and its output rows there."""
    if ".experts." in module:  # an expert sees only its own rows of a step, not the step's
        raise LoRAError(f"adapter {name}: {module!r} is a mixture-of-experts expert; LoRA "
                        f"on experts is not supported (attention and shared experts are)")
    parent, _, leaf = module.rpartition(".")
    try:
        if leaf in FUSED:
            fused, shard = FUSED[leaf]
            owner = model.get_submodule(parent)
            linear = owner.get_submodule(fused)
            if fused == "qkv_proj":
                rows = owner.shard_rows(shard)
            else:
                size = owner.intermediate_size
                rows = slice(shard * size, (shard + 1) * size)
            return f"{parent}.{fused}", rows, linear
        linear = model.get_submodule(module)
    except AttributeError:
        linear = None
    if not isinstance(linear, Linear):
        raise LoRAError(f"adapter {name}: the model has no linear layer {module!r} to adapt "
                        f"(the embedding and the LM head cannot be)")
    return module, slice(0, linear.out_features), linear


def _stack(linear: Linear, parts: list[tuple[slice, torch.Tensor, torch.Tensor]]
           ) -> LinearUpdate:
    ranks = sum(a.shape[0] for _, a, _ in parts)
    a_all = torch.cat([a for _, a, _ in parts])
    b_all = torch.zeros(linear.out_features, ranks)
    pieces, start = [], 0
    for rows, a, b in parts:
        span = slice(start, start + a.shape[0])
        b_all[rows, span] = b
        pieces.append((rows, span, b))
        start += a.shape[0]
    packed = None
    if native() is not None:
        packed = (PackedFloatWeight(a_all),
                  [Piece(rows, span, PackedFloatWeight(b)) for rows, span, b in pieces])
    return LinearUpdate(a_all, b_all, packed)
