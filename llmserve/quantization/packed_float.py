"""float32 weights packed for the native GEMM: the exact path's linears on the CPU.

No quantization: the weights are the float32 values, laid out per block of 16 output
channels as (K, 16) so the kernel (`gemm_f32.cpp`, `llmserve_f32_linear`) runs one fused
multiply-add per k for 16 outputs, on the kernels' own thread pool. Against torch's GEMM
(oneDNN/MKL under OpenMP) this

* skips OpenMP's wake-up per call (the exact path's linears ran at a fraction of the
  machine's speed under `OMP_WAIT_POLICY=PASSIVE`);
* makes each row's result independent of the batch (every row sums its products in k
  order, whatever tile it falls in);
* lets the Llama stack run as one native call on the exact path too (`llama_native.py`).

The sums run in another order than torch's, so logits differ from the reference in the
last bits only (the reference tests bound them at 1e-3 and require equal greedy tokens).
A tied embedding reads its rows from the packed head: one copy of the table.
"""

import torch
from torch import nn

from llmserve.kernels import native, ptr
from llmserve.layers.linear import Linear, LinearMethod, PackedHead, PackedLinearMethod

_N_ALIGN = 16


class PackedFloatWeight:
    """A float32 weight `(N, K)` as `(N_pad / 16, K, 16)`, padding channels zero."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self.k_pad = k
        n_pad = -(-n // _N_ALIGN) * _N_ALIGN
        self.packed = torch.empty(n_pad // _N_ALIGN, k, _N_ALIGN)
        native().pack_f32_weight(ptr(weight.float().contiguous()), n, k, ptr(self.packed))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed_weight": self.packed}

    def repeated(self, times: int) -> "PackedFloatWeight":
        """This weight's rows repeated `times` times down, as packing the repeated rows
        would make them (a kernel timing's weight, without packing it all); the row count
        must fill whole blocks of channels."""
        if self.out_features % _N_ALIGN:
            raise ValueError(f"{self.out_features} rows are not whole blocks of {_N_ALIGN}")
        copy = PackedFloatWeight.__new__(PackedFloatWeight)
        copy.__dict__.update(self.__dict__)
        copy.out_features = self.out_features * times
        copy.packed = self.packed.repeat(times, 1, 1)
        return copy

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) of the unpacked weight, `(T, K)` (embedding lookups)."""
        if self.packed.device.type == "cpu":
            # numpy's gather: torch's opens an OpenMP region from 6 rows on (576 columns),
            # whose idle worker then spins against the native kernels' threads on a small
            # machine (measured: the exact path's 6- to 8-token steps, a verification of 5
            # to 7 drafts, 1.3-1.4x a one-token step with it, about 1x without)
            index = ids.numpy()
            return torch.from_numpy(self.packed.numpy()[index // _N_ALIGN, :, index % _N_ALIGN])
        return self.packed[ids // _N_ALIGN, :, ids % _N_ALIGN]

    embedding_rows = rows  # the rows are the float values


def packed_float_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // _N_ALIGN) * _N_ALIGN * in_features * 4


def float_linear(x: torch.Tensor, w: PackedFloatWeight, bias: torch.Tensor | None = None,
                 init: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) float32 -> (..., N) float32. `init` (..., N): the multiply-adds continue
    from it (the partial sums of the k before this weight's), instead of from zero."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(rows.shape[0], w.out_features)
    start = None if init is None else init.reshape(-1, w.out_features).contiguous()
    native().f32_linear_from(ptr(rows), rows.shape[0], w.in_features, ptr(w.packed),
                             ptr(bias), ptr(start), w.out_features, ptr(y))
    return y.reshape(*x.shape[:-1], w.out_features)


def _eager_float_linear(x: torch.Tensor, w: PackedFloatWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype != torch.float32 or torch.compiler.is_compiling():
        raise RuntimeError("packed float32 weights take float32 inputs, eagerly")
    return float_linear(x, w, bias)


class PackedFloatLinearMethod(PackedLinearMethod):
    """The float method with the weight repacked for the native GEMM after loading."""

    pack = PackedFloatWeight
    compute = staticmethod(_eager_float_linear)


def can_pack_weights() -> bool:
    """The native kernels are there (at any instruction-set level)."""
    return native() is not None


def can_pack(model: nn.Module, dtype: torch.dtype) -> bool:
    """float32 CPU weights and `can_pack_weights`."""
    if dtype != torch.float32 or not can_pack_weights():
        return False
    return next(model.parameters()).device.type == "cpu"


def pack_float_model(model: nn.Module) -> None:
    """Repack every float `Linear` of a loaded float32 model (and its LM head, which a tied
    embedding then reads) for the native GEMM."""
    for module in model.modules():
        if isinstance(module, Linear) and type(module.method) is LinearMethod:
            module.method = PackedFloatLinearMethod()
            module.method.process_weights_after_loading(module)
    if getattr(model, "lm_head", False) is None and getattr(model, "holds_head", True):
        # (tied; a later pipeline stage holds neither)
        table = PackedFloatWeight(model.model.embed_tokens.weight.data)
        model.lm_head = PackedHead(table, lambda hidden, w: float_linear(hidden.float(), w))
        model.model.embed_tokens = model.lm_head.as_embedding()
