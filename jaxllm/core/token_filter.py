"""vLLM's `allowed_token_ids` and `bad_words` as a request's token filter.

`allowed_token_ids`: only those tokens may be sampled. `bad_words`: each word's token
ids (as the tokenizer spells it alone and after a space, `SamplingParams.bad_words_token_ids`)
are never generated in full: a one-token word is always banned, a longer one's last
token is banned where the output so far ends with the others. The engine turns a
filter into the structured-output bitmask's form and ANDs it in
(jaxllm.structured_output.manager.apply_token_filters), so a request may have a grammar
too.
"""

from __future__ import annotations

import dataclasses

from jaxllm.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class TokenFilter:
    allowed: tuple[int, ...] | None
    bad_words: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, params: SamplingParams) -> TokenFilter | None:
        """The request's filter; None when it has neither field."""
        bad = tuple(tuple(ids) for ids in params.bad_words_token_ids or () if ids)
        allowed = None if params.allowed_token_ids is None else tuple(params.allowed_token_ids)
        return None if allowed is None and not bad else cls(allowed, bad)

    @property
    def needs_tokens(self) -> bool:
        """Whether what it bans depends on the output so far (a bad word of several tokens)."""
        return any(len(w) > 1 for w in self.bad_words)

    def banned(self, output: list[int]) -> list[int]:
        """The tokens banned after `output` (the tokens generated so far)."""
        return [w[-1] for w in self.bad_words if len(w) == 1 or tuple(output[-(len(w) - 1):]) == w[:-1]]
