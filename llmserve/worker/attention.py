"""Paged attention over a block-table KV cache, for a flat batch of prefill chunks and decodes.

Token layout of one forward (T tokens in all):

    | seq 0 queries | seq 1 queries | ... |      query_start[b] .. query_start[b + 1]

Sequence b's queries sit at positions `context_lens[b] + i` and attend causally to its
cached keys `0 .. context_lens[b] + i` through row b of `block_tables` (with a sliding
`window`, only to the last `window` of them: keys `p - window + 1 .. p` for position p;
a `softcap` squashes scores as softcap * tanh(score / softcap)). New keys/values are
written through `slot_mapping` (slot = block_id * block_size + offset) before attention
reads them back, in place. Blocks wholly out of a layer's window are not read, but stay
allocated (every layer shares one block table, and global layers still read them).

Backends (picked per device, or by name: `attention_backend` below):
* `NativeCPUBackend`: one C++ call per layer for every query of the step, decode or prompt
  (its cost is each sequence's own length; no gather, no padding).
* `FlexAttentionBackend` (CUDA, `flex_attention.py`): compiled `flex_attention` reading the
  paged cache in place through a block mask built from the block tables; likewise no
  gather, no padding.
* `TorchBackend` (no compiler, no flex): gathers each sequence's blocks and calls SDPA.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads,
head_dim]` in the cache dtype; an int8 cache adds one fp32 scale per (slot, kv head).
"""

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.config import ATTENTION_BACKEND_CHOICES
from llmserve.kernels import native, ptr

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
KERNEL_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


