"""Paged attention over a block-table KV cache, for a flat batch of prefill chunks and decodes.

Token layout of one forward (T tokens in all):

    | decode tokens: one per decoding sequence (B_d) | prefill chunk of seq 0 | chunk of seq 1 | ...

A sequence whose query length is 1 is a "decode" whatever its phase; all of them share one
batched attention call. Prefill chunks are attended one sequence at a time (their query
lengths differ); a chunk with no cached context attends only to itself, causally.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads,
head_dim]`. New keys/values are written through `slot_mapping` (slot = block_id *
block_size + offset) before attention reads them back through block tables.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens, `| context (cached) | chunk |`."""

    query_start: int  # index of the chunk's first token in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # (num_blocks_of_seq,) int64
    mask: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.context_len == 0:
            return  # attends only to itself: plain causal attention, no mask needed
        total = self.context_len + self.query_len
        device = self.block_table.device
        # query i sits at position context_len + i and sees keys 0..context_len + i
        q_pos = torch.arange(self.query_len, device=device)[:, None] + self.context_len
        self.mask = torch.arange(total, device=device)[None, :] <= q_pos  # (n, total)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the model runner, never global."""

    slot_mapping: torch.Tensor  # (T,) int64, where each new token's K/V is written
    num_decode_tokens: int  # the first B_d tokens are decodes
    decode_block_tables: torch.Tensor | None  # (B_d, max_blocks) int64, padded with 0
    decode_seq_lens: torch.Tensor | None  # (B_d,) context length incl. the new token
    prefills: list[PrefillChunk]
    block_size: int
    decode_mask: torch.Tensor | None = field(init=False, default=None)  # (B_d, 1, 1, L)

    def __post_init__(self) -> None:
        if self.num_decode_tokens:  # built once per step; every layer reuses it
            max_len = self.decode_block_tables.shape[1] * self.block_size
            self.decode_mask = build_decode_mask(self.decode_seq_lens, max_len)


def build_decode_mask(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor | None:
    """Key-validity mask for decodes gathered to `max_len` keys; None if no row is padded."""
    if bool((seq_lens == max_len).all()):
        return None
    valid = torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None]
    return valid[:, None, None, :]


@dataclass
class KVCache:
    """Paged K and V for every layer: each `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]

    @property
    def block_size(self) -> int:
        return self.key[0].shape[1]

    @property
    def num_blocks(self) -> int:
        return self.key[0].shape[0]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        device = self.key[0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        for cache in (*self.key, *self.value):
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
    ) -> "KVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            key=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            value=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: (T, H, D), k/v: (T, H_kv, D) for the new tokens -> output (T, H, D)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    n_dec = meta.num_decode_tokens
    if n_dec:
        out[:n_dec] = _decode_attention(q[:n_dec], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, H_kv, D) gathered by (B, n) block ids -> (B, H_kv, n*bs, D)."""
    b, n = block_tables.shape
    blocks = cache[block_tables]  # (B, n, bs, H_kv, D)
    return blocks.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One batched call for all single-token queries. q: (B, H, D) -> (B, H, D)."""
    keys = _gather(k_cache, meta.decode_block_tables)  # (B, H_kv, L, D)
    values = _gather(v_cache, meta.decode_block_tables)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
    )  # (B, H, 1, D)
    return out.squeeze(2)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk over `| context | chunk |`. q: (n, H, D) -> (n, H, D)."""
    n = chunk.query_len
    if chunk.context_len == 0:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True,
        )  # (H, n, D)
        return out.transpose(0, 1)
    total = chunk.context_len + n
    num_blocks = -(-total // k_cache.shape[1])
    table = chunk.block_table[:num_blocks].unsqueeze(0)
    keys = _gather(k_cache, table)[0, :, :total]  # (H_kv, total, D)
    values = _gather(v_cache, table)[0, :, :total]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=chunk.mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)
