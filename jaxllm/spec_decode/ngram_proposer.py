"""The n-gram proposer (prompt lookup decoding): the request's last n tokens, looked up
earlier in its own prompt and output, propose the tokens that followed them. Host side,
numpy; one pass over the tokens per request, then a few gathers per earlier
occurrence of its last token."""

from __future__ import annotations

import numpy as np
from jaxtyping import Int


class NgramProposer:
    """Attributes:
        min_n, max_n: the n-gram lengths matched, longest first.
        k: the most tokens proposed.
        short_k: the most tokens a match shorter than max_n proposes (k: as any other).
    """

    def __init__(self, min_n: int, max_n: int, k: int, short_k: int | None = None) -> None:
        short_k = k if short_k is None else short_k
        if not 1 <= min_n <= max_n or not 1 <= short_k <= k:
            raise ValueError(f"n-gram proposer: need 1 <= min_n <= max_n and 1 <= short_k <= k, got "
                             f"{min_n}, {max_n}, {short_k}, {k}")
        self.min_n, self.max_n, self.k, self.short_k = min_n, max_n, k, short_k

    def propose(self, tokens: Int[np.ndarray, " L"]) -> Int[np.ndarray, " P"]:
        """k draft tokens following the latest earlier occurrence of the longest suffix
        of `tokens` (from max_n down to min_n tokens) that occurred before; none without
        one; short_k tokens where the match is shorter than max_n. Where the tokens after
        that occurrence run out, they continue as they began: text repeating from
        `start` has period len(tokens) - start (a run of one token proposes k more, not
        one)."""
        tokens = np.asarray(tokens)
        length = len(tokens)
        longest = min(self.max_n, length - 1)
        # every earlier position holding the last token ends a match; extend each backwards
        ends = np.flatnonzero(tokens[:length - 1] == tokens[-1]) if longest >= self.min_n else np.zeros(0, int)
        matched, alive = np.ones(len(ends), np.int64), np.ones(len(ends), bool)
        for j in range(1, longest):
            alive &= (ends >= j) & (tokens[np.maximum(ends - j, 0)] == tokens[length - 1 - j])
            matched += alive
        n = int(matched.max()) if len(ends) else 0
        if n < self.min_n:
            return tokens[:0].copy()
        start = int(ends[matched >= n][-1]) + 1  # the latest occurrence of the longest match
        count = self.k if n == self.max_n else self.short_k
        return tokens[start + np.arange(count) % (length - start)]

    def propose_batch(self, batch, req_ids: list[str], max_model_len: int) -> dict[str, list[int]]:
        """Drafts for each of `req_ids` from its tokens in `batch` (the model runner's
        InputBatch), never past `max_model_len`; requests without a match get none."""
        drafts = {}
        for req_id in req_ids:
            row = batch.row_of[req_id]
            room = max_model_len - 1 - int(batch.num_tokens[row])
            if room > 0:
                found = self.propose(batch.token_ids[row, :batch.num_tokens[row]])[:room]
                if len(found):
                    drafts[req_id] = found.tolist()
        return drafts

    def remove_requests(self, req_ids: set[str]) -> None:
        """Nothing to let go: the lookup keeps no state between steps."""
