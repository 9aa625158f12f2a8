"""W8A8 int8: weights per output channel, activations per token, products in int32.

    y[t, o] = (hi[t] . wq[o] + lo[t] . wq[o] / 254) * x_scale[t] * w_scale[o]

Activations are split into two int8 parts, x ~ (hi + lo / 254) * x_scale: about 15 bits,
so an outlier channel does not wash out the rest of a token. Integer accumulation is exact
and each token's scale depends on that token alone, so a request's outputs do not depend on
what else is in the batch.

Kernels, giving bit-identical results (the same integers, the same float epilogue):
* on the CPU, the native kernel (`gemm_int8.cpp`, at every instruction-set level: quantize +
  int8 dot products + epilogue in one call; weights packed at load, read once per call);
* elsewhere (CUDA, no compiler): the same arithmetic in torch ops and `torch._int_mm`,
  on plain `(N, K)` weights.
"""

import torch

from llmserve.kernels import native, ptr
from llmserve.layers.linear import PackedHead, PackedLinearMethod

_EPS = 1e-8
_K_ALIGN = 64  # packed weights pad K to this (the kernel's vector width in bytes)
_N_ALIGN = 16  # and N to the kernel's block of output channels


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: x (R, C) -> (int8 (R, C), float scale (R, 1))."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / 127.0
    return torch.round(x / scale).to(torch.int8), scale


