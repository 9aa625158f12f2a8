"""Paged attention backends against dense causal attention, for every KV-cache dtype."""

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels import native
from llmserve.layers.attention.backend import AttentionMetadata, TorchBackend
from llmserve.layers.attention.flex import FlexAttentionBackend
from llmserve.layers.attention.native import NativeCPUBackend
from llmserve.layers.kv_cache import KVCache

H, H_KV, D, BLOCK = 6, 2, 32, 4
# (context already cached, new queries): decodes, a short chunk, long chunks with and
# without context; ordered by query length as the runner orders them
SEQUENCES = [(37, 1), (0, 1), (13, 1), (20, 5), (0, 25), (40, 30)]


def dense_reference(q, keys, values, context, window=0, softcap=0.0):
    """q (n, H, D) at positions context.., keys/values (context + n, H_kv, D); a query at
    p sees keys p - window + 1 .. p with a window; scores soft-capped with a softcap."""
    n, total, scale = q.shape[0], keys.shape[0], q.shape[-1] ** -0.5
    q_pos, key_pos = torch.arange(n)[:, None] + context, torch.arange(total)[None, :]
    mask = key_pos <= q_pos
    if window:
        mask &= key_pos > q_pos - window
    if softcap:  # written out: SDPA has no soft-cap
        k = keys.repeat_interleave(H // H_KV, dim=1).transpose(0, 1)
        v = values.repeat_interleave(H // H_KV, dim=1).transpose(0, 1)
        scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, -1) @ v).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
        scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def run(backend, dtype, device="cpu", block=BLOCK, window=0, softcap=0.0, head_dim=D):
    """The SEQUENCES as one step, their contexts cached by an earlier step (on `device`,
    with `block` tokens a cache block); inputs are made on the CPU, outputs come back there."""
    D = head_dim  # noqa: N806 (the module's default, shadowed)
    torch.manual_seed(0)
    num_blocks = 64 * BLOCK // block
    cache = KVCache.allocate(1, num_blocks, block, H_KV, D, dtype, device=device)
    free = list(torch.randperm(num_blocks - 1).add(1).tolist())  # scattered block ids
    block_ids, history, queries, news = [], [], [], []
    for context, n in SEQUENCES:
        blocks = [free.pop() for _ in range(-(-(context + n) // block))]
        block_ids.append(blocks)
        k_all, v_all = torch.randn(context + n, H_KV, D), torch.randn(context + n, H_KV, D)
        history.append((k_all, v_all))
        queries.append(torch.randn(n, H, D))
        news.append((k_all[context:], v_all[context:]))
    # first fill the cached contexts through the backend itself (as earlier steps would)
    has_ctx = [i for i, (c, _) in enumerate(SEQUENCES) if c]
    order = sorted(has_ctx, key=lambda i: SEQUENCES[i][0])
    ctx_meta = AttentionMetadata.build(
        [SEQUENCES[i][0] for i in order], [0] * len(order), [block_ids[i] for i in order],
        block, device=device, backend=backend)
    k_ctx = torch.cat([history[i][0][: SEQUENCES[i][0]] for i in order]).to(device)
    v_ctx = torch.cat([history[i][1][: SEQUENCES[i][0]] for i in order]).to(device)
    backend.forward(torch.zeros(k_ctx.shape[0], H, D, device=device), k_ctx, v_ctx,
                    cache.layer(0), ctx_meta, D**-0.5, window, softcap)
    meta = AttentionMetadata.build(
        [n for _, n in SEQUENCES], [c for c, _ in SEQUENCES], block_ids, block,
        device=device, backend=backend)
    out = backend.forward(torch.cat(queries).to(device),
                          torch.cat([k for k, _ in news]).to(device),
                          torch.cat([v for _, v in news]).to(device), cache.layer(0), meta,
                          D**-0.5, window, softcap)
    return out.float().cpu(), queries, history, meta


def eager_flex():
    """The CUDA backend's algorithm on the CPU: flex_attention uncompiled."""
    return FlexAttentionBackend(compiled=False)


BACKENDS = [TorchBackend, eager_flex] + ([NativeCPUBackend] if native() is not None else [])


def max_diff_to_dense(out, queries, history, meta, window=0, softcap=0.0) -> float:
    worst = 0.0
    for b, (context, _) in enumerate(SEQUENCES):
        rows = slice(meta.query_start[b], meta.query_start[b + 1])
        ref = dense_reference(queries[b], *history[b], context, window, softcap)
        worst = max(worst, (out[rows] - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_backend_matches_dense_attention_fp32(backend_cls):
    diff = max_diff_to_dense(*run(backend_cls(), torch.float32))
    print(f"{backend_cls.__name__}: max |diff| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("head_dim", [48, 64, 80, 128, 256])
def test_native_kernel_matches_dense_attention_at_every_head_size(head_dim, kernel_level):
    """Head sizes with their own compiled-in loops (64, 80, 128, 256) and one without (48),
    decodes and chunks alike."""
    if native() is None:
        pytest.fail("the native kernels must build on the CPU test machines")
    diff = max_diff_to_dense(*run(NativeCPUBackend(), torch.float32, head_dim=head_dim))
    assert diff <= 1e-5


@pytest.mark.parametrize("window,softcap", [(7, 0.0), (4, 0.0), (9, 3.0), (0, 2.0)])
@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_sliding_window_and_softcap_match_dense_attention(backend_cls, window, softcap):
    """Windows shorter than, equal to and longer than a cache block (4 slots), across
    block boundaries and chunks, alone and with a soft-cap (Gemma 2/3's numerics)."""
    out, queries, history, meta = run(backend_cls(), torch.float32, window=window,
                                      softcap=softcap)
    diff = max_diff_to_dense(out, queries, history, meta, window, softcap)
    assert diff <= 1e-5, f"{backend_cls.__name__}: max |diff| = {diff:.2e}"
    unwindowed = max_diff_to_dense(out, queries, history, meta, 0, softcap)
    assert window == 0 or unwindowed > 1e-3  # the window did change what was seen


@pytest.mark.parametrize("window,softcap", [(7, 0.0), (0, 2.0)])
def test_native_window_and_softcap_at_every_level(window, softcap, kernel_level):
    out, queries, history, meta = run(NativeCPUBackend(), torch.float32, window=window,
                                      softcap=softcap)
    assert max_diff_to_dense(out, queries, history, meta, window, softcap) <= 1e-5


def test_flex_backend_with_shared_prefix_blocks_and_a_fresh_step():
    """Two sequences share their first blocks (a prefix-cache hit); the step after reuses
    the backend's buffers with other shapes (its plan is rebuilt, nothing stale is read)."""
    backend = eager_flex()
    torch.manual_seed(1)
    cache = KVCache.allocate(1, 32, BLOCK, H_KV, D, torch.float32)
    prefix_k, prefix_v = torch.randn(8, H_KV, D), torch.randn(8, H_KV, D)
    backend.forward(torch.zeros(8, H, D), prefix_k, prefix_v, cache.layer(0),
                    AttentionMetadata.build([8], [0], [[5, 9]], BLOCK, backend=backend),
                    D**-0.5)
    tails = [(torch.randn(3, H_KV, D), torch.randn(3, H_KV, D)) for _ in range(2)]
    queries = [torch.randn(3, H, D) for _ in range(2)]
    tables = [[5, 9, 2], [5, 9, 17]]
    meta = AttentionMetadata.build([3, 3], [8, 8], tables, BLOCK, backend=backend)
    out = backend.forward(torch.cat(queries), torch.cat([k for k, _ in tails]),
                          torch.cat([v for _, v in tails]), cache.layer(0), meta, D**-0.5)
    for b in range(2):
        keys = torch.cat([prefix_k, tails[b][0]])
        values = torch.cat([prefix_v, tails[b][1]])
        ref = dense_reference(queries[b], keys, values, 8)
        assert (out[3 * b: 3 * b + 3] - ref).abs().max().item() <= 1e-5
    # next step: one decode of sequence 1 alone (position 11, block 17 offset 3)
    q, k, v = torch.randn(1, H, D), torch.randn(1, H_KV, D), torch.randn(1, H_KV, D)
    meta = AttentionMetadata.build([1], [11], [tables[1]], BLOCK, backend=backend)
    out = backend.forward(q, k, v, cache.layer(0), meta, D**-0.5)
    keys = torch.cat([prefix_k, tails[1][0], k])
    values = torch.cat([prefix_v, tails[1][1], v])
    assert (out - dense_reference(q, keys, values, 11)).abs().max().item() <= 1e-5


def test_flex_plan_lists_exactly_the_blocks_each_query_tile_sees():
    """The block mask (what the compiled kernel iterates; eager flex only applies the
    mask): tile j of sequence b lists b's blocks up to the one holding its last query's
    position, in logical order, and padded tiles list none."""
    lens = [(37, 1), (0, 40), (20, 17), (5, 0 + 1)]
    block = 16
    free = iter(torch.randperm(60).tolist())
    tables = [[next(free) for _ in range(-(-(c + n) // block))] for c, n in lens]
    meta = AttentionMetadata.build([n for _, n in lens], [c for c, _ in lens], tables, block)
    plan = eager_flex().plan(meta.block_tables, meta.query_start, meta.context_lens, block, 60)
    mask = plan.block_mask
    tile = mask.BLOCK_SIZE[0]
    assert plan.padded_len == 64 and tile == 64  # 40 queries, rounded to a power of two
    for b, (context, n) in enumerate(lens):
        for j in range(mask.kv_num_blocks.shape[2]):
            count = int(mask.kv_num_blocks[b, 0, j])
            listed = mask.kv_indices[b, 0, j, :count].tolist()
            last = min((j + 1) * tile, n) - 1
            want = tables[b][: (context + last) // block + 1] if j * tile < n else []
            assert listed == want, (b, j)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.03),
                                             (torch.float16, 0.01)])
def test_flex_backend_compiled_on_cuda(dtype, tolerance):
    """The CUDA backend as the engine runs it: compiled flex_attention, 16-token blocks."""
    diff = max_diff_to_dense(*run(FlexAttentionBackend(), dtype, "cuda", block=16))
    print(f"flex on cuda, {dtype}: max |diff| = {diff:.2e}")
    assert diff <= tolerance


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 0.03), (torch.int8, 0.03)])
def test_native_backend_with_compact_kv_cache(dtype, tolerance, kernel_level):
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


def test_native_kernel_rows_do_not_depend_on_the_batch(kernel_level):
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
