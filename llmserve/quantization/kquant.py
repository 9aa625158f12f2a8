"""kquant: GGUF weights run in the file's own bits: the K-quants (Q3_K, Q4_K, Q5_K, Q6_K),
IQ4_XS and the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

A tensor is not re-quantized: its blocks are re-laid once at load for the native kernel
(`gemm_kquant.cpp`: 16 channels x 256 k per record, the codes, sub-block scales and mins
and fp16 scales of the file: 4.6 / 4.6 / 5.6 / 6.6 bits a weight for the K-quants, 4.3 for
IQ4_XS (its codes looked up in its 16 int8 levels in registers), the file's
own 4.5 / 5 / 5.5 / 6 / 8.5 for the legacy types), and the product dequantizes nothing:
per row and super-block of 256 k the activations are int8 with one scale (llama.cpp's
Q8_K), the dot products are exact integer sums scaled by the file's scales, and the float
epilogue runs over the blocks in order, so a request's outputs do not depend on the batch
(nor on the instruction-set level).

A linear whose parts the file stores in different K-quant types (a Q4_K_M file's fused
q|k|v with a Q6_K v) keeps each part in its own type: a weight is up to four segments of
rows, each one type; the activations are quantized once for all of them.
"""

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from llmserve.kernels import native, ptr
from llmserve.layers.embedding import PackedEmbedding
from llmserve.layers.linear import Linear, LinearMethod, PackedHead

SUPER = 256
_N_ALIGN = 16
# GGUF type -> the kernel's type id (kernels.h `KQuantType`)
KQUANT_TYPES = {QT.Q4_K: 0, QT.Q5_K: 1, QT.Q6_K: 2, QT.Q4_0: 3, QT.Q4_1: 4, QT.Q5_0: 5,
                QT.Q5_1: 6, QT.Q8_0: 7, QT.Q3_K: 8, QT.IQ4_XS: 9}
LEGACY_TYPES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0})
_MAX_SEGMENTS = 4
# per 256 values: one K-quant block, eight legacy blocks of 32
GGUF_BLOCK_BYTES = {QT.Q3_K: 110, QT.IQ4_XS: 136, QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210,
                    QT.Q4_0: 8 * 18, QT.Q4_1: 8 * 20, QT.Q5_0: 8 * 22, QT.Q5_1: 8 * 24,
                    QT.Q8_0: 8 * 34}
# a packed record (16 channels x 256 k; gemm_kquant.cpp's `Layout`): codes, high bits,
# then sub-block scales and mins and fp16 d and dmin (K-quants), or fp16 d and m per block
# of 32 (legacy)
RECORD_BYTES = {QT.Q4_K: 2048 + 128 + 128 + 64, QT.Q5_K: 2048 + 512 + 128 + 128 + 64,
                QT.Q6_K: 2048 + 1024 + 256 + 32, QT.Q4_0: 2048 + 256, QT.Q4_1: 2048 + 512,
                QT.Q5_0: 2048 + 512 + 256, QT.Q5_1: 2048 + 512 + 512, QT.Q8_0: 4096 + 256,
                QT.Q3_K: 2048 + 256 + 32, QT.IQ4_XS: 2048 + 128 + 32}


@dataclass
class RawBlocks:
    """A GGUF tensor as stored: `rows` x (columns / 256) blocks of `qtype`, `data` a uint8
    array (rows, bytes per row) (a view of the file, or a copy after a row permutation)."""

    qtype: QT
    data: np.ndarray
    columns: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def take_rows(self, index: np.ndarray | slice) -> "RawBlocks":
        return RawBlocks(self.qtype, self.data[index], self.columns)


def main_block_type(blocks: dict[str, RawBlocks]) -> str:
    """The GGUF type of most of `blocks`' bytes ("Q4_K" if none): what a file's linears
    are timed in."""
    size: dict[str, int] = {}
    for raw in blocks.values():
        size[raw.qtype.name] = size.get(raw.qtype.name, 0) + raw.data.nbytes
    return max(size, key=size.get) if size else "Q4_K"