@dataclass
class KVCache:
    """Paged K and V for every layer: each `[num_blocks, block_size, num_kv_heads, head_dim]`.

    An int8 cache keeps per-(slot, kv head) fp32 scales: `[num_blocks, block_size, H_kv]`.
    """

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    key_scales: list[torch.Tensor] | None = None
    value_scales: list[torch.Tensor] | None = None

    @property
    def block_size(self) -> int:
        return self.key[0].shape[1]

    @property
    def num_blocks(self) -> int:
        return self.key[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.key[0].dtype

    def layer(self, i: int) -> "LayerKV":
        scales = (None, None) if self.key_scales is None else (
            self.key_scales[i], self.value_scales[i])
        return LayerKV(self.key[i], self.value[i], *scales)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        device = self.key[0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        tensors = [*self.key, *self.value, *(self.key_scales or []), *(self.value_scales or [])]
        for cache in tensors:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        zeroed: bool = True,
    ) -> "KVCache":
        """`zeroed=False` leaves memory untouched until written (no start-up cost, and the
        process's RSS grows with use): only for backends that never read unwritten slots."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        new = torch.zeros if zeroed else torch.empty

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            return [new(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        scales = (None, None)
        if dtype == torch.int8:
            scales = (zeros(shape[:3], torch.float32), zeros(shape[:3], torch.float32))
        return cls(zeros(shape, dtype), zeros(shape, dtype), *scales)


@dataclass
class LayerKV:
    key: torch.Tensor  # (num_blocks, block_size, H_kv, D)
    value: torch.Tensor
    key_scales: torch.Tensor | None = None  # (num_blocks, block_size, H_kv), int8 only
    value_scales: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the model runner, never global."""

    slot_mapping: torch.Tensor  # (T,) int64, where each new token's K/V is written
    query_start: list[int]  # (B + 1,) token offsets of each sequence's queries
    context_lens: list[int]  # (B,) tokens already cached before this step's queries
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    block_size: int
    backend: "AttentionBackend | None" = None  # None: the plain torch backend
    query_start_t: torch.Tensor = field(init=False)  # int32 tensors for the kernel
    context_lens_t: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.query_start_t = torch.tensor(self.query_start, dtype=torch.int32)
        self.context_lens_t = torch.tensor(self.context_lens, dtype=torch.int32)
        if self.backend is None:
            self.backend = TorchBackend()

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @classmethod
    def build(
        cls, query_lens: list[int], context_lens: list[int], block_ids: list[list[int]],
        block_size: int, device: torch.device | str = "cpu",
        backend: "AttentionBackend | None" = None,
    ) -> "AttentionMetadata":
        """From per-sequence query lengths, cached lengths and block ids (batch order)."""
        starts = [0]
        slots: list[int] = []
        for n, ctx, blocks in zip(query_lens, context_lens, block_ids, strict=True):
            starts.append(starts[-1] + n)
            slots.extend(blocks[p // block_size] * block_size + p % block_size
                         for p in range(ctx, ctx + n))
        width = max(-(-(c + n) // block_size) for c, n in zip(context_lens, query_lens,
                                                               strict=True))
        rows = [b[:width] + [0] * (width - len(b[:width])) for b in block_ids]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start=starts,
            context_lens=list(context_lens),
            block_tables=torch.tensor(rows, dtype=torch.int32, device=device),
            block_size=block_size,
            backend=backend,
        )

    @classmethod
    def from_block_table(
        cls, block_table: np.ndarray, rows: np.ndarray, query_lens: list[int],
        context_lens: list[int], positions: np.ndarray, block_size: int,
        device: torch.device | str = "cpu", backend: "AttentionBackend | None" = None,
    ) -> "AttentionMetadata":
        """What `build` gives, from rows of a persistent block table, with a few vectorised
        ops (no Python per token or per block).

        block_table: (R, W) int32, zero past each row's blocks; rows: (B,) each sequence's
        row; positions: (T,) int64, the position of every query token (sequence b's query
        i at context_lens[b] + i).
        """
        num_seqs = len(rows)
        width = max(-(-(c + n) // block_size) for c, n in zip(context_lens, query_lens,
                                                               strict=True))
        tables = block_table[rows, :width]  # (B, width), a copy
        if len(positions) == num_seqs:  # one query per sequence (decodes)
            seq_of_token = np.arange(num_seqs)
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), query_lens)  # (T,)
        blocks = tables[seq_of_token, positions // block_size].astype(np.int64)  # (T,)
        return cls(
            slot_mapping=torch.from_numpy(blocks * block_size + positions % block_size).to(
                device),
            query_start=list(itertools.accumulate(query_lens, initial=0)),
            context_lens=list(context_lens),
            block_tables=torch.from_numpy(tables).to(device),
            block_size=block_size,
            backend=backend,
        )


class AttentionBackend:
    """Writes a layer's new K/V into the paged cache, then attends every query.

    `forward(q (T, H, D), k/v (T, H_kv, D), cache, meta, scale, window, softcap)
    -> (T, H, D)`; it must not depend on module-global state, and a sequence's output must
    not depend on the others. `window` 0 and `softcap` 0.0 mean none.
    """

    # never reads a cache slot before writing it (then the cache may start unzeroed: SDPA
    # or flex over whole blocks masks unwritten slots, and 0 x NaN garbage is still NaN);
    # only such a backend reads int8 entries
    reads_only_written_slots = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                meta: AttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        raise NotImplementedError


class TorchBackend(AttentionBackend):
    """Plain torch: per-sequence gather of the cached blocks and SDPA (any device)."""

    name = "torch"

    def forward(self, q, k, v, cache, meta, scale, window=0, softcap=0.0):
        if cache.key.dtype == torch.int8:
            raise ValueError("kv_cache_dtype int8 needs the native CPU kernels")
        if torch.compiler.is_compiling():  # a per-sequence loop: one opaque op in the graph
            return _python_attention_op(self.name, q, k, v, cache, meta, scale, window,
                                        softcap)
        return _torch_attention(q, k, v, cache, meta, scale, window, softcap)


def _torch_attention(q, k, v, cache, meta, scale, window=0, softcap=0.0) -> torch.Tensor:
    num_kv_heads, head_dim = cache.key.shape[2], cache.key.shape[3]
    cache.key.view(-1, num_kv_heads, head_dim).index_copy_(
        0, meta.slot_mapping, k.to(cache.key.dtype))
    cache.value.view(-1, num_kv_heads, head_dim).index_copy_(
        0, meta.slot_mapping, v.to(cache.value.dtype))
    out = torch.empty_like(q)
    for b in range(len(meta.context_lens)):
        rows = slice(meta.query_start[b], meta.query_start[b + 1])
        out[rows] = _sdpa_from_cache(q[rows], k[rows], v[rows], cache, meta, b, scale,
                                     _gather_torch, window, softcap)
    return out


class NativeCPUBackend(AttentionBackend):
    """The C++ paged kernel for every query: decodes and prompt chunks alike.

    One algorithm for all queries means a query's output depends on nothing but its q and
    its keys: batching, chunked prefill, prefix-cache hits and preemption change no bits.
    (It is also faster than CPU SDPA at these head sizes: measured 1.5-3x at 128-1024
    tokens, one thread.)
    """

    reads_only_written_slots = True

    def __init__(self) -> None:
        self.lib = native()
        if self.lib is None:
            raise RuntimeError("native CPU kernels are not available")

    def forward(self, q, k, v, cache, meta, scale, window=0, softcap=0.0):
        if torch.compiler.is_compiling():  # ctypes cannot be traced: the same kernels as ops
            torch.ops.llmserve.kv_cache_write(k, v, meta.slot_mapping, cache.key, cache.value,
                                              cache.key_scales, cache.value_scales)
            return torch.ops.llmserve.paged_attention(
                q, cache.key, cache.value, cache.key_scales, cache.value_scales,
                meta.block_tables, meta.query_start_t, meta.context_lens_t, meta.block_size,
                scale, window, softcap)
        _kv_cache_write(self.lib, k, v, meta.slot_mapping, cache.key, cache.value,
                        cache.key_scales, cache.value_scales)
        return _paged_attention(self.lib, q, cache.key, cache.value, cache.key_scales,
                                cache.value_scales, meta.block_tables, meta.query_start_t,
                                meta.context_lens_t, meta.block_size, scale, window, softcap)


def _kv_cache_write(lib, k, v, slot_mapping, key_cache, value_cache, key_scales,
                    value_scales) -> None:
    """Native write of new k/v (T, H_kv, D) into the paged cache at `slot_mapping`."""
    t, num_kv_heads, d = k.shape
    k, v = _rows_of_heads(k), _rows_of_heads(v)
    if k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    lib.llmserve_kv_cache_write(
        ptr(k), ptr(v), k.stride(0), t, num_kv_heads, d, ptr(slot_mapping), ptr(key_cache),
        ptr(value_cache), ptr(key_scales), ptr(value_scales), KERNEL_KV_DTYPES[key_cache.dtype],
    )


def _paged_attention(lib, q, key_cache, value_cache, key_scales, value_scales, block_tables,
                     query_start, context_lens, block_size, scale, window=0,
                     softcap=0.0) -> torch.Tensor:
    """Native attention of every query q (T, H, D) over its sequence's cached keys; the
    kernel computes in fp32, the result comes back in q's dtype."""
    t, h, d = q.shape
    dtype = q.dtype
    q = _rows_of_heads(q)
    out = torch.empty(t, h, d)
    lib.llmserve_paged_attention(
        ptr(q), q.stride(0), h, d, ptr(key_cache), ptr(value_cache), ptr(key_scales),
        ptr(value_scales), KERNEL_KV_DTYPES[key_cache.dtype], block_size, key_cache.shape[2],
        ptr(block_tables), block_tables.shape[1], ptr(query_start), ptr(context_lens),
        context_lens.shape[0], scale, window, softcap, ptr(out),
    )
    return out.to(dtype)


# The native kernels as torch ops, so that `torch.compile` keeps one graph across layers
# (dynamo cannot trace ctypes). The cache write mutates the cache in place; inductor
# re-inplaces it (no copy of the cache).
@torch.library.custom_op("llmserve::kv_cache_write",
                         mutates_args=("key_cache", "value_cache", "key_scales", "value_scales"))
def _kv_cache_write_op(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> None:
    _kv_cache_write(native(), k, v, slot_mapping, key_cache, value_cache, key_scales,
                    value_scales)


@torch.library.custom_op("llmserve::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        key_scales: torch.Tensor | None, value_scales: torch.Tensor | None,
                        block_tables: torch.Tensor, query_start: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int, scale: float,
                        window: int, softcap: float) -> torch.Tensor:
    return _paged_attention(native(), q, key_cache, value_cache, key_scales, value_scales,
                            block_tables, query_start, context_lens, block_size, scale,
                            window, softcap)


@_paged_attention_op.register_fake
def _(q, key_cache, value_cache, key_scales, value_scales, block_tables, query_start,
      context_lens, block_size, scale, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """fp32 (T, heads, D) whose heads are contiguous within a row (rows may be strided, as
    views into a fused qkv projection are); copies only when that does not hold."""
    x = x.float()
    d = x.shape[2]
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    return x


def _gather_torch(cache: LayerKV, which: str, block_ids: torch.Tensor,
                  total: int) -> torch.Tensor:
    data = cache.key if which == "key" else cache.value
    blocks = data[block_ids.long()]  # (n, bs, H_kv, D)
    return blocks.flatten(0, 1)[:total].transpose(0, 1)  # (H_kv, total, D)


def _sdpa_from_cache(q, k, v, cache, meta, b, scale, gather, window=0,
                     softcap=0.0) -> torch.Tensor:
    """Causal attention of sequence b's chunk over `| context | chunk |`. q: (n, H, D)."""
    n = q.shape[0]
    context = meta.context_lens[b]
    if context == 0 and not window:  # attends only to itself: the fresh k/v, no cache read
        keys, values, mask = k.transpose(0, 1), v.transpose(0, 1), None
    else:
        total = context + n
        if context == 0:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            table = meta.block_tables[b, : -(-total // meta.block_size)]
            keys = gather(cache, "key", table, total).to(q.dtype)
            values = gather(cache, "value", table, total).to(q.dtype)
        # query i sits at position context + i and sees keys 0 .. context + i
        q_pos = torch.arange(n, device=q.device)[:, None] + context
        key_pos = torch.arange(total, device=q.device)[None, :]
        mask = key_pos <= q_pos  # (n, total)
        if window:
            mask &= key_pos > q_pos - window
    if softcap:
        return _softcapped_attention(q, keys, values, mask, scale, softcap)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=True,
    )  # (H, n, D)
    return out.transpose(0, 1)


def _softcapped_attention(q, keys, values, mask, scale, softcap) -> torch.Tensor:
    """Attention with soft-capped scores (SDPA has no such option). q: (n, H, D); keys,
    values: (H_kv, total, D); mask: (n, total) or None (causal over the chunk itself)."""
    n, h = q.shape[0], q.shape[1]
    group = h // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1).float(), keys.float().transpose(1, 2)) * scale
    scores = torch.tanh(scores / softcap) * softcap  # (H, n, total)
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.float()).to(q.dtype).transpose(0, 1)


def _python_attention_op(name: str, q, k, v, cache: LayerKV, meta: AttentionMetadata,
                         scale: float, window: int, softcap: float) -> torch.Tensor:
    return torch.ops.llmserve.python_paged_attention(
        q, k, v, meta.slot_mapping, cache.key, cache.value, meta.block_tables,
        meta.query_start_t, meta.context_lens_t, meta.block_size, scale, name, window,
        softcap)


# The torch and flex backends as one op inside a compiled step: dynamo would specialize on
# their per-step Python (lists, plans), so the graph sees an opaque call instead.
@torch.library.custom_op("llmserve::python_paged_attention",
                         mutates_args=("key_cache", "value_cache"))
def _python_paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               slot_mapping: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor,
                               query_start: torch.Tensor, context_lens: torch.Tensor,
                               block_size: int, scale: float, backend: str, window: int,
                               softcap: float) -> torch.Tensor:
    if backend == "flex":
        from llmserve.worker.flex_attention import flex_backend

        out = flex_backend(q.device).attend(
            q, k, v, key_cache, value_cache, slot_mapping, block_tables,
            query_start.tolist(), context_lens.tolist(), block_size, scale, window, softcap)
    else:
        meta = SimpleNamespace(slot_mapping=slot_mapping, block_tables=block_tables,
                               block_size=block_size, query_start=query_start.tolist(),
                               context_lens=context_lens.tolist())
        out = _torch_attention(q, k, v, LayerKV(key_cache, value_cache), meta, scale, window,
                               softcap)
    # contiguous, as the fake promises: inductor reads the result with the fake's strides
    return out.contiguous()


@_python_paged_attention_op.register_fake
def _(q, k, v, slot_mapping, key_cache, value_cache, block_tables, query_start, context_lens,
      block_size, scale, backend, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def reads_only_written_slots(device: torch.device, name: str = "auto") -> bool:
    """Whether the backend for `device` never reads a cache slot before writing it (the
    native kernel reads keys < each query's position)."""
    return attention_backend(device, name).reads_only_written_slots


def attention_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """The backend `name` for `device`; "auto" is the fastest there: the native kernels on
    the CPU when they build, flex_attention on CUDA, else the plain torch one."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"attention_backend must be one of "
                         f"{', '.join(ATTENTION_BACKEND_CHOICES)}, "
                         f"not {name!r}")
    device = torch.device(device)
    if name == "native" or (name == "auto" and device.type == "cpu" and native() is not None):
        if device.type != "cpu":
            raise ValueError("attention_backend native runs on the CPU only")
        return NativeCPUBackend()
    if name == "flex" or (name == "auto" and device.type == "cuda" and _has_flex_attention()):
        if not _has_flex_attention():
            raise ValueError("attention_backend flex needs torch.nn.attention.flex_attention")
        from llmserve.worker.flex_attention import flex_backend

        return flex_backend(device)
    return TorchBackend()


def _has_flex_attention() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True
