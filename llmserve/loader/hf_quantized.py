"""Quantized Hugging Face checkpoints: AWQ and GPTQ (int4 or int8 groups, packed in int32)
and FP8 (E4M3/E5M2 with per-tensor, per-channel or block scales), read into the float
weights they stand for, then run by "auto" on the nearest native kernel: int4 for 4-bit
AWQ/GPTQ, int8 for 8-bit GPTQ and FP8.

AWQ (AutoAWQ's GEMM layout, `version: gemm`): `qweight` (in, out / 8) holds eight output
channels per int32 in the order 0 2 4 6 1 3 5 7; `qzeros` (in / group, out / 8) likewise;
`scales` (in / group, out). w[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o].

GPTQ (AutoGPTQ / GPTQModel): `qweight` (in / (32 / bits), out) holds consecutive input
rows per int32, lowest bits first; `qzeros` (groups, out / (32 / bits)) consecutive output
channels; `scales` (groups, out); `g_idx` (in,) each input row's group (act-order, `desc_act`,
permutes them; without it row i is in group i // group). The `gptq` checkpoint format
stores each zero point minus one (`gptq_v2` does not).

FP8 (`quant_method: fp8`, and compressed-tensors' float checkpoints): the float8 `weight`
times `weight_scale` (a scalar, or one per output channel) or, in blocks, `weight_scale_inv`
(one per block of `weight_block_size`). Activation scales (`input_scale`) are dropped: the
activations are not quantized to FP8 here (they are float, or the int8 kernel's own).

The groups become float values exactly (int4 codes and fp16 scales multiply exactly in
float32); "auto" then packs 4-bit groups in input order as the int4 kernel's groups of 32,
which keep a checkpoint group exactly where its 32 columns span all 16 codes (up to the
fp16 rounding of the group's offset) and within half of the checkpoint's step elsewhere.
Act-order groups (scattered rows), 8-bit groups and FP8 run on int8.
"""

from dataclasses import dataclass
from typing import Any

import torch

from llmserve.errors import UnsupportedModelError

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # unpacked nibble -> output column within 8
PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
FP8_SCALES = ("weight_scale", "weight_scale_inv")
DROPPED = ("input_scale",)  # activation scales of static FP8 schemes


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "awq", "gptq", "fp8"
    bits: int = 4
    group_size: int = -1  # -1: one group per input row range (whole column)
    desc_act: bool = False
    zero_plus_one: bool = False  # GPTQ's v1 format: stored zeros are one less
    block: tuple[int, int] | None = None  # FP8 block scales (rows, columns)

    @property
    def stored(self) -> str:
        """The kernels "auto" keeps the checkpoint on: int4 for 4-bit groups in input order
        (its groups of 32 hold them), int8 otherwise (8 bits; FP8; act-order, whose groups
        are scattered over the input: no group of 32 holds one grid)."""
        if self.method in ("awq", "gptq") and self.bits == 4 and not self.desc_act:
            return "int4"
        return "int8"