class _Segment(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("rows", ctypes.c_int64), ("packed", ctypes.c_void_p)]


class _Weight(ctypes.Structure):
    _fields_ = [("num_segments", ctypes.c_int64), ("segments", _Segment * _MAX_SEGMENTS),
                ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64)]


def can_pack(parts: list[RawBlocks]) -> bool:
    """Whether `parts` (a linear's row blocks, in order) run as one weight on their blocks:
    every part a type of KQUANT_TYPES over the same columns (a multiple of 256), at most
    four runs of one type, each run but the last a multiple of 16 rows (a record holds 16
    channels)."""
    if not parts or len({p.columns for p in parts}) != 1:
        return False
    return packed_kquant_bytes([(p.qtype, p.rows) for p in parts], parts[0].columns) is not None


def packed_kquant_bytes(parts: list[tuple[QT | None, int]], columns: int) -> int | None:
    """Bytes of a K-quant weight of `parts` ((type, rows) in order) over `columns`; None
    where it cannot be one (`can_pack`)."""
    if not parts or any(t not in KQUANT_TYPES for t, _ in parts) or columns % SUPER:
        return None
    runs = [(_type(run[0]), sum(_rows(p) for p in run)) for run in _runs(parts)]
    if len(runs) > _MAX_SEGMENTS or any(rows % _N_ALIGN for _, rows in runs[:-1]):
        return None
    return sum(-(-rows // _N_ALIGN) * (columns // SUPER) * RECORD_BYTES[t] for t, rows in runs)


def _runs(parts: list) -> list[list]:
    """Consecutive parts of one type, grouped (RawBlocks or (type, rows) pairs)."""
    runs: list[list] = []
    for p in parts:
        if runs and _type(runs[-1][0]) == _type(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _type(part) -> QT | None:
    return part.qtype if isinstance(part, RawBlocks) else part[0]


def _rows(part) -> int:
    return part.rows if isinstance(part, RawBlocks) else part[1]


class PackedKQuantWeight:
    """A linear's K-quant row blocks (`can_pack`) packed for the native kernel."""

    def __init__(self, parts: list[RawBlocks]) -> None:
        lib = native()
        if lib is None:
            raise RuntimeError("K-quant weights need the native CPU kernels")
        self.in_features = parts[0].columns
        self.out_features = sum(p.rows for p in parts)
        self.types: list[QT] = []
        self.rows: list[int] = []
        self.segments: list[torch.Tensor] = []
        for run in _runs(parts):
            qtype, rows = run[0].qtype, sum(p.rows for p in run)
            # one part is read where it lies (a view of the file: no copy of it first)
            blocks = np.ascontiguousarray(
                run[0].data if len(run) == 1 else np.concatenate([p.data for p in run]))
            packed = torch.empty(-(-rows // _N_ALIGN), self.in_features // SUPER,
                                 RECORD_BYTES[qtype], dtype=torch.uint8)
            lib.pack_kquant(blocks.ctypes.data, KQUANT_TYPES[qtype], rows, self.in_features,
                            ptr(packed))
            self.types.append(qtype)
            self.rows.append(rows)
            self.segments.append(packed)
        self.struct = self._struct()

    def _struct(self) -> _Weight:
        """The kernel's view of the segments (pointers into them)."""
        struct = _Weight(len(self.segments))
        struct.out_features, struct.in_features = self.out_features, self.in_features
        for i, (qtype, rows, packed) in enumerate(
                zip(self.types, self.rows, self.segments, strict=True)):
            struct.segments[i] = _Segment(KQUANT_TYPES[qtype], rows, ptr(packed))
        return struct

    # pickled (a loaded model kept on disk, loader/weight_cache.py) without the pointers,
    # which are made again over the tensors as they are loaded
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "struct"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.struct = self._struct()

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"qweight_{i}": t for i, t in enumerate(self.segments)}

    @property
    def k_pad(self) -> int:  # the native stack sizes its workspace by this
        return self.in_features

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) of the weight as floats (T, K): a tied embedding's lookup. Raises
        IndexError for an id outside the rows."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if bool(((ids < 0) | (ids >= self.out_features)).any()):
            raise IndexError("token id out of range")
        lib = native()
        out = torch.empty(ids.numel(), self.in_features)
        start = 0
        for qtype, rows, packed in zip(self.types, self.rows, self.segments, strict=True):
            mine = (ids >= start) & (ids < start + rows)
            if bool(mine.any()):
                local = (ids[mine] - start).contiguous()
                part = torch.empty(local.numel(), self.in_features)
                lib.kquant_rows(ptr(packed), KQUANT_TYPES[qtype], rows,
                                self.in_features, ptr(local), local.numel(), ptr(part))
                out[mine] = part
            start += rows
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.segments)


def random_blocks(qtype: QT, rows: int, columns: int, generator: np.random.Generator
                  ) -> RawBlocks:
    """Blocks of `qtype` with random codes, scales and mins and small fp16 scales (every
    byte pattern is a valid block but Q8_0's -128, which ggml never writes): for timing the
    kernel on a shape, and for tests."""
    per_run = 8 if qtype in LEGACY_TYPES else 1  # GGUF blocks per 256 values
    size = GGUF_BLOCK_BYTES[qtype] // per_run
    data = generator.integers(0, 256, size=(rows, columns // SUPER * per_run, size),
                              dtype=np.uint8)
    scales = generator.uniform(1e-4, 1e-3, size=(*data.shape[:2], 2)).astype(np.float16)
    # d (and dmin, or m) in each block
    at = ((208,) if qtype == QT.Q6_K else (108,) if qtype == QT.Q3_K
          else (0,) if qtype in (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.IQ4_XS) else (0, 2))
    for i, offset in enumerate(at):
        data[..., offset:offset + 2] = scales[..., i:i + 1].view(np.uint8)
    if qtype == QT.Q8_0:  # int8 values in [-127, 127], as ggml writes them
        codes = data[..., 2:]
        codes[codes == 0x80] = 0x81
    return RawBlocks(qtype, data.reshape(rows, -1), columns)


def kquant_linear(x: torch.Tensor, w: PackedKQuantWeight, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x (..., K) float -> (..., N) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    m, k = rows.shape
    y = torch.empty(m, w.out_features)
    workspace = torch.empty(workspace_bytes(m, k), dtype=torch.uint8)
    bias = None if bias is None else bias.float().contiguous()
    native().kquant_linear(ptr(rows), m, k, w.address, ptr(bias), ptr(y), ptr(workspace))
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def workspace_bytes(rows: int, in_features: int) -> int:
    """The kernel's workspace for `rows` rows: int8 values, a scale per 256, sums per 16."""
    return rows * in_features + 4 * rows * (in_features // SUPER) + 4 * rows * (in_features // 16)


class KQuantLinearMethod(LinearMethod):
    """A linear on its file's K-quant blocks (`parts`: its row blocks in order); the float
    weight loaded beside them is dropped."""

    def __init__(self, parts: list[RawBlocks]) -> None:
        self.parts = parts

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.weight = PackedKQuantWeight(self.parts)
        self.parts = []
        for name, tensor in self.weight.tensors().items():
            layer.register_buffer(name, tensor)
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return kquant_linear(x, self.weight, layer.bias)


def kquant_embedding(parts: list[RawBlocks]) -> nn.Module:
    """An untied token embedding on its file blocks: each token's row dequantized from them
    (an 8B model's float32 table would take 2.1 GB)."""
    table = PackedKQuantWeight(parts)
    module = PackedEmbedding(table)
    for name, tensor in table.tensors().items():
        module.register_buffer(name, tensor)
    return module


def kquant_head(parts: list[RawBlocks]) -> PackedHead:
    """The LM head (or tied embedding) on its K-quant blocks; the embedding reads its rows
    from the same table (`embedding_rows`)."""
    return PackedHead(PackedKQuantWeight(parts), kquant_linear)
