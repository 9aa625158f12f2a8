"""Which KV blocks each request owns: prefix-cache lookups, slot allocation, and freeing.

For one request the token ranges are

    | computed (KV in cache) | new (computed this step) | not yet scheduled |
    0                 num_computed_tokens          + num_new_tokens        num_tokens

and its block table (`Request.blocks`) covers at least `computed + new` tokens. The
manager keeps no per-request table of its own: what it knows of a request lives on it.

With a KV tier (`tier`: anything that answers `block_hash in tier`, see `kv_tier/`), a
lookup that misses in memory goes on in the tier, block by block; the blocks found there
get fresh blocks (`allocate_for_load`) that are offered to the prefix cache only once
their KV has arrived (`finish_load`). Every block that a step fills and caches is listed
(`take_filled_blocks`) so that the runner keeps it in the tier after the forward.
"""

import hashlib
import json
from array import array
from collections.abc import Container, Sequence

from llmserve.core.block_pool import Block, BlockPool
from llmserve.core.request import Request

_ROOT = bytes(32)  # the parent of a sequence's first block


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int],
               extra: object = None) -> bytes:
    """Chain hash of a full block: sha256 over its parent's hash (everything before it),
    its token ids and the extra keys (cache_salt, ...), each part length-delimited.

    Collision-resistant, so two different prefixes never share KV (Python's `hash()` is
    not: crafted token sequences can collide and read another prompt's cache), and the
    same in every process (no per-process seed): prefill and decode servers agree."""
    tokens = array("q", token_ids).tobytes()
    extra_bytes = json.dumps(extra, separators=(",", ":")).encode()
    digest = hashlib.sha256(parent_hash or _ROOT)
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(tokens)
    digest.update(extra_bytes)
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 tier: Container[bytes] | None = None, drop_last_hit_block: bool = False
                 ) -> None:
        self.block_size = block_size
        # an EAGLE head's K/V at a block's last position was computed with the token after
        # the block, which another request sharing the block may not have: its last hit
        # block is computed again (spec_decode/eagle.py)
        self.drop_last_hit_block = drop_last_hit_block
        self.tier = tier
        self.num_tier_queries = 0  # full prompt blocks missed in memory, looked up in the tier
        self.num_tier_hits = 0  # of which found there
        self.num_tier_hit_tokens = 0  # prompt tokens whose KV was read from the tier
        self._filled: list[Block] = []  # blocks cached this step, for the tier
        self.loading: set[bytes] = set()  # hashes this step reads from the tier
        # The pool can always share blocks; this manager decides for whom. With prefix
        # caching off, only siblings of one request (n > 1, best_of) share their prompt.
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.enable_caching = enable_caching
        self.num_queries = 0  # prompt tokens looked up in the prefix cache, at admission
        self.num_hits = 0  # of which found

    def shares_blocks(self, request: Request) -> bool:
        return self.enable_caching or request.share_group is not None

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admission's prefix-cache lookup (not retries, not resumes)."""
        self.num_queries += num_tokens
        self.num_hits += num_hit

    @property
    def usage(self) -> float:
        return self.pool.usage

    @staticmethod
    def block_ids(request: Request, start: int = 0) -> list[int]:
        """The request's block ids from its `start`-th block on."""
        return [b.block_id for b in request.blocks[start:]]

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks; leaves at least one token to compute.

        Does not take references: pass the blocks to `allocate_slots` in the same step.
        A request asking for prompt logprobs, or pooling every position, gets no hits (its
        prompt must be computed).
        """
        if not self.shares_blocks(request) or request.computes_whole_prompt:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.drop_last_hit_block and hits:
            hits.pop()
        return hits, len(hits) * self.block_size

    def get_tier_hashes(self, request: Request, num_memory_blocks: int) -> list[bytes]:
        """The block hashes after the request's `num_memory_blocks` memory hits that the
        tier holds, consecutive, leaving at least one token to compute. Adapters' blocks
        are not kept in the tier (an adapter's name may mean other weights after a
        restart)."""
        if self.tier is None or not self.enable_caching or request.computes_whole_prompt \
                or request.lora_request is not None:
            return []
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in request.block_hashes[num_memory_blocks:max_blocks]:
            if block_hash not in self.tier:
                break
            found.append(block_hash)
        return found

    def record_tier_lookup(self, request: Request, num_memory_blocks: int,
                           num_found: int) -> None:
        """Count one admission's tier lookup: the full prompt blocks memory missed."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.num_tier_queries += max(max_blocks - num_memory_blocks, 0)
        self.num_tier_hits += num_found

    def allocate_for_load(self, request: Request, computed_blocks: Sequence[Block],
                          num_load_blocks: int) -> bool:
        """The memory hits `computed_blocks`, then `num_load_blocks` fresh blocks for the
        tier's blocks after them; False if blocks run out. The fresh blocks are not cached
        (their KV is not there yet): `finish_load` offers those that arrived."""
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_load_blocks > self.pool.num_free_blocks - num_revived:
            return False
        self.pool.touch(computed_blocks)
        request.blocks.extend(computed_blocks)
        request.blocks.extend(self.pool.get_new_blocks(num_load_blocks))
        request.num_offered_blocks = len(computed_blocks)
        start = len(computed_blocks)
        self.loading.update(request.block_hashes[start : start + num_load_blocks])
        return True

    def waits_for_load(self, request: Request, num_memory_blocks: int) -> bool:
        """The block after the request's memory hits is being read from the tier for
        another request this step: next step it is a memory hit (read once, not twice)."""
        hashes = request.block_hashes
        return num_memory_blocks < len(hashes) and hashes[num_memory_blocks] in self.loading

    def finish_load(self, request: Request, num_loaded: int) -> None:
        """The first `num_loaded` blocks of a load hold their KV: into the prefix cache."""
        start = request.num_offered_blocks
        for i in range(start, start + num_loaded):
            self.pool.cache_block(request.blocks[i], request.block_hashes[i])
        request.num_offered_blocks = start + num_loaded

    def take_filled_blocks(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of the blocks this step's tokens fill that are still cached
        (not taken back by a preemption); the list starts anew. The tier skips those it
        holds already."""
        filled, self._filled = self._filled, []
        return [(b.block_id, b.block_hash) for b in filled if b.block_hash is not None]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = (),
        num_lookahead: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` after the computed ones, and `num_lookahead`
        slots after those (an EAGLE head's draft chain writes its K/V there before the
        drafts are verified); False if blocks run out."""
        blocks = request.blocks
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens + num_lookahead) // self.block_size)
        num_fresh = num_needed - len(blocks) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_fresh > self.pool.num_free_blocks - num_revived:
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if num_fresh > 0:
            blocks.extend(self.pool.get_new_blocks(num_fresh))
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        """Release a request's blocks; tail blocks are freed first so they are evicted first.

        Blocks past `num_computed_tokens` hold no KV (a chunk taken back by preemption after
        `allocate_slots` cached them), so they also leave the prefix cache.
        """
        blocks, request.blocks = request.blocks, []
        request.num_offered_blocks = 0
        self.pool.uncache_blocks(blocks[request.num_computed_tokens // self.block_size :])
        self.pool.free_blocks(reversed(blocks))

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            hashes.append(hash_block(parent, tokens,
                                     self._hash_extra(request, i * bs, (i + 1) * bs)))

    def _hash_extra(self, request: Request, start: int, end: int) -> object:
        """The keys of the block over positions [start, end) beside its token ids."""
        # an adapter's KV differs from the base model's: its name keys its blocks
        lora = request.lora_request
        salt = request.cache_salt if lora is None else (request.cache_salt, "lora",
                                                          lora.lora_name)
        # the image whose tokens a block holds (the same ids for every image) keys it
        images = [(m.hash, start - m.offset) for m in request.mm_inputs
                  if m.offset < end and start < m.offset + m.length]
        if images:
            salt = (salt, "images", images)
        if self.enable_caching:
            return salt
        return (salt, request.share_group)  # visible to siblings only

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        """Register blocks that are full once this step's tokens are written.

        Safe to do before the forward pass: K/V of a step are written before any attention
        of that step reads them, so a request admitted later in the same step may share them.
        """
        if not self.shares_blocks(request):
            return
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        # leading full blocks already offered: a step looks only at those that became full
        start = request.num_offered_blocks
        to_tier = self.tier is not None and request.lora_request is None
        for i in range(start, num_full):
            if self.pool.cache_block(blocks[i], request.block_hashes[i]) and to_tier:
                self._filled.append(blocks[i])
        request.num_offered_blocks = max(start, num_full)
