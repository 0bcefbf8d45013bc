"""Prompt logprobs on the scheduler's side: what each request has scored, and the
scores of prefix-cached blocks, so that a prompt whose prefix is cached is scored
without recomputing that prefix.

A prompt logprob row for position p holds the log-probability (and rank) of prompt
token p + 1 and the top alternatives: a function of tokens 0..p + 1 only. So the rows
that predict the tokens of one full block are keyed by that block's hash (which chains
every earlier token): rows for positions 16b - 1 .. 16b + 14 under block b's hash, with
block size 16. A request that hits the KV cache for blocks 0..u-1 skips computing
positions 0..16u - 1, so it needs the rows that predict tokens 1..16u: blocks 0..u, the
last of which only for its first row. When those are not all known, the request uses
fewer hit blocks and computes the rest (:meth:`PromptScoresCache.usable_hits`).

The same bookkeeping keeps a request that is preempted and recomputed from emitting its
prompt rows twice: ``PromptScores.rows`` are the rows emitted or due, and the runner
scores only positions from ``len(rows)`` on.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxllm.core.kv_cache_utils import BlockHash
from jaxllm.engine.protocol import LogprobsLists

Row = tuple[list[int], list[float], int]  # (scored token then alternatives, their logprobs, rank)


@dataclasses.dataclass
class PromptScores:
    """A request's prompt logprob rows so far: row p scores prompt token p + 1.

    Attributes:
        k: top alternatives per row the request asked for.
        rows: rows of positions 0..len(rows) - 1, in order.
        num_sent: rows already handed out in engine-core outputs.
        num_recorded_blocks: leading blocks whose rows were offered to the cache.
    """

    k: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    num_sent: int = 0
    num_recorded_blocks: int = 0

    def extend(self, lists: LogprobsLists) -> None:
        self.rows.extend(zip(lists.token_ids, lists.logprobs, lists.ranks))

    def take_unsent(self) -> LogprobsLists | None:
        """The rows not handed out yet (None if there are none); marks them sent."""
        if self.num_sent == len(self.rows):
            return None
        rows, self.num_sent = self.rows[self.num_sent:], len(self.rows)
        return LogprobsLists([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


@dataclasses.dataclass
class _BlockRows:
    k: int  # alternatives per row
    rows: list[Row | None]  # rows predicting the block's tokens; None for token 0 of the prompt


class PromptScoresCache:
    """Prompt logprob rows of full blocks, by block hash, least recently used evicted.

    It only pays when the block's KV also hits, so it holds about as many blocks as the
    KV pool (``capacity``)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: collections.OrderedDict[BlockHash, _BlockRows] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _get(self, block_hash: BlockHash, k: int) -> _BlockRows | None:
        entry = self._blocks.get(block_hash)
        if entry is None or entry.k < k:
            return None
        self._blocks.move_to_end(block_hash)
        return entry

    def _needed_blocks(self, scores: PromptScores, num_prompt_tokens: int, num_hit_blocks: int) -> range:
        """Blocks whose rows a request needs to skip ``num_hit_blocks`` blocks."""
        first_token = len(scores.rows) + 1  # the first prompt token not scored yet
        last_token = min(num_hit_blocks * self.block_size, num_prompt_tokens - 1)
        if first_token > last_token:
            return range(0)
        return range(first_token // self.block_size, last_token // self.block_size + 1)

    def usable_hits(self, scores: PromptScores, num_prompt_tokens: int, block_hashes: list[BlockHash],
                    num_hit_blocks: int) -> int:
        """How many of ``num_hit_blocks`` leading KV hit blocks the request can skip:
        the most for which every row it would not compute is cached."""
        for u in range(num_hit_blocks, 0, -1):
            needed = self._needed_blocks(scores, num_prompt_tokens, u)
            if all(b < len(block_hashes) and self._get(block_hashes[b], scores.k) is not None for b in needed):
                return u
        return 0

    def fill(self, scores: PromptScores, num_prompt_tokens: int, block_hashes: list[BlockHash],
             num_computed_tokens: int) -> None:
        """Append the cached rows of positions the request will not compute (those
        before ``num_computed_tokens``, after what it has already scored)."""
        end = min(num_computed_tokens, num_prompt_tokens - 1)  # rows up to position end - 1
        while len(scores.rows) < end:
            token = len(scores.rows) + 1
            entry = self._get(block_hashes[token // self.block_size], scores.k)
            if entry is None:
                raise AssertionError("fill() called beyond usable_hits()")
            ids, logprobs, rank = entry.rows[token % self.block_size]
            scores.rows.append((ids[: 1 + scores.k], logprobs[: 1 + scores.k], rank))

    def record(self, scores: PromptScores, block_hashes: list[BlockHash]) -> None:
        """Enter the request's full blocks whose rows are now all known (those in
        ``block_hashes``, which the caller has computed far enough)."""
        bs = self.block_size
        num_complete = min((len(scores.rows) + 1) // bs, len(block_hashes))
        for b in range(scores.num_recorded_blocks, num_complete):
            old = self._blocks.get(block_hashes[b])
            if old is None or old.k < scores.k:
                rows: list[Row | None] = [None] if b == 0 else []
                rows += scores.rows[max(b * bs - 1, 0):(b + 1) * bs - 1]
                self._blocks[block_hashes[b]] = _BlockRows(scores.k, rows)
            self._blocks.move_to_end(block_hashes[b])
        scores.num_recorded_blocks = max(scores.num_recorded_blocks, num_complete)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
