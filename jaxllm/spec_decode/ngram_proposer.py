"""The n-gram proposer (prompt lookup decoding): the request's last n tokens, looked up
earlier in its own prompt and output, propose the tokens that followed them. Host side,
numpy; O(length x n) per request and n-gram length."""

from __future__ import annotations

import numpy as np
from jaxtyping import Int


class NgramProposer:
    """Attributes:
        min_n, max_n: the n-gram lengths matched, longest first.
        k: the most tokens proposed.
    """

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"n-gram proposer: need 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, tokens: Int[np.ndarray, "L"]) -> Int[np.ndarray, "P"]:
        """k draft tokens following the latest earlier occurrence of the longest suffix
        of `tokens` (from max_n down to min_n tokens) that occurred before; none without
        one. Where the tokens after that occurrence run out before k, they continue as
        they began: text repeating from `start` has period len(tokens) - start (a run
        of one token proposes k more, not one)."""
        tokens = np.asarray(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: each followed by a token, the suffix itself excluded
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            starts = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if starts.size:
                start = starts[-1] + n
                return tokens[start + np.arange(self.k) % (length - start)]
        return tokens[:0].copy()

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
