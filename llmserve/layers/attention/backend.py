"""What every attention backend is given and must do (`AttentionMetadata`,
`AttentionBackend`), and the plain torch backend, the reference the others are checked
against. The token layout is drawn in `attention/__init__.py`."""

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.layers.kv_cache import LayerKV


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the model runner, never global."""

    slot_mapping: torch.Tensor  # (T,) int64, where each new token's K/V is written
    query_start: list[int]  # (B + 1,) token offsets of each sequence's queries
    context_lens: list[int]  # (B,) tokens already cached before this step's queries
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    block_size: int
    backend: "AttentionBackend | None" = None  # None: the plain torch backend
    # (sequence, first row, end row) of the step's tokens: queries of one image, which
    # attend to each other both ways (Gemma 3; `attend_within_images`), ending where the
    # image ends; set by the model runner
    image_spans: list[tuple[int, int, int]] = field(default_factory=list)
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
            return python_attention_op(self.name, q, k, v, cache, meta, scale, window,
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


def attend_within_images(out: torch.Tensor, q: torch.Tensor, cache: LayerKV,
                         meta: AttentionMetadata, scale: float, window: int = 0,
                         softcap: float = 0.0) -> None:
    """Rewrites the rows of `out` (T, H, D) that `meta.image_spans` names: each image's
    queries attend to every key of their image, the later ones too, besides all before
    it (within `window`, if any), as Gemma 3's decoder does; the backend, which ran
    first, wrote the step's K/V and attended causally. The keys are read back from the
    cache, so a chunk starting inside an image (a prefix hit) sees the same values as one
    starting before it."""
    for b, first, end in meta.image_spans:
        start = meta.query_start[b]
        total = meta.context_lens[b] + end - start  # keys through the image's last token
        table = meta.block_tables[b, : -(-total // meta.block_size)]
        keys = _gather_dequantized(cache, "key", table, total).to(q.dtype)
        values = _gather_dequantized(cache, "value", table, total).to(q.dtype)
        n = end - first
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device)
        if window:
            q_pos = torch.arange(n, device=q.device)[:, None] + (total - (end - first))
            mask &= torch.arange(total, device=q.device)[None, :] > q_pos - window
        rows = q[first:end]
        if softcap:
            out[first:end] = _softcapped_attention(rows, keys, values, mask, scale, softcap)
        else:
            out[first:end] = F.scaled_dot_product_attention(
                rows.transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
                enable_gqa=True).transpose(0, 1)


def _gather_dequantized(cache: LayerKV, which: str, block_ids: torch.Tensor,
                        total: int) -> torch.Tensor:
    """`_gather_torch`, int8 entries times their scales."""
    if cache.key.dtype != torch.int8:
        return _gather_torch(cache, which, block_ids, total)
    data, scales = (cache.key, cache.key_scales) if which == "key" else (
        cache.value, cache.value_scales)
    ids = block_ids.long()
    blocks = data[ids].float() * scales[ids].float().unsqueeze(-1)  # (n, bs, H_kv, D)
    return blocks.flatten(0, 1)[:total].transpose(0, 1)


def python_attention_op(name: str, q, k, v, cache: LayerKV, meta: AttentionMetadata,
                        scale: float, window: int, softcap: float) -> torch.Tensor:
    """Backend `name` (registered in `PYTHON_ATTENTION`) as one opaque op of a compiled
    graph."""
    return torch.ops.llmserve.python_paged_attention(
        q, k, v, meta.slot_mapping, cache.key, cache.value, meta.block_tables,
        meta.query_start_t, meta.context_lens_t, meta.block_size, scale, name, window,
        softcap)


def _torch_attention_in_op(q, k, v, key_cache, value_cache, slot_mapping, block_tables,
                           query_start, context_lens, block_size, scale, window,
                           softcap) -> torch.Tensor:
    meta = SimpleNamespace(slot_mapping=slot_mapping, block_tables=block_tables,
                           block_size=block_size, query_start=query_start,
                           context_lens=context_lens)
    return _torch_attention(q, k, v, LayerKV(key_cache, value_cache), meta, scale, window,
                            softcap)


# How the opaque op runs each backend, by name: `(q, k, v, key_cache, value_cache,
# slot_mapping, block_tables, query_start: list, context_lens: list, block_size, scale,
# window, softcap) -> (T, H, D)`. The op carries tensors and plain values only, not the
# backend; a backend's module registers it here (the flex one in `flex.py`).
PYTHON_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    TorchBackend.name: _torch_attention_in_op}


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
    out = PYTHON_ATTENTION[backend](
        q, k, v, key_cache, value_cache, slot_mapping, block_tables, query_start.tolist(),
        context_lens.tolist(), block_size, scale, window, softcap)
    # contiguous, as the fake promises: inductor reads the result with the fake's strides
    return out.contiguous()


@_python_paged_attention_op.register_fake
def _(q, k, v, slot_mapping, key_cache, value_cache, block_tables, query_start, context_lens,
      block_size, scale, backend, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
