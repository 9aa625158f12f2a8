"""How a model is split over tensor-parallel ranks (`distributed/parallel.py`) and reading
only a rank's slices of a GGUF file; no processes."""

import pytest
import torch

from llmserve.distributed.parallel import (
    ShardPlan,
    TensorParallel,
    attention_shard,
    split_evenly,
)
from llmserve.loader.gguf import load_gguf


def test_split_evenly_larger_parts_first_in_units():
    assert split_evenly(3, 2) == [range(0, 2), range(2, 3)]
    assert split_evenly(1536, 2, 32) == [range(0, 768), range(768, 1536)]
    assert split_evenly(1536, 3, 32) == [range(0, 512), range(512, 1024), range(1024, 1536)]
    assert split_evenly(100, 3, 32) == [range(0, 32), range(32, 64), range(64, 100)]
    assert split_evenly(10, 4, 32) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def test_default_model_heads_by_kv_group():
    """9 query heads, 3 KV heads: the split the issue names at TP=2, and TP=3."""
    assert attention_shard(9, 3, 0, 2) == attention_shard(9, 3, 0, 2)
    r0, r1 = attention_shard(9, 3, 0, 2), attention_shard(9, 3, 1, 2)
    assert (r0.kv_heads, r0.q_heads) == (range(0, 2), range(0, 6))
    assert (r1.kv_heads, r1.q_heads) == (range(2, 3), range(6, 9))
    for rank in range(3):
        shard = attention_shard(9, 3, rank, 3)
        assert shard.kv_heads == range(rank, rank + 1)
        assert shard.q_heads == range(3 * rank, 3 * rank + 3)


@pytest.mark.parametrize("heads,kv_heads,size", [(4, 1, 2), (4, 1, 3), (4, 2, 3), (8, 2, 4),
                                                 (9, 3, 2), (16, 4, 8)])
def test_every_query_head_once_with_its_own_kv_head(heads, kv_heads, size):
    group = heads // kv_heads
    seen = []
    for rank in range(size):
        shard = attention_shard(heads, kv_heads, rank, size)
        assert len(shard.q_heads) >= 1
        for q in shard.q_heads:  # a query head's KV head is on the same rank
            assert q // group in shard.kv_heads
        seen += list(shard.q_heads)
    assert sorted(seen) == list(range(heads))


def test_too_many_ranks_refused():
    with pytest.raises(ValueError, match="no query head"):
        attention_shard(4, 2, 0, 6)  # 3 ranks per KV head, 2 query heads each
    with pytest.raises(ValueError, match="exceeds"):
        ShardPlan.build(TensorParallel(0, 5), 4, 1, 128, 64)


def test_weight_slices_follow_the_plan():
    plan = ShardPlan.build(TensorParallel(1, 2), 9, 3, 1536, 49152)
    assert plan.weight_slices("model.layers.0.self_attn.q_proj.weight", 64) == (
        slice(384, 576), None)
    assert plan.weight_slices("model.layers.0.self_attn.k_proj.weight", 64) == (
        slice(128, 192), None)
    assert plan.weight_slices("model.layers.3.self_attn.o_proj.weight", 64) == (
        None, slice(384, 576))
    assert plan.weight_slices("model.layers.0.mlp.down_proj.weight", 64) == (
        None, slice(768, 1536))
    assert plan.weight_slices("model.embed_tokens.weight", 64) == (slice(24576, 49152), None)
    assert plan.weight_slices("model.norm.weight", 64) == (None, None)


def test_gguf_reads_a_rank_share_exactly(smollm2_gguf):
    """Quantized rows and column blocks read alone equal the full tensor sliced, for the
    projections split by rows (q, k: with llama.cpp's per-head permutation undone), by
    columns (o, down) and the vocabulary."""
    full = load_gguf(smollm2_gguf)
    plan = ShardPlan.build(TensorParallel(1, 2), 9, 3, 1536, 49152)
    wanted = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.o_proj.weight", "model.layers.5.mlp.down_proj.weight",
              "model.layers.5.mlp.gate_proj.weight", "model.embed_tokens.weight",
              "model.norm.weight"]
    share = load_gguf(smollm2_gguf, slices=lambda cfg, name: plan.weight_slices(
        name, cfg.head_dim))
    for name in wanted:
        rows, cols = plan.weight_slices(name, 64)
        expected = full.tensors[name]
        if rows is not None:
            expected = expected[rows]
        if cols is not None:
            expected = expected[:, cols]
        assert torch.equal(share.tensors[name], expected), name
