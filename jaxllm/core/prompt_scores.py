"""Prompt logprobs on the scheduler's side: what each request has scored, and how
far a request can reuse what others scored.

A prompt logprob row for position p holds the log-probability (and rank) of prompt
token p + 1 and the top alternatives: a function of tokens 0..p + 1 only. A request
that reuses the K/V of its first L tokens (prefix-cache blocks, then a partly shared
block; :mod:`jaxllm.core.block_contents`) does not compute positions 0..L - 1, so it
needs the rows that predict tokens 1..L from the records of those blocks, which keep
the rows that predict their tokens. Token L is the request's own first token that
differs from what it reuses, or the one after it, so the row predicting it may not be
known: then the request reuses a token less and computes that position itself
(:meth:`PromptScores.reusable`).

The same bookkeeping keeps a request that is preempted and recomputed from emitting its
prompt rows twice: ``PromptScores.rows`` are the rows emitted or due, and the runner
scores only positions from ``len(rows)`` on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxllm.core.block_contents import BlockContent, Row
from jaxllm.messages import LogprobsLists


@dataclasses.dataclass
class PromptScores:
    """A request's prompt logprob rows so far: row p scores prompt token p + 1.

    Attributes:
        k: top alternatives per row the request asked for.
        rows: rows of positions 0..len(rows) - 1, in order.
        num_sent: rows already handed out in engine-core outputs.
    """

    k: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    num_sent: int = 0

    def extend(self, lists: LogprobsLists) -> None:
        self.rows.extend(zip(lists.token_ids, lists.logprobs, lists.ranks))

    def take_unsent(self) -> LogprobsLists | None:
        """The rows not handed out yet (None if there are none); marks them sent."""
        if self.num_sent == len(self.rows):
            return None
        rows, self.num_sent = self.rows[self.num_sent:], len(self.rows)
        return LogprobsLists([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])

    def reusable(self, records: Sequence[BlockContent | None], token_ids: Sequence[int], num_prompt_tokens: int,
                 block_size: int, limit: int) -> int:
        """How many leading tokens (at most ``limit``, whose K/V is reusable) the
        request can skip: the most for which every row it would not compute is
        scored already or in ``records`` (the records of its blocks, in order).

        Args:
            records: block ``i``'s record for the request's block ``i``; None where
                there is none.
            token_ids: the request's tokens.
            num_prompt_tokens: its prompt's length (only prompt tokens have rows).
            block_size: tokens per block.
            limit: the reusable prefix's length.
        """
        length = min(len(self.rows), limit)
        for p in range(len(self.rows) + 1, limit + 1):
            if p >= num_prompt_tokens:  # generated tokens need no row
                return limit
            if self._recorded_row(records, token_ids, block_size, p) is None:
                break
            length = p
        return length

    def _recorded_row(self, records: Sequence[BlockContent | None], token_ids: Sequence[int], block_size: int,
                      p: int) -> Row | None:
        """The recorded row predicting token ``p``, if a record has one for this very
        token with enough alternatives."""
        b, i = divmod(p, block_size)
        record = records[b] if b < len(records) else None
        if record is None or record.k < self.k or i >= len(record.rows) or record.tokens[i] != token_ids[p]:
            return None
        return record.rows[i]

    def fill(self, records: Sequence[BlockContent | None], token_ids: Sequence[int], num_prompt_tokens: int,
             block_size: int, num_skipped: int) -> None:
        """Append the recorded rows of the positions the request skips (those before
        ``num_skipped``, after what it has scored), as :meth:`reusable` allowed."""
        end = min(num_skipped, num_prompt_tokens - 1)  # rows predicting tokens 1..end
        for p in range(len(self.rows) + 1, end + 1):
            row = self._recorded_row(records, token_ids, block_size, p)
            if row is None:
                raise AssertionError("fill() beyond reusable()")
            ids, logprobs, rank = row
            self.rows.append((ids[: 1 + self.k], logprobs[: 1 + self.k], rank))
