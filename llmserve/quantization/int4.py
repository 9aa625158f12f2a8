"""int4: 4-bit weights per group of 32, int8 activations in one or two parts, products in int32.

A weight group of 32 values is `d * u + m` with codes u in [0, 15] and an fp16 scale d and
offset m: a GGUF Q4_1 block exactly, and a Q4_0 block (d (u - 8)) with m = -8 d.
Re-quantizing a Q4_1 checkpoint's dequantized weights gives back its own blocks (min and
max of a block are its m and 15 * d + m); a Q4_0 block whose codes miss 15 would not come
back so (its max is under 7 d: another step), so a group the min/max blocks do not give back
exactly that is a Q4_0 block keeps the block's own d and codes. Either way the default path
computes on the checkpoint's weights as stored, in 5 bits per weight (a SmolLM2-135M Q4_0
file re-quantized by min/max lost 20 % of perplexity). Other float weights get the nearest
blocks (asymmetric min/max, as llama.cpp's Q4_1 quantizer).

Activations per group of 32 with one fp32 scale s = amax / 127, in one of two precisions:
* "int4": two int8 parts, x ~ (hi + lo / 254) * s (about 15 bits);
* "int4-a8": one, x ~ hi * s (8 bits, llama.cpp's Q8 activations): half the integer work.
  On the default model against float32 (`llmserve bench quality`): perplexity +0.35 % (15
  bits: -0.01 %), mean KL 3.3e-3 (1.2e-3), top-1 95.6 % (97.0 %). It is what "auto" runs a
  4-bit checkpoint in (`kernel_choice.py`: faster at every serving batch timed, never slower
  at one stream, and not a choice a timing's noise can flip); `quantization="int4"` keeps
  the 15 bits.

    y[t, o] = sum over groups g of (d[o, g] * s[t, g] / 254) * (254 u[o, g] . hi + u . lo)
                                   + m[o, g] * sum of x's dequantized group

Kernels:
* on the CPU, the native kernel (`gemm_q4.cpp`, at every instruction-set level): quantize, dot
  products of nibbles and int8 parts, float epilogue per group, in one call; integer sums are
  exact and each row's float sum runs over its groups in order, so a request's outputs
  do not depend on the batch (nor on the level);
* elsewhere (CUDA, no compiler), the same quantities in torch ops: activations quantized
  alike, weights dequantized for the call and one float matmul (equal up to float summation order).
"""

import torch

from llmserve.kernels import native, ptr
from llmserve.layers.linear import PackedLinearMethod

GROUP = 32
_N_ALIGN = 16  # the kernel's block of output channels
_RECORD = 320  # packed bytes per block of 16 channels and group: codes, d, m


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float, K a multiple of 32 -> codes uint8 (N, K) in [0, 15], d and m fp16
    (N, K / 32): weight ~ d * codes + m group by group."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = torch.aminmax(groups, dim=-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    step = d.float()
    # a zero step (a constant group) gives code 0: (x - m) * 0
    inverse = torch.where(step > 0, 1 / step.where(step > 0, 1.0), 0.0)
    # in place on one temporary (these passes over every weight were a fifth of a warm
    # start); x * (1 / step) may round a code differently from x / step at a half: both are
    # within half a step, and a Q4_1 file's own blocks come back exactly either way
    codes = torch.sub(groups, m.float()[..., None]).mul_(inverse[..., None]).round_().clamp_(0, 15)
    # a group those do not give back exactly that is a Q4_0 block keeps its own d, u
    exact = (codes * step[..., None] + m.float()[..., None] == groups).all(dim=-1)
    if not bool(exact.all()):
        codes, d, m = _q4_0_blocks(groups, codes, d, m, ~exact)
    return codes.to(torch.uint8).reshape(n, k), d, m


