"""BlockPool: owns every KV cache block, the free queue and the prefix cache map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxllm.core.block_contents import BlockContents
from jaxllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """All ``num_blocks`` blocks of the preallocated KV cache.

    * Block 0 is the null block: padding tokens write their KV into it. It is never
      in the free queue, never handed out, never cached.
    * Every other block is either in use (``ref_cnt > 0``, held by that many
      requests) or free (``ref_cnt == 0``, in the free queue exactly once).
    * A free block that was cached (see :meth:`cache_full_blocks`; the KV cache
      manager only calls it with prefix caching on) keeps its content and its entry in
      ``cached_block_hash_to_block`` until it is reused. The free queue is in LRU
      order, so the block popped for reuse is the least recently freed; its hash
      entry is dropped (evicted) at that moment.
    * If two requests fill blocks with the same content independently, only the
      first one to be cached is entered in the map; the other stays uncached.
    * ``contents`` records what written blocks hold token by token (full or not; see
      :mod:`jaxllm.core.block_contents`), until the block is handed out again.

    Attributes:
        num_blocks: total blocks, including the null block.
        blocks: all blocks, indexed by block id.
        free_block_queue: the free blocks, next to reuse first.
        cached_block_hash_to_block: prefix cache, block hash -> the block holding
            that content (in use or free).
        null_block: the reserved block 0.
        contents: the tokens (and prompt rows) of written blocks, for partial reuse.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (the null block and one more), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.contents = BlockContents()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue, including free blocks that hold cached content."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        num_usable = self.num_blocks - 1
        return (num_usable - self.free_block_queue.num_free_blocks) / num_usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding the content with ``block_hash``, or None on a miss."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting their
        cached content, and give each a ref count of 1.

        Raises ValueError (taking nothing) when fewer blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} free blocks from the pool: "
                f"only {self.free_block_queue.num_free_blocks} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cached = self.cached_block_hash_to_block
        for block in blocks:
            if block.block_hash is not None:
                del cached[block.block_hash]
                block.block_hash = None
            self.contents.forget(block.block_id)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each of ``blocks`` (prefix-cache hits); a free
        block leaves the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 are appended to the
        free queue in the given order, so earlier ones are evicted first."""
        freed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> list[KVCacheBlock]:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix cache;
        the blocks that were entered now.

        Args:
            blocks: a request's blocks, in order.
            block_hashes: the request's block hashes, at least ``num_full_blocks``.
            num_cached_blocks: leading blocks of the request already handled.
            num_full_blocks: leading blocks whose content is now complete.
        """
        cached = self.cached_block_hash_to_block
        newly_cached = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:  # a prefix-cache hit, already cached; freed
                continue
            block_hash = block_hashes[i]
            if block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block
                newly_cached.append(block)
        return newly_cached

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks out of the prefix cache (their content was never written: the
        step that was to write it failed)."""
        cached = self.cached_block_hash_to_block
        for block in blocks:
            if block.block_hash is not None and cached.get(block.block_hash) is block:
                del cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content. Only possible when no block is in use (for
        example after a weight update); returns whether it happened."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.contents.clear()
        return True
