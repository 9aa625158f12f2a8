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

Backends (picked per device, or by name: `selector.attention_backend`):
* `NativeCPUBackend` (`native.py`): one C++ call per layer for every query of the step,
  decode or prompt (its cost is each sequence's own length; no gather, no padding).
* `FlexAttentionBackend` (CUDA, `flex.py`): compiled `flex_attention` reading the
  paged cache in place through a block mask built from the block tables; likewise no
  gather, no padding.
* `TorchBackend` (`backend.py`; no compiler, no flex): gathers each sequence's blocks and
  calls SDPA.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads,
head_dim]` in the cache dtype; an int8 cache adds one fp32 scale per (slot, kv head)
(`layers/kv_cache.py`).
"""
