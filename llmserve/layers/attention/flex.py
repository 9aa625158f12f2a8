"""The flex_attention backend: the paged KV cache read in place through a block mask (the
CUDA backend; on the CPU it runs eagerly, and tests check it against the others)."""

import contextlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from llmserve.layers.attention.backend import (
    PYTHON_ATTENTION,
    AttentionBackend,
    python_attention_op,
)


class FlexAttentionBackend(AttentionBackend):
    """`flex_attention` over the paged cache, read in place: the CUDA backend (it also runs
    on the CPU, where the native kernel is faster; tests check the two agree).

    The step's sequences are flex's batch: sequence b's queries are padded to the longest
    chunk, and its keys are the physical slots of its own blocks. The block mask lists, for
    each tile of 16-128 queries, exactly the cache blocks that tile can see, in logical
    order, so a sequence's cost grows with its own length; padded query rows see nothing.
    Within a listed block the mask maps the slot back to its logical position (a per-step
    physical-to-logical table) and keeps keys at or before the query's position. Nothing is
    gathered and no row is padded to the batch's longest context.

    The mask's tables are persistent buffers (same tensors every step, so the compiled
    kernel is compiled once per shape bucket); the per-step plan is built once, by the first
    layer, and reused by the others.
    """

    name = "flex"

    def __init__(self, compiled: bool = True) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.flex = torch.compile(flex_attention, dynamic=True) if compiled else flex_attention
        self.block_size = 0
        self.tables = self.logical = self.q_pos = None  # the mask's persistent buffers
        self.plan_key: tuple | None = None  # (the step's block_tables tensor, its plan)

    def forward(self, q, k, v, cache, meta, scale, window=0, softcap=0.0):
        if cache.key.dtype == torch.int8:
            raise ValueError("kv_cache_dtype int8 needs the native CPU kernels")
        if torch.compiler.is_compiling():  # one opaque op in the model's graph
            return python_attention_op(self.name, q, k, v, cache, meta, scale, window,
                                       softcap)
        return self.attend(q, k, v, cache.key, cache.value, meta.slot_mapping,
                           meta.block_tables, meta.query_start, meta.context_lens,
                           meta.block_size, scale, window, softcap)

    def attend(self, q, k, v, key_cache, value_cache, slot_mapping, block_tables,
               query_start, context_lens, block_size, scale, window=0,
               softcap=0.0) -> torch.Tensor:
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, k.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, v.to(value_cache.dtype))
        plan = self.plan(block_tables, query_start, context_lens, block_size,
                         key_cache.shape[0], window)
        num_seqs, padded_len = len(context_lens), plan.padded_len
        t, h, d = q.shape
        dtype = q.dtype
        q = q.to(key_cache.dtype)
        if plan.dest is not None:  # pad each sequence's queries to the longest chunk
            q = q.new_zeros(num_seqs * padded_len, h, d).index_copy_(0, plan.dest, q)
        q = q.view(num_seqs, padded_len, h, d).transpose(1, 2)
        keys = key_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = value_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        with _flex_compile_settings():
            out = self.flex(q, keys, values, block_mask=plan.block_mask, scale=scale,
                            enable_gqa=h != num_kv_heads, kernel_options=plan.kernel_options,
                            score_mod=_softcap_score_mod(softcap) if softcap else None)
        out = out.transpose(1, 2).reshape(num_seqs * padded_len, h, d)
        if plan.dest is not None:
            out = out.index_select(0, plan.dest)
        return out.to(dtype)

    def plan(self, block_tables, query_start, context_lens, block_size,
             num_blocks, window=0) -> SimpleNamespace:
        """The step's block mask and query layout, built once for all layers (once per
        window size: local and global layers differ only in the mask)."""
        if self.plan_key is not None and self.plan_key[0] is block_tables:
            plans = self.plan_key[1]
        else:
            plans = {}
            self.plan_key = (block_tables, plans)
        if window not in plans:
            plans[window] = self._build_plan(block_tables, query_start, context_lens,
                                             block_size, num_blocks, window)
        return plans[window]

    def _build_plan(self, block_tables, query_start, context_lens, block_size, num_blocks,
                    window) -> SimpleNamespace:
        from torch.nn.attention.flex_attention import BlockMask

        device = block_tables.device
        starts = np.asarray(query_start, dtype=np.int64)
        query_lens, contexts = np.diff(starts), np.asarray(context_lens, dtype=np.int64)
        num_seqs, width = block_tables.shape
        # query rows per sequence: 1 (decodes) or a power of two, so that the kernel is
        # compiled for a handful of shapes (dynamo guards split on the query length)
        padded_len = 1 if query_lens.max() == 1 else max(16, _pow2(query_lens.max()))
        q_block = 16 if padded_len <= 16 else 64
        num_q_blocks = -(-padded_len // q_block)
        # the kernel evaluates the mask on whole query tiles, padded rows included
        self._fit_buffers(num_seqs, width, num_q_blocks * q_block, block_size, num_blocks,
                          device)

        # the mask's tables: each sequence's blocks, their logical index, query positions
        used = (contexts + query_lens + block_size - 1) // block_size  # blocks each reads
        logical = torch.arange(width, dtype=torch.int32, device=device).expand(num_seqs, -1)
        in_use = logical < torch.from_numpy(used).to(device)[:, None]
        columns = torch.where(in_use, block_tables, num_blocks)  # the rest: a spare column
        self.tables[:num_seqs, :width] = block_tables
        self.logical[:num_seqs].scatter_(1, columns.long(), logical)
        positions = contexts[:, None] + np.arange(num_q_blocks * q_block)[None, :]
        self.q_pos[:num_seqs, :positions.shape[1]] = torch.from_numpy(positions).to(device)

        # per query tile: how many of the sequence's blocks (in logical order) it sees
        tile_end = np.minimum((np.arange(num_q_blocks)[None, :] + 1) * q_block,
                              query_lens[:, None])  # (B, tiles) one past its last query
        seen = (contexts[:, None] + tile_end - 1) // block_size + 1
        seen[np.arange(num_q_blocks)[None, :] * q_block >= query_lens[:, None]] = 0
        kv_num_blocks = torch.from_numpy(seen.astype(np.int32)).to(device)[:, None]
        kv_indices = block_tables[:, None, None, :].expand(
            num_seqs, 1, num_q_blocks, width).contiguous()
        block_mask = BlockMask.from_kv_blocks(
            kv_num_blocks, kv_indices, BLOCK_SIZE=(q_block, block_size),
            mask_mod=self.windowed_mask_mod(window) if window else self.mask_mod,
            seq_lengths=(padded_len, num_blocks * block_size), compute_q_blocks=False)
        dest = None
        if padded_len > 1:
            seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
            offsets = np.arange(len(seq_of_token)) - starts[seq_of_token]
            dest = torch.from_numpy(seq_of_token * padded_len + offsets).to(device)
        return SimpleNamespace(
            block_mask=block_mask, padded_len=padded_len, dest=dest,
            kernel_options={"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": q_block,
                            "BLOCK_N": block_size})

    def _fit_buffers(self, num_seqs, width, query_rows, block_size, num_blocks,
                     device) -> None:
        """(Re)allocate the mask's buffers when the step outgrows them (rarely: sizes round
        up to powers of two)."""
        have = self.tables
        if (have is not None and have.device == device and self.block_size == block_size
                and have.shape[0] >= num_seqs and have.shape[1] >= width
                and self.q_pos.shape[1] >= query_rows
                and self.logical.shape[1] == num_blocks + 1):
            return
        rows = max(_pow2(num_seqs), 0 if have is None else have.shape[0])
        cols = max(_pow2(width), 0 if have is None else have.shape[1])
        lens = max(_pow2(query_rows), 0 if have is None else self.q_pos.shape[1])
        self.block_size = block_size
        self.tables = torch.zeros(rows, cols, dtype=torch.int32, device=device)
        self.logical = torch.zeros(rows, num_blocks + 1, dtype=torch.int32, device=device)
        self.q_pos = torch.zeros(rows, lens, dtype=torch.int64, device=device)

    def mask_mod(self, b, h, q_idx, kv_idx):
        """Key slot kv_idx is visible to query q_idx of sequence b: its block is one of b's
        blocks, and its logical position is at or before the query's."""
        block = kv_idx // self.block_size
        logical = self.logical[b, block]
        own = self.tables[b, logical] == block
        return own & (logical * self.block_size + kv_idx % self.block_size
                      <= self.q_pos[b, q_idx])

    def windowed_mask_mod(self, window: int):
        """`mask_mod`, and the key within the last `window` positions of the query's."""
        def mask_mod(b, h, q_idx, kv_idx):
            block = kv_idx // self.block_size
            logical = self.logical[b, block]
            key_pos = logical * self.block_size + kv_idx % self.block_size
            q_pos = self.q_pos[b, q_idx]
            own = self.tables[b, logical] == block
            return own & (key_pos <= q_pos) & (key_pos > q_pos - window)
        return mask_mod


def _softcap_score_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap
    return score_mod


def _flex_compile_settings() -> Any:
    """torch's default shape settings for compiling flex_attention, also when called from
    inside the compiled model step (whose size-oblivious settings are active while it runs,
    and under which the compiled flex kernel computed wrong results on CUDA), and room for
    its few shape buckets."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    stack = contextlib.ExitStack()
    stack.enter_context(fx_config.patch(backed_size_oblivious=False, use_duck_shape=True))
    stack.enter_context(dynamo_config.patch(recompile_limit=64))
    return stack


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


_FLEX_BACKENDS: dict[torch.device, FlexAttentionBackend] = {}


def flex_backend(device: torch.device) -> FlexAttentionBackend:
    """One flex backend (and its persistent mask buffers) per device."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _FLEX_BACKENDS:
        _FLEX_BACKENDS[device] = FlexAttentionBackend(compiled=device.type == "cuda")
    return _FLEX_BACKENDS[device]


def _attend_in_op(q, *args) -> torch.Tensor:
    """The flex backend inside the opaque op of a compiled step (`python_attention_op`)."""
    return flex_backend(q.device).attend(q, *args)


PYTHON_ATTENTION[FlexAttentionBackend.name] = _attend_in_op
