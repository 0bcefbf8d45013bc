"""Incremental detokenization of one completion: token ids in, text out, with stop
strings and the streaming hold-back they need.

Decoding goes through `tokenizers.decoders.DecodeStream`, which buffers tokens until
they decode to whole UTF-8 characters, so a character whose bytes are split across
tokens is emitted once, complete, and never as U+FFFD halves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from jaxllm.sampling_params import SamplingParams
from jaxllm.stop_strings import find_stop, partial_stop_len

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens that prime the decode stream, so the first output token decodes as it
# would mid-text (e.g. a Metaspace decoder keeps its leading space).
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text of one completion, built as its tokens arrive.

    Holds the completion's token ids, its text so far, and how much of that text has
    been released to the user. With `stop` strings in the sampling params, `update`
    finds the first stop string and truncates the text there; while the request runs,
    a tail of the text that could still grow into a stop string is held back
    (see `get_next_output_text`). With `detokenize=False` only token ids are tracked.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.token_ids: list[int] = []  # the completion's token ids (all of them)
        self.output_text = ""  # its text, truncated at a stop string once one is found
        self._tokenizer: Tokenizer = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._min_tokens = params.min_tokens
        self._stop: list[str] = list(params.stop) if params.detokenize else []
        self._include_stop_str = params.include_stop_str_in_output
        self._released = 0  # chars of output_text already handed out as deltas
        self._held = 0  # chars at the end of output_text that may begin a stop string
        self._stream: DecodeStream | None = None
        if params.detokenize:
            context = _prompt_context(self._tokenizer, prompt_token_ids, self._skip_special_tokens)
            self._stream = DecodeStream(context, skip_special_tokens=self._skip_special_tokens)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append new token ids and their text; return the stop string that ends the
        completion, if one now appears (the text is then already truncated). Several
        tokens (accepted draft tokens) are checked one by one: the tokens after the one
        whose text completes a stop string are dropped, as decoding them one per step
        would never have made them.

        stop_terminated: the core finished the request on the last of these tokens
        (EOS or a stop token id); that token's text is left out of the output unless
        include_stop_str_in_output is set.
        """
        if self._stream is None:
            self.token_ids.extend(new_token_ids)
            return None
        to_decode = new_token_ids
        if stop_terminated and not self._include_stop_str:
            to_decode = new_token_ids[:-1]
        for token_id in to_decode:
            check_from = len(self.output_text)  # only matches ending in text of token number >= min_tokens count
            self.token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            if self._stop and len(self.token_ids) >= self._min_tokens:
                stop = self._check_stop(check_from)
                if stop is not None:
                    return stop
        self.token_ids.extend(new_token_ids[len(to_decode) :])
        if self._stop and not self._include_stop_str:
            self._held = partial_stop_len(self.output_text, self._stop)
        return None

    def _check_stop(self, check_from: int) -> str | None:
        """The stop string ending after `check_from` in the text, if any: the text is
        truncated at it."""
        match = find_stop(self.output_text, check_from, self._stop)
        if match is None:
            return None
        stop, start = match
        self.output_text = self.output_text[: start + len(stop) if self._include_stop_str else start]
        self._held = 0
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show the user now: all released text (delta=False) or only what
        was released since the previous delta call (delta=True).

        While the request runs, a held-back tail that may begin a stop string is not
        released; it is released as soon as it can no longer match, and at finish.
        """
        end = len(self.output_text) if finished else len(self.output_text) - self._held
        if not delta:
            return self.output_text[:end]
        start, self._released = self._released, max(self._released, end)
        return self.output_text[start:end]

    def _decode_next(self, token_id: int) -> str:
        assert self._stream is not None
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception as e:
            # DecodeStream raises when a decoder rewrites text it already returned
            # (seen with byte-fallback tokenizers on invalid UTF-8); start a fresh
            # stream at this token rather than fail the request.
            if not str(e).startswith("Invalid prefix encountered"):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer, token_id) or ""


def _prompt_context(tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The last few prompt tokens, trimmed at both ends until they decode to whole
    characters: a character the output merely continues then decodes from the output's
    own tokens, as `tokenizer.decode(output ids)` would, and is not claimed whole."""
    context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
    while context:
        text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        if text.startswith(REPLACEMENT_CHAR):
            context = context[1:]
        elif text.endswith(REPLACEMENT_CHAR):
            context = context[:-1]
        else:
            break
    return context
