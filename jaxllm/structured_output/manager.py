"""Grammars for the engine core: compiled on a thread pool, cached, and turned into
each step's token bitmask.

llguidance (no other dependencies; its matcher computes a mask over the vocabulary
lazily from a lexer and an Earley parser, so there is no per-schema automaton to build
over the whole vocabulary first) is the backend; docs/structured_outputs.md says why.
A request's grammar is compiled once per distinct constraint: the compiled matcher is
kept (LRU) and each request gets a deep copy of it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
from jaxtyping import Int

from jaxllm.core.structured_output import StructuredOutputRequest
from jaxllm.core.token_filter import TokenFilter
from jaxllm.reasoning import ThinkingState

logger = logging.getLogger(__name__)


class GuidanceGrammar:
    """One request's matcher (the core's `Grammar`); with `thinking`, the tokens of a
    reasoning model's thinking pass it by (vLLM's structured outputs with a reasoning
    parser)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int | None,
                 thinking: ThinkingState | None = None) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self.thinking = thinking
        self._terminated = False

    def accept_token(self, token: int) -> bool:
        if self.thinking is not None and self.thinking.accept(token):
            return True
        if self._terminated or self.matcher.is_stopped():
            self._terminated = True
            return True
        if token == self.eos_token_id:
            self._terminated = True
        return self.matcher.consume_token(token)

    @property
    def constrains(self) -> bool:
        return not self._terminated and not (self.thinking is not None and self.thinking.free)

    @property
    def also_allowed(self) -> int | None:
        return None if self.thinking is None else self.thinking.also_allowed

    def valid_prefix(self, tokens: list[int]) -> int:
        """While thinking: the drafts before the thinking's end (the end itself is
        sampled unmasked, the grammar's rows come the step after); at an output's start
        that may think: none."""
        if self.thinking is not None and (self.thinking.free or self.thinking.also_allowed is not None):
            end = self.thinking.end_id
            return 0 if not self.thinking.free else (tokens.index(end) if end in tokens else len(tokens))
        if self._terminated or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(tokens)


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _bits(tokens, width: int) -> Int[np.ndarray, " W"]:
    """The bitmask row with exactly `tokens` set."""
    ids = np.asarray(tokens, np.int64)
    words = np.zeros(width, np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


@functools.lru_cache(maxsize=256)
def _allowed_row(allowed: tuple[int, ...], width: int) -> Int[np.ndarray, " W"]:
    """An allowed_token_ids row, made once per set (each step copies it)."""
    row = _bits(allowed, width)
    row.flags.writeable = False
    return row


def token_filter_mask(f: TokenFilter, output: list[int], width: int) -> Int[np.ndarray, " W"]:
    """The bitmask row of a token filter for the token after `output`."""
    words = np.full(width, -1, np.int32) if f.allowed is None else _allowed_row(f.allowed, width).copy()
    banned = f.banned(output)
    if banned:
        words &= ~_bits(banned, width)
    return words


def apply_token_filters(bitmask: Int[np.ndarray, "N W"] | None, rows: list[tuple[int, TokenFilter, list[int], list[int]]],
                        num_rows: int, width: int) -> Int[np.ndarray, "N W"] | None:
    """`bitmask` (None: everything allowed) with each (first row, filter, output, drafts)
    ANDed in: rows row .. row + len(drafts), after the output and each draft in turn."""
    if not rows:
        return bitmask
    words = np.full((num_rows, width), -1, np.int32) if bitmask is None else bitmask
    for row, f, output, drafts in rows:
        for i in range(1 + len(drafts)):
            words[row + i] &= token_filter_mask(f, output + drafts[:i], width)
    return words


class StructuredOutputManager:
    def __init__(self, tokenizer, *, vocab_size: int, eos_token_id: int | None, num_threads: int = 2,
                 cache_size: int = 256) -> None:
        """`tokenizer`: the model's transformers tokenizer (fast); its llguidance form
        is built on first use (about a second for a 50k vocabulary)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, "grammar")
        self._executor: llguidance.LLExecutor | None = None
        self._pending: set[concurrent.futures.Future] = set()
        self.num_compiled = 0  # distinct grammars compiled (cache misses)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def submit(self, state: StructuredOutputRequest) -> concurrent.futures.Future:
        """Compile `state`'s grammar on the pool; sets `state.grammar`, or `state.error`."""
        future = self._pool.submit(self._compile_into, state)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a pending compilation ends (or `timeout` seconds): what a step
        with nothing to run but requests waiting for their grammar does."""
        concurrent.futures.wait(list(self._pending), timeout, concurrent.futures.FIRST_COMPLETED)

    def _compile_into(self, state: StructuredOutputRequest) -> None:
        try:
            state.grammar = GuidanceGrammar(self.matcher_for(state.params.grammar_text()), self.eos_token_id,
                                            state.thinking)
        except Exception as e:  # reported by the scheduler, which aborts the request
            state.error = str(e) or type(e).__name__

    def matcher_for(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher of `grammar`, from the cache of compiled ones."""
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            with self._lock:
                self.num_compiled += 1
                self._compiled[grammar] = template
                while len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
        return template.deep_copy()

    def bitmask(self, rows: list[tuple[int, GuidanceGrammar, list[int]]], num_rows: int
                ) -> Int[np.ndarray, "N W"] | None:
        """One step's token bitmask over its `num_rows` sample rows: bit t % 32 of word
        t // 32 allows token t; each (row, grammar, drafts) given fills rows row ..
        row + len(drafts): its grammar's mask now, then after each draft token in turn
        (speculative decoding; the grammar's state is left as it was); the other rows
        allow everything. None when no row is constrained."""
        if not rows:
            return None
        words = np.full((num_rows, bitmask_width(self.vocab_size)), -1, np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        plain = [(g.matcher, row) for row, g, drafts in rows if not drafts]
        drafted = [(g.matcher, row, list(drafts)) for row, g, drafts in rows if drafts]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, words)
        if drafted:  # (llguidance refuses an empty draft list)
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, words)
        for row, g, _ in rows:
            if (token := g.also_allowed) is not None:
                words[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        return words
