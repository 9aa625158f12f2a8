"""A pool of KV-cache blocks: ref counts, the prefix-cache hash map, and LRU eviction.

Invariants:
* A block is in exactly one of two states: in use (`ref_cnt > 0`) or in the free queue
  (`ref_cnt == 0`).
* The free queue is ordered least-recently-freed first; a fresh block is taken from its
  front. A free block that still holds a cached prefix (has a hash) is evicted from the hash
  map only when it is taken as a fresh block.
* A cached block (one with a hash) maps from that hash: `cached[block.block_hash] is block`.
"""

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take n fresh blocks (ref_cnt 1), evicting cached prefixes least recently freed first."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; blocks reaching zero join the back of the free queue in order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more times than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: Block, block_hash: bytes) -> bool:
        """Record a full block under its chain hash so later requests can share it; True
        if it was not cached before (nor another block under that hash)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache_blocks(self, blocks: Iterable[Block]) -> None:
        """Forget the hashes of blocks whose KV will not be written after all."""
        for block in blocks:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
