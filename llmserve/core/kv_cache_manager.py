"""Which KV blocks each request owns: prefix-cache lookups, slot allocation, and freeing.

For one request the token ranges are

    | computed (KV in cache) | new (computed this step) | not yet scheduled |
    0                 num_computed_tokens          + num_new_tokens        num_tokens

and its block table covers at least `computed + new` tokens.
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
        self.req_blocks: dict[str, list[Block]] = {}
        # leading full blocks of each request already offered to the prefix cache, so a
        # step only looks at the blocks that became full since the last one
        self.num_offered: dict[str, int] = {}
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

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its `start`-th block on."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())[start:]]

    def num_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks; leaves at least one token to compute.

        Does not take references: pass the blocks to `allocate_slots` in the same step.
        A request asking for prompt logprobs gets no hits (its prompt must be computed).
        """
        if not self.shares_blocks(request) or request.sampling_params.prompt_logprobs is not None:
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
        blocks = self.req_blocks.setdefault(request.request_id, [])
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

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` a reference to every block of `parent` (beam search continuations)."""
        blocks = list(self.req_blocks.get(parent.request_id, ()))
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = blocks
        child.block_hashes = list(parent.block_hashes)
        self.num_offered[child.request_id] = self.num_offered.get(parent.request_id, 0)

    def make_last_block_private(self, request: Request) -> tuple[int, int] | None:
        """Copy-on-write: if the block the next token lands in is shared, swap in a copy.

        Returns (source, destination) block ids for the runner to copy, or None if nothing
        needs copying. Raises ValueError when no free block is left.
        """
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens
        if num_computed % self.block_size == 0 or not blocks:
            return None  # the next token starts a fresh block
        index = num_computed // self.block_size
        shared = blocks[index]
        if shared.ref_cnt == 1:
            return None
        (copy,) = self.pool.get_new_blocks(1)
        blocks[index] = copy
        self.pool.free_blocks([shared])
        return shared.block_id, copy.block_id

    def free(self, request: Request) -> None:
        """Release a request's blocks; tail blocks are freed first so they are evicted first.

        Blocks past `num_computed_tokens` hold no KV (a chunk taken back by preemption after
        `allocate_slots` cached them), so they also leave the prefix cache.
        """
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_offered.pop(request.request_id, None)
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
        if self.enable_caching:
            return request.cache_salt
        return (request.cache_salt, request.share_group)  # visible to siblings only

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        """Register blocks that are full once this step's tokens are written.

        Safe to do before the forward pass: K/V of a step are written before any attention
        of that step reads them, so a request admitted later in the same step may share them.
        """
        if not self.shares_blocks(request):
            return
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_offered.get(request.request_id, 0)  # blocks before it are done
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_offered[request.request_id] = max(start, num_full)