class PackedInt8Weight:
    """An int8 weight `(N, K)` with its row sums and fp32 per-channel scales.

    `layout` "vnni": packed for the native kernel, `(N_pad, K_pad)` bytes in blocks of 16
    channels x 4 k (see `gemm_int8.cpp`); "plain": `(N, K)` for `torch._int_mm`.
    """

    def __init__(self, weight: torch.Tensor, layout: str | None = None) -> None:
        self._pack(*quantize_rows(weight.float()), layout)

    @classmethod
    def from_codes(cls, qweight: torch.Tensor, scale: torch.Tensor,
                   layout: str | None = None) -> "PackedInt8Weight":
        """The weight of int8 codes `qweight` (N, K) and scales `scale` (N, 1), quantized
        already."""
        packed = cls.__new__(cls)
        packed._pack(qweight, scale, layout)
        return packed

    def _pack(self, qweight: torch.Tensor, scale: torch.Tensor, layout: str | None) -> None:
        n, k = qweight.shape
        self.out_features, self.in_features = n, k
        self._within: torch.Tensor | None = None
        self.row_sums = qweight.sum(dim=1, dtype=torch.int32)
        self.scale = scale.reshape(-1).float().contiguous()  # (N,)
        lib = native() if qweight.device.type == "cpu" else None
        self.layout = layout or ("vnni" if lib is not None else "plain")
        if self.layout == "plain":
            self.packed = qweight.contiguous()
            return
        k_pad = -(-k // _K_ALIGN) * _K_ALIGN
        n_pad = -(-n // _N_ALIGN) * _N_ALIGN
        self.packed = torch.empty(n_pad, k_pad, dtype=torch.int8)
        lib.pack_int8_weight(ptr(qweight.contiguous()), n, k, ptr(self.packed))

    @property
    def k_pad(self) -> int:
        """Columns a packed row holds (K padded for the kernel)."""
        return self.packed.shape[1]

    def repeated(self, times: int) -> "PackedInt8Weight":
        """This weight's rows repeated `times` times down, as packing the repeated rows
        would make them (a kernel timing's weight, without quantizing and packing it all);
        the row count must fill whole blocks of channels."""
        if self.out_features % _N_ALIGN:
            raise ValueError(f"{self.out_features} rows are not whole blocks of {_N_ALIGN}")
        copy = PackedInt8Weight.__new__(PackedInt8Weight)
        copy.__dict__.update(self.__dict__)
        copy.out_features = self.out_features * times
        copy.row_sums, copy.scale = self.row_sums.repeat(times), self.scale.repeat(times)
        copy.packed = self.packed.repeat(times, 1)
        return copy

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.packed, "row_sums": self.row_sums, "weight_scale": self.scale}

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized, `(T, K)` float (a tied embedding's lookup)."""
        if self.layout == "vnni" and ids.dim() == 1 and ids.dtype == torch.long:
            # one native pass (the index arithmetic and gather below took ~0.1 ms of a
            # decode step in torch ops)
            ids = ids.contiguous()
            out = torch.empty(ids.numel(), self.in_features)
            if native().int8_embedding(
                    ptr(self.packed), self.out_features, self.packed.shape[1], ptr(ids),
                    ids.numel(), self.in_features, ptr(self.scale), ptr(out)):
                raise IndexError(f"token id out of range [0, {self.out_features})")
            return out
        return self.rows(ids).float() * self.scale[ids, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 rows `ids` (T,) as `(T, K)`, whatever the layout (embedding lookups)."""
        if self.layout == "plain":
            return self.packed[ids]
        k_pad = self.packed.shape[1]
        if self._within is None:  # (K,) offsets of a channel's bytes inside its block
            k = torch.arange(self.in_features)
            self._within = (k // 4) * (_N_ALIGN * 4) + k % 4
        base = (ids // _N_ALIGN) * (k_pad // 4) * (_N_ALIGN * 4) + (ids % _N_ALIGN) * 4
        index = base[:, None] + self._within[None, :]  # (T, K)
        if self.packed.device.type == "cpu":
            # numpy's gather: torch's opens an OpenMP region from ~5 rows on, whose idle
            # worker then competes with the native kernels' threads on a small machine
            # (measured: a 6-token step 14.3 -> 5.7 ms on 2 cores)
            return torch.from_numpy(self.packed.view(-1).numpy()[index.numpy()])
        return self.packed.view(-1)[index]


def packed_int8_bytes(out_features: int, in_features: int) -> int:
    """Bytes one packed weight holds: padded int8 entries, int32 row sums, fp32 scales."""
    k_pad = -(-in_features // _K_ALIGN) * _K_ALIGN
    n_pad = -(-out_features // _N_ALIGN) * _N_ALIGN
    return n_pad * k_pad + 8 * out_features


def int8_linear(x: torch.Tensor, w: PackedInt8Weight, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x (..., K) float -> (..., N) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if w.layout == "vnni":
        y = _int8_linear_native(native(), rows.float().contiguous(), w, bias)
    else:
        y = _int8_linear_torch(rows.float(), w, bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def _int8_linear_native(lib, x: torch.Tensor, w: PackedInt8Weight, bias) -> torch.Tensor:
    m, k = x.shape
    k_pad = w.packed.shape[1]
    y = torch.empty(m, w.out_features)
    workspace = torch.empty(m * 2 * k_pad + 4 * m, dtype=torch.uint8)
    lib.int8_linear(ptr(x), m, k, ptr(w.packed), ptr(w.row_sums), ptr(w.scale),
                    ptr(bias), w.out_features, ptr(y), ptr(workspace))
    return y


def _int8_linear_torch(x: torch.Tensor, w: PackedInt8Weight, bias) -> torch.Tensor:
    """The same arithmetic in torch ops (any device), on a plain-layout weight."""
    n = x.shape[0]
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=_EPS).div_(127.0)  # (n, 1)
    t = x / scale  # in [-127, 127]
    hi = t.round()
    lo = (t - hi).mul_(254.0).round_()  # the remainder, in [-127, 127]
    parts = torch.cat([hi, lo]).to(torch.int8)
    if x.device.type == "cuda" and n <= 16:  # cuBLAS int8 GEMM wants more than 16 rows
        parts = torch.cat([parts, parts.new_zeros(17 - n, parts.shape[1])])
    acc = torch._int_mm(parts, w.packed.t()).float()  # (2n, out)
    y = (acc[:n] + acc[n : 2 * n] * (1 / 254.0)) * scale * w.scale
    if bias is not None:
        y = y + bias
    return y


class Int8LinearMethod(PackedLinearMethod):
    """Loads float weights, then keeps only the packed int8 weight and per-channel scales."""

    pack = PackedInt8Weight
    compute = staticmethod(int8_linear)


def int8_head(weight: torch.Tensor) -> PackedHead:
    """An int8 copy of the LM head (or of the tied embedding) for `compute_logits`."""
    return PackedHead(PackedInt8Weight(weight), int8_linear)
