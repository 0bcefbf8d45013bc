"""KVCacheManager: the scheduler's interface to the paged KV cache.

The scheduler drives it in this order (the same as vLLM v1):

1. At admission, :meth:`KVCacheManager.check_fits` rejects a request that could never
   fit, even alone in the pool.
2. When a request that holds no blocks (new, or preempted) is scheduled:
   :meth:`~KVCacheManager.get_computed_prefix` finds its longest reusable prefix (whole
   cached blocks, then a tail of tokens shared with a written block), and right after it
   (no other allocation in between, or the hit blocks may be evicted)
   :meth:`~KVCacheManager.allocate_slots` takes the hit blocks and allocates blocks for
   the tokens to compute this step; :meth:`~KVCacheManager.count_lookup` counts the
   lookup once the request is admitted. ``None`` means the pool cannot satisfy the
   allocation right now; nothing changed, and the scheduler may preempt and retry.
3. A running request gets :meth:`~KVCacheManager.allocate_slots` each step for its new
   tokens (a prefill chunk or one decode token).
4. After the step computed the KV, :meth:`~KVCacheManager.cache_blocks` enters the
   newly filled blocks into the prefix cache.
5. A finished, aborted or preempted request gets :meth:`~KVCacheManager.free`.

One manager serves one KV cache group (jaxllm.kv_cache_groups): all layers of a model
that attends one way, or with ``sliding_window`` the sliding layers of a group whose
blocks wholly outside the window of the step's first query go back to the pool (the
request's block table keeps the null block there, as vLLM's sliding-window manager
does). :class:`jaxllm.core.hybrid_kv_cache_manager.HybridKVCacheManager` runs one per
group over a shared pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from jaxllm.core.block_contents import BlockContent, common_prefix
from jaxllm.core.block_pool import BlockPool
from jaxllm.core.kv_cache_utils import BlockHash, KVCacheBlock, encode_extra_keys, hash_block_tokens
from jaxllm.core.request import Request
from jaxllm.kv_cache_groups import peak_blocks


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups since the manager was created.

    Attributes:
        requests: lookups counted (``count_lookup``) with prefix caching on.
        queries: tokens of those requests looked up (``request.num_tokens`` each).
        hits: tokens served from the cache.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens that hit (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class ComputedPrefix:
    """A request's reusable prefix: whole cached blocks, then ``num_tail_tokens``
    tokens shared with ``tail`` (a written block), which the request's first new block
    gets as a copy.

    Attributes:
        blocks: the prefix-cache hit blocks, block ``i`` of the request in order.
        block_size: tokens per block.
        tail: the block whose leading tokens follow them, or None.
        num_tail_tokens: tokens taken from ``tail`` (fewer than a block; 0 without one).
        records: what the lookup found for the request's blocks in order (the hit
            blocks', then the best tail's; None where a block has no record), taken
            before allocation may hand any of them out again.
        group_blocks: with several KV cache groups, each group's hits (`blocks` is
            the first group's); () with one.
    """

    blocks: list[KVCacheBlock]
    block_size: int
    tail: KVCacheBlock | None = None
    num_tail_tokens: int = 0
    records: list[BlockContent | None] = field(default_factory=list)
    group_blocks: tuple[list[KVCacheBlock], ...] = ()

    @property
    def hits(self) -> list[KVCacheBlock] | tuple[list[KVCacheBlock], ...]:
        """What allocate_slots takes as `new_computed_blocks`: the hit blocks, one list
        per group with several groups."""
        return self.group_blocks or self.blocks

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size + self.num_tail_tokens


class PoolUsage:
    """Usage of the `block_pool` a KV cache manager allocates from (the single manager's
    own, or the pool the hybrid manager's groups share)."""

    block_pool: BlockPool

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, including the null block."""
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold request tokens (all but the null block)."""
        return self.block_pool.num_usable_blocks

    num_groups = 1  # KV cache groups (jaxllm.core.hybrid_kv_cache_manager has several)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (free cached blocks included)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.block_pool.num_usable_blocks - self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """KV cache usage: fraction of usable blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()


class KVCacheManager(PoolUsage):
    """Maps requests to KV cache blocks, with optional prefix caching.

    Attributes:
        block_size: tokens per block.
        enable_caching: whether prefix caching is on. When off, no block hash is
            ever computed and every lookup misses.
        block_pool: the blocks, free queue and prefix-cache map.
        req_to_blocks: request id -> the request's blocks, in token order (its block
            table). A request is present from its first successful allocation until
            it is freed.
        num_cached_blocks: request id -> how many leading blocks of the request were
            already handed to the prefix cache (so each block is considered once).
        prefix_cache_stats: lookup counters, in tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
                 sliding_window: int | None = None, block_pool: BlockPool | None = None, group_id: int = 0,
                 chunk: int | None = None) -> None:
        """
        Args:
            num_blocks: blocks in the device KV cache, including the null block 0.
            block_size: tokens per block.
            enable_caching: turn prefix caching on.
            sliding_window: the group's layers attend to this many latest keys: blocks
                wholly before it are freed (None: every block is kept).
            block_pool: a pool shared with other groups' managers (None: its own).
            group_id: the group's index; its prefix-cache entries are tagged with it so
                groups sharing a pool never hit each other's blocks.
            chunk: the most tokens a request computes in one step (with a window,
                :meth:`check_fits` counts the blocks a window and a chunk span; None:
                every block of the request).
        """
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.chunk = chunk
        self.group_tag = b"" if group_id == 0 else b"group" + group_id.to_bytes(4, "little")
        self.block_pool = block_pool if block_pool is not None else BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- usage: PoolUsage's ---------------------------------------------------------

    def num_tokens_held(self, requests: Iterable[Request]) -> int:
        """Distinct tokens whose K/V the blocks in use hold, given the requests holding
        them: blocks in use x block size, less each request's unfilled tail slots. A
        shared (prefix-cached) block is full and counted once; only a request's own last
        blocks can be partly filled."""
        unfilled = sum(
            max(len(self.req_to_blocks.get(r.request_id, ())) * self.block_size - r.num_computed_tokens, 0)
            for r in requests
        )
        return self.num_used_blocks * self.block_size - unfilled

    def check_fits(self, request: Request, num_tokens: int | None = None) -> None:
        """Admission check: raise ValueError if the request can never be scheduled
        because it alone needs more blocks than the pool has.

        Args:
            request: the request being admitted.
            num_tokens: the most tokens whose KV the request will ever hold; defaults
                to ``request.num_tokens``. A generation request should pass
                ``num_prompt_tokens + max_tokens - 1`` (the last sampled token is
                never fed back, so its KV is never written).
        """
        if num_tokens is None:
            num_tokens = request.num_tokens
        window = self.sliding_window if self.chunk is not None else None  # without a chunk: every block
        needed = peak_blocks(num_tokens, self.block_size, window, self.chunk or 0)
        usable = self.num_usable_blocks
        if needed > usable:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} KV cache blocks for "
                f"{num_tokens} tokens (block_size={self.block_size}), but the pool has "
                f"only {usable} usable blocks ({usable * self.block_size} tokens); it "
                "could never be scheduled. Shorten the prompt or max_tokens, or give "
                "the KV cache more memory."
            )

    # ---- scheduling ---------------------------------------------------------------

    def get_computed_prefix(
        self,
        request: Request,
        choose: Callable[[ComputedPrefix], ComputedPrefix] | None = None,
    ) -> ComputedPrefix:
        """Longest reusable prefix of a request that holds no blocks, to the token:
        the cached full blocks, then the leading tokens it shares with a written block
        that follows them (the *tail*, copied into the request's first new block).

        Args:
            request: the request.
            choose: given the longest prefix, the prefix to take instead (a request scoring its prompt needs the
                scores of the positions it skips); the longest when None.

        Returns:
            The prefix, empty with prefix caching off. Pass it to
            :meth:`allocate_slots` right away, and count the lookup with
            :meth:`count_lookup` once the request is admitted.
        """
        hits = self.longest_cache_hit(request)
        prefix = ComputedPrefix(hits, self.block_size)
        if not self.enable_caching:
            return prefix
        if self.sliding_window is not None:  # whole blocks, all the window needs (no tail copies)
            chosen = prefix if choose is None else choose(prefix)
            return prefix if len(chosen.blocks) == len(hits) else \
                ComputedPrefix(self.longest_cache_hit(request, len(chosen.blocks)), self.block_size)
        tail, common = self._best_tail(request, len(hits))
        prefix.records = [self.block_pool.contents.get(b.block_id) for b in hits]
        if tail is not None:
            prefix.tail, prefix.num_tail_tokens = self.block_pool.blocks[tail.block_id], common
            prefix.records.append(tail)
        return prefix if choose is None else choose(prefix)

    def longest_cache_hit(self, request: Request, limit: int | None = None) -> list[KVCacheBlock]:  # vLLM's find_longest_cache_hit
        """The request's longest prefix of at most `limit` blocks (default: all but its
        last token's) whose K/V this group holds: every block of it, or with a sliding
        window the blocks of the window before its end (the null block in place of the
        earlier ones)."""
        if not self.enable_caching:
            return []
        if request.request_id in self.req_to_blocks:
            raise ValueError(
                f"request {request.request_id!r} already holds KV cache blocks; "
                "look up the prefix cache only before its first allocation"
            )
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if limit is not None:
            max_hit_blocks = min(max_hit_blocks, limit)
        block_hashes = self._update_block_hashes(request, max_hit_blocks)
        cached, tag = self.block_pool.cached_block_hash_to_block, self.group_tag
        if self.sliding_window is not None:
            return self._window_hits([cached.get(block_hashes[i] + tag) for i in range(max_hit_blocks)])
        hits: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            block = cached.get(block_hashes[i] + tag)
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hits(self, found: list[KVCacheBlock | None]) -> list[KVCacheBlock]:
        """Of the cached blocks `found` (None: a miss), the longest prefix whose last
        blocks the sliding window of its next token needs are all there: scanned from
        the end for a run of them (as vLLM's sliding-window manager does)."""
        needed = -(-(self.sliding_window - 1) // self.block_size)
        run = 0
        for i in range(len(found) - 1, -1, -1):
            if found[i] is None:
                run = 0
                continue
            run += 1
            if run >= needed or i == 0:
                end = i + run
                return [self.block_pool.null_block] * i + found[i:end]
        return []

    def _best_tail(self, request: Request, block_index: int) -> tuple[BlockContent | None, int]:
        """The written block following the request's first ``block_index`` blocks that
        shares the most leading tokens with the request's block ``block_index`` (at
        most a block less one token, and never the request's last token)."""
        start = block_index * self.block_size
        limit = min(self.block_size - 1, request.num_tokens - 1 - start)
        if limit <= 0:
            return None, 0
        tokens = request.cache_token_ids(start, start + limit)
        best, best_common = None, 0
        for content in self.block_pool.contents.children(self.parent_key(request, block_index)):
            common = common_prefix(content.tokens, tokens)
            if common > best_common:
                best, best_common = content, common
        return best, best_common

    def parent_key(self, request: Request, block_index: int) -> bytes:
        """What precedes block ``block_index`` of the request: the hash of its previous
        full block, or for block 0 a root key with the request's extra keys."""
        if block_index == 0:
            return b"root" + encode_extra_keys(request.lora_id, request.cache_salt)
        return self._update_block_hashes(request, block_index)[block_index - 1]

    def count_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a request's prefix lookup in :attr:`prefix_cache_stats`."""
        if not self.enable_caching:
            return
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens

    def record_contents(self, request: Request, num_new_tokens: int, rows: list | None = None, k: int = -1,
                        end: int | None = None) -> None:
        """After a step that computed the request's ``num_new_tokens`` tokens before
        ``end``: record what the blocks it wrote hold.

        Args:
            request: the request.
            num_new_tokens: tokens the step computed for it.
            rows: the request's prompt logprob rows (row ``p`` predicts token ``p + 1``),
                when it scores its prompt.
            k: alternatives per row.
            end: the step's last computed token + 1 (default ``request.num_computed_tokens``;
                under async scheduling the next step, already scheduled, has moved that on).
        """
        if not self.enable_caching or num_new_tokens <= 0 or self.sliding_window is not None:
            return
        bs = self.block_size
        end = request.num_computed_tokens if end is None else end
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        contents = self.block_pool.contents
        for j in range((end - num_new_tokens) // bs, -(-end // bs)):
            start = j * bs
            tokens = request.cache_token_ids(start, min(start + bs, end))
            block_rows: list = []
            if rows is not None:
                block_rows = [None] if j == 0 else []
                block_rows += rows[max(start - 1, 0):start - 1 + len(tokens)]
            contents.set(BlockContent(blocks[j].block_id, self.parent_key(request, j), tokens, block_rows,
                                      k if rows is not None else -1))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_tail_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for the tokens the request computes this step.

        After the call the request holds blocks for ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens`` tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` counts the tokens
                computed in earlier steps only (not this step's, not the hits).
            num_new_tokens: tokens to compute this step (at least 1).
            num_new_computed_tokens: tokens served by ``new_computed_blocks``.
            new_computed_blocks: prefix-cache hits from :meth:`get_computed_prefix`
                (only for a request that holds no blocks yet).
            num_tail_tokens: of ``num_new_computed_tokens``, those after the hit
                blocks, which the caller copies into the first new block (a
                :class:`ComputedPrefix`'s tail).

        Returns:
            The newly allocated blocks (empty if the held blocks already have room),
            in order; they follow any hit blocks in the request's block table. None
            if the pool cannot provide them; then nothing changed but the freeing of
            blocks a sliding window no longer sees. On the first
            successful allocation ``request.num_cached_tokens`` is set to
            ``num_new_computed_tokens``.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        self.free_outside_window(request)
        new_computed_blocks = self.check_computed_blocks(request, num_new_computed_tokens, new_computed_blocks,
                                                         num_tail_tokens)
        needed = self.num_blocks_needed(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)
        if needed > self.block_pool.free_block_queue.num_free_blocks:
            return None
        self.save_computed_blocks(request, num_new_computed_tokens, new_computed_blocks)
        return self.allocate_new_blocks(request, num_new_computed_tokens + num_new_tokens)

    # The phases of allocate_slots, which HybridKVCacheManager runs group by group (every
    # group's hits taken before any group's new blocks, which could evict them).

    def check_computed_blocks(self, request: Request, num_new_computed_tokens: int,
                              new_computed_blocks: list[KVCacheBlock] | None, num_tail_tokens: int
                              ) -> list[KVCacheBlock]:
        """allocate_slots' arguments checked (ValueError); the hits, [] for none."""
        if new_computed_blocks or num_tail_tokens:
            held = len(self.req_to_blocks.get(request.request_id, ()))
            self._check_computed_blocks(request, held, num_new_computed_tokens, new_computed_blocks or [],
                                        num_tail_tokens)
        elif num_new_computed_tokens:
            raise ValueError("num_new_computed_tokens given without new_computed_blocks")
        return new_computed_blocks or []

    def save_computed_blocks(self, request: Request, num_new_computed_tokens: int,
                             new_computed_blocks: list[KVCacheBlock]) -> None:
        """Take the checked hits as the request's first blocks (no-op without hits); on
        its first allocation, set ``request.num_cached_tokens``."""
        if new_computed_blocks:
            self.block_pool.touch(b for b in new_computed_blocks if not b.is_null)
            self.req_to_blocks[request.request_id] = list(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_new_computed_tokens

    def allocate_new_blocks(self, request: Request, num_tokens: int) -> list[KVCacheBlock]:
        """Blocks for the request's next `num_tokens` tokens (after its computed ones)
        that it does not hold yet; the pool must have them."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_new = -(-(request.num_computed_tokens + num_tokens) // self.block_size) - len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new_blocks)  # the caller owns new_blocks
        return new_blocks

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                          new_computed_blocks: list[KVCacheBlock] | None = None) -> int:
        """Free blocks :meth:`allocate_slots` with these arguments takes from the pool
        (new blocks, and hits on free cached blocks, which leave the free queue)."""
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_total_tokens // self.block_size)
        if new_computed_blocks:
            return num_required - len(new_computed_blocks) + sum(
                1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null)
        return max(num_required - len(self.req_to_blocks.get(request.request_id, ())), 0)

    def free_outside_window(self, request: Request) -> None:
        """With a sliding window: free the request's blocks wholly before the window of
        its next token (position ``request.num_computed_tokens``), latest first (they
        are evicted first; the earlier ones are likelier shared), the null block
        taking their place in its block table. No-op without a window."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return
        first = max(request.num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        freed = []
        for j in range(min(first, len(blocks)) - 1, -1, -1):
            if blocks[j].is_null:
                break
            freed.append(blocks[j])
            blocks[j] = self.block_pool.null_block
        self.block_pool.free_blocks(freed)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Enter the request's blocks that are full within its first
        ``num_computed_tokens`` tokens into the prefix cache.

        The scheduler calls it for the tokens a step is about to compute (the step
        writes every token's K/V before any attention reads the cache, so requests
        later in the same step can share them); if the step fails, :meth:`uncache`
        takes back the blocks it returned. Blocks already handled are skipped, so
        calling it every step costs O(1) when no block filled. No-op with prefix
        caching off. Returns the blocks entered now.
        """
        if not self.enable_caching:
            return []
        request_id = request.request_id
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached_blocks = self.num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return []
        blocks = self.req_to_blocks[request_id]
        if num_full_blocks > len(blocks):
            raise ValueError(
                f"request {request_id!r}: cannot cache {num_full_blocks} full blocks, it holds {len(blocks)}"
            )
        block_hashes = self._update_block_hashes(request, num_full_blocks)
        if self.group_tag:
            keys = [h + self.group_tag for h in block_hashes[num_cached_blocks:num_full_blocks]]
            newly_cached = self.block_pool.cache_full_blocks(blocks[num_cached_blocks:num_full_blocks], keys, 0,
                                                             num_full_blocks - num_cached_blocks)
        else:
            newly_cached = self.block_pool.cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks)
        self.num_cached_blocks[request_id] = num_full_blocks
        return newly_cached

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks that :meth:`cache_blocks` entered out of the prefix cache again
        (the step that was to write their KV failed)."""
        self.block_pool.uncache(blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op if it holds none).

        Blocks are released last to first, so when they become free the request's
        tail is evicted before its prefix, which other requests are likelier to share.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

    def fork_blocks_needed(self, parent: Request) -> int:
        """Free blocks :meth:`fork` takes: one where the parent's last computed block is partial."""
        return 1 if parent.num_computed_tokens % self.block_size else 0

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]]:
        """Give `child` (a beam forked from `parent`, holding no blocks) the parent's
        K/V: its full blocks shared (one more reference each), its partial last block
        as a copy in a new block. Returns the (source, destination) copy to make before
        the next step. The pool must have :meth:`fork_blocks_needed` free blocks."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        table = blocks[:num_full]
        self.block_pool.touch(b for b in table if not b.is_null)
        copies = []
        if partial:
            new = self.block_pool.get_new_blocks(1)[0]
            copies.append((blocks[num_full].block_id, new.block_id))
            table = table + [new]
        self.req_to_blocks[child.request_id] = list(table)
        self.num_cached_blocks[child.request_id] = min(self.num_cached_blocks.get(parent.request_id, 0), num_full)
        return copies

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in token order (empty if it holds none); do not mutate."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: its block ids in token order."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def group_block_ids(self, request_id: str) -> tuple[list[int]]:
        """The request's block tables, one per KV cache group (this one)."""
        return (self.get_block_ids(request_id),)

    @staticmethod
    def new_block_ids(new_blocks: list[KVCacheBlock]) -> tuple[list[int]]:
        """The ids of what allocate_slots returned, one list per KV cache group."""
        return ([block.block_id for block in new_blocks],)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content; only possible when no request holds blocks.
        Returns whether it happened."""
        return self.block_pool.reset_prefix_cache()

    # ---- internals ----------------------------------------------------------------

    def _check_computed_blocks(
        self,
        request: Request,
        num_held: int,
        num_new_computed_tokens: int,
        new_computed_blocks: list[KVCacheBlock],
        num_tail_tokens: int,
    ) -> None:
        """Reject prefix-cache hits that do not fit the request or went stale
        (evicted or reused since :meth:`get_computed_prefix`)."""
        request_id = request.request_id
        if num_held or request.num_computed_tokens:
            raise ValueError(f"request {request_id!r}: prefix-cache hits are only valid before its first allocation")
        if not 0 <= num_tail_tokens < self.block_size or (
                num_new_computed_tokens != len(new_computed_blocks) * self.block_size + num_tail_tokens):
            raise ValueError(
                f"request {request_id!r}: num_new_computed_tokens={num_new_computed_tokens} but "
                f"{len(new_computed_blocks)} hit blocks of {self.block_size} tokens and {num_tail_tokens} tail tokens"
            )
        block_hashes = request.block_hashes
        for i, block in enumerate(new_computed_blocks):
            if block.is_null and self.sliding_window is not None:
                continue
            if block.block_hash is None or i >= len(block_hashes) or block.block_hash != block_hashes[i] + self.group_tag:
                raise ValueError(
                    f"request {request_id!r}: prefix-cache hit block {block.block_id} was evicted or reused "
                    "since get_computed_prefix; call allocate_slots right after it"
                )

    def _update_block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to cover at least ``num_blocks`` full blocks
        and return it."""
        block_hashes = request.block_hashes
        start = len(block_hashes)
        if start >= num_blocks:
            return block_hashes
        block_size = self.block_size
        if num_blocks * block_size > request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, "
                f"fewer than {num_blocks} full blocks"
            )
        extra_keys = encode_extra_keys(request.lora_id, request.cache_salt)
        parent = block_hashes[-1] if block_hashes else None
        for i in range(start, num_blocks):
            parent = hash_block_tokens(
                parent, request.cache_token_ids(i * block_size, (i + 1) * block_size), extra_keys
            )
            block_hashes.append(parent)
        return block_hashes
