"""Which KV blocks each request owns: prefix-cache lookups, slot allocation, and freeing.

For one request the token ranges are

    | computed (KV in cache) | new (computed this step) | not yet scheduled |
    0                 num_computed_tokens          + num_new_tokens        num_tokens

and its block table (`Request.blocks`) covers at least `computed + new` tokens. The
manager keeps no per-request table of its own: what it knows of a request lives on it.
"""

import hashlib
import json
from array import array
from collections.abc import Sequence

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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
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
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = ()
    ) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False if blocks run out."""
        blocks = request.blocks
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
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
            hashes.append(hash_block(parent, tokens, self._hash_extra(request)))

    def _hash_extra(self, request: Request) -> object:
        # an adapter's KV differs from the base model's: its name keys its blocks
        lora = request.lora_request
        salt = request.cache_salt if lora is None else (request.cache_salt, "lora",
                                                          lora.lora_name)
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
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        request.num_offered_blocks = max(start, num_full)