def quant_scheme(hf_config: dict[str, Any]) -> QuantScheme | None:
    """The checkpoint's scheme from config.json's `quantization_config` (None: float); one
    llmserve cannot read is refused by name."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError("quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is not True:
            raise UnsupportedModelError(f"unsupported AWQ checkpoint (version {version!r}, "
                                        f"zero_point {qc.get('zero_point')!r}; llmserve reads "
                                        f"GEMM-layout AWQ with zero points)")
        return QuantScheme("awq", _bits(qc, (4,)), _group(qc))
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"unsupported GPTQ checkpoint_format {fmt!r}")
        return QuantScheme("gptq", _bits(qc, (4, 8)), _group(qc), bool(qc.get("desc_act")),
                           zero_plus_one=fmt == "gptq")
    if method in ("fp8", "compressed-tensors"):
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config weight_block_size must be two positive "
                             f"integers, got {block!r}")
        return QuantScheme("fp8", 8, block=tuple(block) if block else None)
    raise UnsupportedModelError(f"unsupported quantization_config quant_method {method!r} "
                                f"(supported: awq, gptq, fp8)")


def _bits(qc: dict[str, Any], allowed: tuple[int, ...]) -> int:
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits not in allowed:
        raise UnsupportedModelError(f"unsupported {qc.get('quant_method')} bits {bits!r} "
                                    f"(supported: {', '.join(map(str, allowed))})")
    return bits


def _group(qc: dict[str, Any]) -> int:
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise ValueError(f"quantization_config group_size must be a positive integer or -1, "
                         f"got {group!r}")
    return group


def weight_shapes(scheme: QuantScheme, shapes: dict[str, tuple[int, ...]]
                  ) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor shapes with each packed linear's parts replaced by the
    (out, in) weight they make, and the scales dropped."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        prefix, _, part = name.rpartition(".")
        if scheme.method != "fp8" and part in PACKED_PARTS:
            if part == "qweight":
                out[f"{prefix}.weight"] = _unpacked_shape(scheme, name, shape)
        elif scheme.method == "fp8" and part in (*FP8_SCALES, *DROPPED):
            continue
        else:
            out[name] = shape
    return out


def _unpacked_shape(scheme: QuantScheme, name: str, shape: tuple[int, ...]
                    ) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"{name} has shape {shape}, not 2-D")
    per_int = 32 // scheme.bits
    if scheme.method == "awq":
        return shape[1] * per_int, shape[0]  # (in, out / 8) -> (out, in)
    return shape[1], shape[0] * per_int  # GPTQ (in / 8, out) -> (out, in)


def dequantize(scheme: QuantScheme, tensors: dict[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each quantized linear's parts replaced by its float32
    weight (`prefix.weight`, (out, in))."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, part = name.rpartition(".")
        if scheme.method != "fp8":
            if part == "qweight":
                parts = {p: tensors.get(f"{prefix}.{p}") for p in PACKED_PARTS}
                out[f"{prefix}.weight"] = _dequant_groups(scheme, prefix, parts)
            elif part not in PACKED_PARTS:
                out[name] = tensor
        elif part == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            out[name] = _dequant_fp8(scheme, name, tensor, tensors)
        elif part not in (*FP8_SCALES, *DROPPED):
            out[name] = tensor
    return out


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits fields, lowest first, spread along `dim`."""
    per_int = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., per_int)
    if dim == 1:  # (rows, cols / k) -> (rows, cols)
        return fields.reshape(packed.shape[0], packed.shape[1] * per_int)
    return fields.permute(0, 2, 1).reshape(packed.shape[0] * per_int, packed.shape[1])


def _dequant_groups(scheme: QuantScheme, prefix: str,
                    parts: dict[str, torch.Tensor | None]) -> torch.Tensor:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qzeros is None or scales is None:
        raise ValueError(f"{prefix}: a {scheme.method.upper()} linear needs qweight, qzeros "
                         f"and scales")
    if scheme.method == "awq":
        order = torch.tensor(AWQ_ORDER)

        def columns(t: torch.Tensor) -> torch.Tensor:  # AWQ's 0 2 4 6 1 3 5 7 undone
            fields = _unpack(t.int(), 4, dim=1).reshape(t.shape[0], -1, 8)
            return fields[..., order].reshape(t.shape[0], -1)

        q, zeros = columns(qweight), columns(qzeros)  # (in, out), (groups, out)
    else:
        q = _unpack(qweight.int(), scheme.bits, dim=0)  # (in, out)
        zeros = _unpack(qzeros.int(), scheme.bits, dim=1)  # (groups, out)
        if scheme.zero_plus_one:
            zeros = zeros + 1
    rows = q.shape[0]
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        groups = g_idx.long()
    else:
        size = rows if scheme.group_size == -1 else scheme.group_size
        groups = torch.arange(rows) // size
    if groups.shape != (rows,) or groups.min() < 0 or groups.max() >= scales.shape[0] or \
            zeros.shape != scales.shape or scales.shape[1] != q.shape[1]:
        raise ValueError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} do not fit "
                         f"{scheme.bits}-bit groups")
    s = scales.float()[groups]  # (in, out)
    return ((q - zeros[groups]).float() * s).t().contiguous()


def _dequant_fp8(scheme: QuantScheme, name: str, weight: torch.Tensor,
                 tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    prefix = name.rpartition(".")[0]
    values = weight.float()
    scale, inverse = tensors.get(f"{prefix}.weight_scale"), tensors.get(
        f"{prefix}.weight_scale_inv")
    if inverse is not None:  # one scale per block of the weight
        rows, cols = scheme.block or (128, 128)
        n, k = values.shape
        if inverse.shape != (-(-n // rows), -(-k // cols)):
            raise ValueError(f"{prefix}.weight_scale_inv has shape {tuple(inverse.shape)}, "
                             f"not one per {rows}x{cols} block of {n}x{k}")
        expanded = inverse.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)
        return values * expanded[:, :k]
    if scale is None:
        raise ValueError(f"{prefix}: an FP8 weight needs weight_scale or weight_scale_inv")
    scale = scale.float()
    if scale.numel() == 1:
        return values * scale.reshape(())
    if scale.numel() != values.shape[0]:
        raise ValueError(f"{prefix}.weight_scale has {scale.numel()} values for "
                         f"{values.shape[0]} channels")
    return values * scale.reshape(-1, 1)
