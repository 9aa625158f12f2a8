"""The native CPU backend: the C++ paged kernel for every query, and the same kernels as
torch ops for a compiled step."""

import torch

from llmserve.kernels import native, ptr
from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.kv_cache import KERNEL_KV_DTYPES


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
    lib.kv_cache_write(
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
    lib.paged_attention(
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