def _q4_0_blocks(groups: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 inexact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where `inexact` and a group is a GGUF Q4_0 block (x = d (u - 8), d its value of
    largest magnitude over -8, an fp16), its own codes, d and m = -8 d (exact in fp16)."""
    largest = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))[..., 0]
    scale = largest / -8
    offset = -8 * scale
    safe = torch.where(scale != 0, scale, 1.0)[..., None]
    u = torch.round(groups / safe) + 8
    block = (inexact & (scale != 0) & (scale.half().float() == scale)
             & (offset.half().float() == offset) & ((u >= 0) & (u <= 15)).all(dim=-1)
             & (safe * (u - 8) == groups).all(dim=-1))
    return (torch.where(block[..., None], u, codes), torch.where(block, scale.half(), d),
            torch.where(block, offset.half(), m))


def quantize_groups_native(lib, weight: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_groups in the native kernel: the same codes, d and m, bit for bit."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    d = torch.empty(n, k // GROUP, dtype=torch.float16)
    m = torch.empty(n, k // GROUP, dtype=torch.float16)
    lib.quantize_q4(ptr(weight), n, k, ptr(codes), ptr(d.view(torch.int16)),
                    ptr(m.view(torch.int16)))
    return codes, d, m


def dequantize_groups(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    groups = codes.reshape(n, k // GROUP, GROUP).float()
    return (groups * d.float()[..., None] + m.float()[..., None]).reshape(n, k)


def quantize_activations(x: torch.Tensor, bits: int = 15) -> torch.Tensor:
    """(M, K) float -> the values the kernel multiplies: per group of 32,
    (hi + lo / 254) * s with int8 hi, lo and s = amax / 127 (bits 15), or hi * s (bits 8)."""
    mm, k = x.shape
    groups = x.reshape(mm, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    t = groups * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    hi = t.round()
    if bits == 8:
        return (hi * (amax / 127.0)).reshape(mm, k)
    lo = ((t - hi) * 254.0).round_().clamp_(-127, 127)
    return ((hi + lo / 254.0) * (amax / 127.0)).reshape(mm, k)


class PackedInt4Weight:
    """A float weight `(N, K)` as 4-bit groups; K is padded to a multiple of 32 with zeros.

    `layout` "vnni": records for the native kernel (see `gemm_q4.cpp`); "plain": codes
    (N, K_pad) uint8 with d, m (N, K_pad / 32) fp16, for the torch fallback.
    `activation_bits`: 15 (two int8 parts) or 8 (one), what the product quantizes x to.
    """

    def __init__(self, weight: torch.Tensor, layout: str | None = None,
                 activation_bits: int = 15) -> None:
        if activation_bits not in (8, 15):
            raise ValueError(f"activation_bits must be 8 or 15, not {activation_bits}")
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self.activation_bits = activation_bits
        self.k_pad = -(-k // GROUP) * GROUP
        padded = torch.nn.functional.pad(weight.float(), (0, self.k_pad - k))
        lib = native() if weight.device.type == "cpu" else None
        if lib is not None:  # the same codes in one native pass (gemm_q4.cpp)
            codes, self.d, self.m = quantize_groups_native(lib, padded.contiguous())
        else:
            codes, self.d, self.m = quantize_groups(padded)
        self.layout = layout or ("vnni" if lib is not None else "plain")
        if self.layout == "plain":
            self.codes = codes
            self.packed = None
            return
        n_pad = -(-n // _N_ALIGN) * _N_ALIGN
        self.packed = torch.empty(n_pad // _N_ALIGN, self.k_pad // GROUP, _RECORD,
                                  dtype=torch.uint8)
        lib.pack_q4_weight(ptr(codes), ptr(self.d.view(torch.int16)),
                           ptr(self.m.view(torch.int16)), n, self.k_pad,
                           ptr(self.packed))
        self.codes = None
        self.d = self.m = None  # they live inside the packed records

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.layout == "vnni":
            return {"qweight": self.packed}
        return {"qweight": self.codes, "group_scale": self.d, "group_offset": self.m}


def packed_int4_bytes(out_features: int, in_features: int) -> int:
    """Bytes one packed weight holds: 320 bytes per 16 channels (padded) and group of 32."""
    n_pad = -(-out_features // _N_ALIGN) * _N_ALIGN
    k_pad = -(-in_features // GROUP) * GROUP
    return n_pad // _N_ALIGN * (k_pad // GROUP) * _RECORD


def int4_linear(x: torch.Tensor, w: PackedInt4Weight, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x (..., K) float -> (..., N) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if rows.shape[1] != w.k_pad:
        rows = torch.nn.functional.pad(rows, (0, w.k_pad - rows.shape[1]))
    if w.layout == "vnni":
        y = _int4_linear_native(native(), rows.contiguous(), w, bias)
    else:
        y = _int4_linear_torch(rows, w, bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def _int4_linear_native(lib, x: torch.Tensor, w: PackedInt4Weight, bias) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, w.out_features)
    workspace = torch.empty(2 * m * k + 8 * m * (k // GROUP), dtype=torch.uint8)
    lib.q4_linear(ptr(x), m, k, ptr(w.packed), ptr(bias), w.out_features, ptr(y),
                  ptr(workspace), w.activation_bits)
    return y


def _int4_linear_torch(x: torch.Tensor, w: PackedInt4Weight, bias) -> torch.Tensor:
    """The same quantities in torch ops (any device), on a plain-layout weight."""
    y = quantize_activations(x, w.activation_bits) @ dequantize_groups(w.codes, w.d, w.m).t()
    if bias is not None:
        y = y + bias
    return y


class Int4LinearMethod(PackedLinearMethod):
    """Loads float weights, then keeps only the packed 4-bit groups (15-bit activations)."""

    pack = PackedInt4Weight
    compute = staticmethod(int4_linear)


def _pack_a8(weight: torch.Tensor) -> PackedInt4Weight:
    return PackedInt4Weight(weight, activation_bits=8)


class Int4A8LinearMethod(Int4LinearMethod):
    """int4 weights with 8-bit activations ("int4-a8")."""

    pack = staticmethod(_pack_a8)
