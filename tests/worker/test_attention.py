"""Paged attention backends against dense causal attention, for every KV-cache dtype."""

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels import native
from llmserve.worker.attention import (
    AttentionMetadata,
    KVCache,
    NativeCPUBackend,
    TorchBackend,
)

H, H_KV, D, BLOCK = 6, 2, 32, 4
# (context already cached, new queries): decodes, a short chunk, long chunks with and
# without context; ordered by query length as the runner orders them
SEQUENCES = [(37, 1), (0, 1), (13, 1), (20, 5), (0, 25), (40, 30)]


def dense_reference(q, keys, values, context):
    """q (n, H, D) at positions context.., keys/values (context + n, H_kv, D)."""
    n, total = q.shape[0], keys.shape[0]
    mask = torch.arange(total)[None, :] <= (torch.arange(n)[:, None] + context)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
        scale=D**-0.5, enable_gqa=True)
    return out.transpose(0, 1)


def run(backend, dtype):
    torch.manual_seed(0)
    num_blocks = 64
    cache = KVCache.allocate(1, num_blocks, BLOCK, H_KV, D, dtype)
    free = list(torch.randperm(num_blocks - 1).add(1).tolist())  # scattered block ids
    block_ids, history, queries, news = [], [], [], []
    for context, n in SEQUENCES:
        blocks = [free.pop() for _ in range(-(-(context + n) // BLOCK))]
        block_ids.append(blocks)
        k_all, v_all = torch.randn(context + n, H_KV, D), torch.randn(context + n, H_KV, D)
        history.append((k_all, v_all))
        queries.append(torch.randn(n, H, D))
        news.append((k_all[context:], v_all[context:]))
    # first fill the cached contexts through the backend itself (as earlier steps would)
    has_ctx = [i for i, (c, _) in enumerate(SEQUENCES) if c]
    order = sorted(has_ctx, key=lambda i: SEQUENCES[i][0])
    ctx_meta = AttentionMetadata.build(
        [SEQUENCES[i][0] for i in order], [0] * len(order), [block_ids[i] for i in order], BLOCK)
    k_ctx = torch.cat([history[i][0][: SEQUENCES[i][0]] for i in order])
    v_ctx = torch.cat([history[i][1][: SEQUENCES[i][0]] for i in order])
    backend.forward(torch.zeros(k_ctx.shape[0], H, D), k_ctx, v_ctx, cache.layer(0),
                    ctx_meta, D**-0.5)
    meta = AttentionMetadata.build(
        [n for _, n in SEQUENCES], [c for c, _ in SEQUENCES], block_ids, BLOCK, backend=backend)
    out = backend.forward(torch.cat(queries), torch.cat([k for k, _ in news]),
                          torch.cat([v for _, v in news]), cache.layer(0), meta, D**-0.5)
    return out, queries, history, meta


BACKENDS = [TorchBackend] + ([NativeCPUBackend] if native() is not None else [])


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_backend_matches_dense_attention_fp32(backend_cls):
    out, queries, history, meta = run(backend_cls(), torch.float32)
    for b, (context, _) in enumerate(SEQUENCES):
        rows = slice(meta.query_start[b], meta.query_start[b + 1])
        ref = dense_reference(queries[b], *history[b], context)
        diff = (out[rows] - ref).abs().max().item()
        print(f"{backend_cls.__name__} seq {b}: max |diff| = {diff:.2e}")
        assert diff <= 1e-5


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 0.03), (torch.int8, 0.03)])
def test_native_backend_with_compact_kv_cache(dtype, tolerance):
    if native() is None:
        pytest.fail("the native kernels must build on the CPU test machines")
    out, queries, history, meta = run(NativeCPUBackend(), dtype)
    worst = 0.0
    for b, (context, _) in enumerate(SEQUENCES):
        rows = slice(meta.query_start[b], meta.query_start[b + 1])
        ref = dense_reference(queries[b], *history[b], context)
        worst = max(worst, (out[rows] - ref).abs().max().item())
    print(f"{dtype}: max |diff| vs fp32 dense attention = {worst:.4f}")
    assert 0 < worst <= tolerance


def test_native_kernel_rows_do_not_depend_on_the_batch():
    if native() is None:
        pytest.fail("the native kernels must build on the CPU test machines")
    out, queries, history, meta = run(NativeCPUBackend(), torch.float32)
    # sequence 0 alone, its context cached again in a fresh cache
    backend = NativeCPUBackend()
    context, n = SEQUENCES[0]
    cache = KVCache.allocate(1, 16, BLOCK, H_KV, D, torch.float32)
    blocks = list(range(1, 1 + -(-(context + n) // BLOCK)))
    k_all, v_all = history[0]
    backend.forward(torch.zeros(context, H, D), k_all[:context], v_all[:context],
                    cache.layer(0), AttentionMetadata.build([context], [0], [blocks], BLOCK),
                    D**-0.5)
    alone = backend.forward(queries[0], k_all[context:], v_all[context:], cache.layer(0),
                            AttentionMetadata.build([n], [context], [blocks], BLOCK,
                                                    backend=backend), D**-0.5)
    assert torch.equal(alone, out[: n])
