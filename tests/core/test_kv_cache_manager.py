"""KVCacheManager: block tables, chained prefix hashes, prefix hits and LRU reuse."""

import itertools

from llmserve.core.kv_cache_manager import KVCacheManager, hash_block
from llmserve.core.request import Request
from llmserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
_ids = itertools.count()


def make_request(prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(f"r{next(_ids)}", prompt, SamplingParams(), 16, cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request) -> int:
    """Admit a whole prompt as the scheduler does; returns the number of cached tokens."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    return num_hit


def free_ids(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


# ---- hashes ------------------------------------------------------------------------------


def test_block_hash_chains_parent_tokens_and_extra_keys():
    root = hash_block(None, [1, 2, 3, 4])
    assert root == hash_block(None, (1, 2, 3, 4))
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    other_root = hash_block(None, [9, 9, 9, 9])
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(other_root, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], "salt") != root


def test_block_hash_is_sha256_and_the_same_in_every_process():
    """A collision-resistant digest (never Python's `hash()`, whose per-process string
    seed also made salted hashes differ between a prefill and a decode server), with each
    part delimited: moving a token between parts changes it."""
    import hashlib
    import subprocess
    import sys

    digest = hash_block(None, [1, 2, 3, 4], "tenant-a")
    assert isinstance(digest, bytes) and len(digest) == hashlib.sha256().digest_size
    code = ("from llmserve.core.kv_cache_manager import hash_block; "
            "print(hash_block(None, [1, 2, 3, 4], 'tenant-a').hex())")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, "PYTHONHASHSEED": seed},
                             check=True).stdout.strip()
        assert out == digest.hex()
    assert hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2, 3, 0])
    assert hash_block(None, [12], "3") != hash_block(None, [1], "23")
    assert hash_block(None, [1], ("a", "b")) != hash_block(None, [1], "a,b")


def test_request_hashes_cover_only_full_blocks_and_grow_with_output():
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = make_request(list(range(10)))
    admit(kv, request)
    assert len(request.block_hashes) == 2
    assert request.block_hashes[1] == hash_block(request.block_hashes[0], [4, 5, 6, 7])

    request.append_output_token(10)
    request.append_output_token(11)  # the third block is now full
    assert kv.allocate_slots(request, 1)
    assert len(request.block_hashes) == 3


# ---- allocation --------------------------------------------------------------------------


def test_allocate_slots_rounds_up_to_whole_blocks_and_grows_only_when_needed():
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = make_request(list(range(5)))
    assert kv.allocate_slots(request, 5)
    assert kv.block_ids(request) == [0, 1]
    request.num_computed_tokens = 5
    for token in (5, 6):
        request.append_output_token(token)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert kv.block_ids(request) == [0, 1]  # 7 tokens still fit in 2 blocks
    request.append_output_token(7)
    request.num_computed_tokens = 8
    request.append_output_token(8)
    assert kv.allocate_slots(request, 1)
    assert kv.block_ids(request) == [0, 1, 2]


def test_allocate_slots_fails_without_side_effects_when_blocks_run_out():
    kv = KVCacheManager(2, BLOCK_SIZE)
    request = make_request(list(range(9)))
    assert not kv.allocate_slots(request, 9)
    assert kv.block_ids(request) == []
    assert kv.pool.num_free_blocks == 2


# ---- prefix hits -------------------------------------------------------------------------


def test_second_request_with_same_prefix_shares_full_blocks():
    kv = KVCacheManager(16, BLOCK_SIZE)
    first = make_request(list(range(10)))
    admit(kv, first)
    second = make_request(list(range(8)) + [50, 51, 52])
    assert admit(kv, second) == 8
    assert kv.block_ids(second)[:2] == kv.block_ids(first)[:2]
    assert kv.block_ids(second)[2] not in kv.block_ids(first)
    assert [b.ref_cnt for b in second.blocks] == [2, 2, 1]


def test_a_hit_never_covers_the_last_prompt_token():
    kv = KVCacheManager(16, BLOCK_SIZE)
    admit(kv, make_request(list(range(12))))
    same = make_request(list(range(12)))
    hits, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 8 and len(hits) == 2  # the third block holds the token to sample from


def test_hit_stops_at_the_first_missing_block():
    kv = KVCacheManager(16, BLOCK_SIZE)
    admit(kv, make_request(list(range(13))))
    other = make_request([0, 1, 2, 3, 9, 9, 9, 9] + list(range(8, 13)))
    _, num_hit = kv.get_computed_blocks(other)
    assert num_hit == 4  # block 3 is equal, but follows a different block 2


def test_equal_blocks_after_different_prefixes_do_not_hit():
    kv = KVCacheManager(16, BLOCK_SIZE)
    first = make_request([1, 1, 1, 1, 7, 7, 7, 7, 0])
    admit(kv, first)
    other = make_request([2, 2, 2, 2, 7, 7, 7, 7, 0])
    assert admit(kv, other) == 0
    assert other.block_hashes[1] != first.block_hashes[1]
    assert other.blocks[1] is not first.blocks[1]


def test_a_different_cache_salt_does_not_hit():
    kv = KVCacheManager(16, BLOCK_SIZE)
    prompt = list(range(9))
    alice, bob, anyone = (make_request(prompt, cache_salt=s) for s in ("alice", "bob", None))
    admit(kv, alice)
    assert admit(kv, bob) == 0
    assert admit(kv, anyone) == 0
    assert admit(kv, make_request(prompt, cache_salt="alice")) == 8
    # the tenants' blocks are disjoint
    blocks = [{b.block_id for b in r.blocks} for r in (alice, bob, anyone)]
    assert not (blocks[0] & blocks[1] or blocks[0] & blocks[2] or blocks[1] & blocks[2])


def test_caching_disabled_never_hits():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_caching=False)
    prompt = list(range(9))
    first = make_request(prompt)
    admit(kv, first)
    kv.free(first)
    assert admit(kv, make_request(prompt)) == 0
    assert kv.pool.cached == {} and kv.num_hits == 0


def test_blocks_full_after_this_step_are_cached_at_allocation():
    kv = KVCacheManager(16, BLOCK_SIZE)
    request = make_request(list(range(10)))
    assert kv.allocate_slots(request, 6)  # a chunk: blocks 0 full, 1 half
    blocks = request.blocks
    assert blocks[0].block_hash is not None and blocks[1].block_hash is None


# ---- freeing and LRU reuse ---------------------------------------------------------------


def test_free_releases_tail_blocks_first():
    kv = KVCacheManager(4, BLOCK_SIZE)
    request = make_request(list(range(12)))
    admit(kv, request)
    assert free_ids(kv) == [3]
    kv.free(request)
    assert free_ids(kv) == [3, 2, 1, 0]
    assert kv.block_ids(request) == []


def test_free_uncaches_blocks_past_the_computed_tokens():
    """A chunk taken back by preemption was cached at allocation but its KV never written."""
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = make_request(list(range(16)))
    assert kv.allocate_slots(request, 4)
    request.num_computed_tokens = 4  # the first chunk ran
    assert kv.allocate_slots(request, 12)  # the second is scheduled, then taken back
    assert all(b.block_hash is not None for b in request.blocks)
    kv.free(request)
    assert list(kv.pool.cached) == [request.block_hashes[0]]
    assert kv.get_computed_blocks(make_request(list(range(16))))[1] == 4


def test_freed_cached_blocks_are_reused_by_a_hit_before_eviction():
    kv = KVCacheManager(4, BLOCK_SIZE)
    first = make_request(list(range(13)))
    admit(kv, first)
    head = kv.block_ids(first)[:3]
    kv.free(first)
    second = make_request(list(range(12)) + [99])
    assert admit(kv, second) == 12
    assert kv.block_ids(second)[:3] == head
    assert kv.pool.num_evictions == 0


def test_fresh_blocks_evict_tails_of_the_least_recently_freed_request_first():
    kv = KVCacheManager(7, BLOCK_SIZE)
    old, new = make_request(list(range(13))), make_request(list(range(100, 109)))
    admit(kv, old)  # blocks 0-3, the first three full and cached
    admit(kv, new)  # blocks 4-6, the first two full and cached
    kv.free(old)
    kv.free(new)
    assert free_ids(kv) == [3, 2, 1, 0, 6, 5, 4]

    filler = make_request([7] * 9)  # 3 fresh blocks: old's tail block, then its two last full
    admit(kv, filler)
    assert kv.block_ids(filler) == [3, 2, 1]
    assert kv.pool.num_evictions == 2  # the uncached tail block evicts nothing

    assert kv.get_computed_blocks(make_request(list(range(13))))[1] == 4  # old's head survives
    assert kv.get_computed_blocks(make_request(list(range(100, 109))))[1] == 8  # new: whole


def test_allocation_counts_revived_blocks_against_the_free_pool():
    kv = KVCacheManager(4, BLOCK_SIZE)
    first = make_request(list(range(9)))
    admit(kv, first)
    kv.free(first)  # 4 free blocks, two of them cached
    second = make_request(list(range(8)) + list(range(50, 60)))  # 18 tokens: 5 blocks
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    assert not kv.allocate_slots(second, 10, hits)  # 2 revived + 3 fresh > 4
    assert [b.ref_cnt for b in hits] == [0, 0] and kv.pool.num_free_blocks == 4
    assert kv.allocate_slots(second, 8, hits)  # 2 revived + 2 fresh
    assert kv.pool.num_free_blocks == 0
