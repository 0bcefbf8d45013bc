"""HybridKVCacheManager: the KV cache of a model with several KV cache groups (full and
sliding-window layers: Gemma 2 and 3), vLLM's hybrid allocator in our terms.

One :class:`~jaxllm.core.kv_cache_manager.KVCacheManager` per group
(jaxllm.kv_cache_groups), all over one shared :class:`BlockPool`: a request holds a
block table per group, a sliding group frees what its window no longer sees, and a
prefix-cache hit is the longest prefix every group can serve (a full group needs all
its blocks, a sliding group those of the window before the prefix's end). An
allocation is all groups' or none. It offers the scheduler the single manager's
interface, block ids as one list per group; a hybrid prefix is whole blocks (no
copied tail); the first group records its blocks' contents (prompt rows reused by
requests scoring their prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_manager import ComputedPrefix, KVCacheManager, PoolUsage, PrefixCacheStats
from jaxllm.core.kv_cache_utils import KVCacheBlock
from jaxllm.core.request import Request
from jaxllm.kv_cache_groups import KVCacheGroups

GroupBlocks = tuple[list[KVCacheBlock], ...]


class HybridKVCacheManager(PoolUsage):
    """Attributes:
        groups: the layout.
        managers: one per group, sharing `block_pool`.
        chunk: the most tokens a request computes in one step (a sliding group's peak
            holding spans its window and a chunk).
    """

    def __init__(self, num_blocks: int, block_size: int, groups: KVCacheGroups, *, chunk: int,
                 enable_caching: bool = True) -> None:
        self.groups = groups
        self.chunk = chunk
        self.block_pool = BlockPool(num_blocks)
        self.managers = tuple(
            KVCacheManager(num_blocks, block_size, enable_caching, sliding_window=w, block_pool=self.block_pool,
                           group_id=g, chunk=chunk)
            for g, w in enumerate(groups.windows))
        self.block_size = block_size
        self.enable_caching = enable_caching

    # ---- usage (the shared pool's; the rest is PoolUsage's) ---------------------------

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.managers[0].prefix_cache_stats

    def num_tokens_held(self, requests: Iterable[Request]) -> int:
        """Distinct tokens whose K/V the first group holds (a full group's, where there
        is one: every token of every running request, shared prefixes once)."""
        first = self.managers[0]
        requests = list(requests)
        held = {b.block_id for r in requests for b in first.get_blocks(r.request_id) if not b.is_null}
        unfilled = sum(max(len(first.get_blocks(r.request_id)) * self.block_size - r.num_computed_tokens, 0)
                       for r in requests)
        return len(held) * self.block_size - unfilled

    def check_fits(self, request: Request, num_tokens: int | None = None) -> None:
        """KVCacheManager.check_fits over all groups: the request's peak holding (every
        block of a full group, a window and a chunk of a sliding one)."""
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        needed = self.groups.peak_blocks(num_tokens, self.block_size, self.chunk)
        usable = self.num_usable_blocks
        if needed > usable:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} KV cache blocks for {num_tokens} tokens "
                f"({self.groups.num_groups} KV cache groups, block_size={self.block_size}), but the pool has only "
                f"{usable} usable blocks; it could never be scheduled. Shorten the prompt or max_tokens, or give "
                "the KV cache more memory."
            )

    # ---- scheduling -------------------------------------------------------------------

    def get_computed_prefix(
        self, request: Request, choose: Callable[[ComputedPrefix], ComputedPrefix] | None = None
    ) -> ComputedPrefix:
        """The longest prefix, in whole blocks, that every group serves (`choose` as
        KVCacheManager's); its `group_blocks` are each group's hits."""
        hits = self._common_hits(request, None)
        # the first group's block records (a full group's: the prompt rows a request
        # scoring its prompt takes instead of computing them)
        records = [self.block_pool.contents.get(b.block_id) for b in hits[0]] if self.enable_caching else []
        if choose is not None:
            chosen = choose(ComputedPrefix(hits[0], self.block_size, records=records))
            if len(chosen.blocks) < len(hits[0]):  # whole blocks: a tail it chose is not taken
                hits = self._common_hits(request, len(chosen.blocks))
        return ComputedPrefix(hits[0], self.block_size, records=records, group_blocks=hits)

    def _common_hits(self, request: Request, limit: int | None) -> GroupBlocks:
        """Each group's hits for the longest prefix of at most `limit` blocks all groups
        serve: shortened until they agree (a full group serves any shorter prefix of
        its hits, a sliding group finds its longest within the bound)."""
        while True:
            hits = tuple(m.longest_cache_hit(request, limit) for m in self.managers)
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                return hits
            limit = shortest

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def count_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.managers[0].count_lookup(request, num_hit_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_tail_tokens: int = 0,
    ) -> GroupBlocks | None:
        """KVCacheManager.allocate_slots for every group (hits: one list per group), all
        or none: None (nothing allocated) if the pool cannot serve every group."""
        if num_tail_tokens:
            raise ValueError("a hybrid KV cache reuses whole blocks only (no tail tokens)")
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        groups = list(zip(self.managers, new_computed_blocks or [None] * len(self.managers), strict=True))
        for m, _ in groups:
            m.free_outside_window(request)
        hits = [m.check_computed_blocks(request, num_new_computed_tokens, h, 0) for m, h in groups]
        needed = sum(m.num_blocks_needed(request, num_new_tokens, num_new_computed_tokens, h)
                     for (m, _), h in zip(groups, hits))
        if needed > self.num_free_blocks:
            return None
        for (m, _), h in zip(groups, hits):  # every group's hits leave the free queue before
            m.save_computed_blocks(request, num_new_computed_tokens, h)  # new blocks could evict them
        return tuple(m.allocate_new_blocks(request, num_new_computed_tokens + num_new_tokens) for m, _ in groups)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks allocate_slots takes for a running request's `num_new_tokens` (at most)."""
        return sum(m.num_blocks_needed(request, num_new_tokens) for m in self.managers)

    def fork_blocks_needed(self, parent: Request) -> int:
        return sum(m.fork_blocks_needed(parent) for m in self.managers)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]]:
        """KVCacheManager.fork in every group (a sliding group shares its null blocks)."""
        return [c for m in self.managers for c in m.fork(parent, child)]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> list[KVCacheBlock]:
        return [b for m in self.managers for b in m.cache_blocks(request, num_computed_tokens)]

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.block_pool.uncache(blocks)

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request)

    def record_contents(self, request: Request, num_new_tokens: int, rows: list | None = None, k: int = -1,
                        end: int | None = None) -> None:
        """The first group's (KVCacheManager.record_contents; a sliding group's manager
        records nothing): the prompt rows of its blocks, for requests scoring their prompt."""
        self.managers[0].record_contents(request, num_new_tokens, rows, k, end)

    def parent_key(self, request: Request, block_index: int) -> bytes:
        return self.managers[0].parent_key(request, block_index)

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables, one per group."""
        return tuple(m.get_block_ids(request_id) for m in self.managers)

    @staticmethod
    def new_block_ids(new_blocks: GroupBlocks) -> tuple[list[int], ...]:
        """The ids of what allocate_slots returned, one list per group."""
        return tuple([b.block_id for b in blocks] for blocks in new_blocks)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
