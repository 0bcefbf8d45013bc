"""A request's structured-output state as the scheduler sees it.

The grammar is compiled off the engine loop (jaxllm.structured_output.manager); until
it is ready the request waits in the queue while others run. Once running, the
scheduler advances the grammar's matcher by every token the request accepts, so a
preempted request resumes with the right state (its output tokens are kept) and each
of n samples has its own. The grammar is opaque here: anything with the methods of
`Grammar`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxllm.reasoning import ThinkingState
from jaxllm.structured_output.params import StructuredOutputsParams


class Grammar(Protocol):
    def accept_token(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""

    @property
    def constrains(self) -> bool:
        """The next token is masked: the grammar has not ended (EOS accepted) and the
        output is not thinking (a reasoning model's, before its answer)."""

    @property
    def also_allowed(self) -> int | None:
        """A token the mask must allow beside the grammar's (a think block's opening, at
        the start of an output that may think first)."""

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the start, the grammar would accept in turn (its
        state unchanged): the draft tokens worth verifying."""


@dataclasses.dataclass(eq=False)
class StructuredOutputRequest:
    params: StructuredOutputsParams
    thinking: ThinkingState | None = None  # with a reasoning parser: the grammar starts after the thinking
    grammar: Grammar | None = None  # set by the compiling thread when ready
    error: str | None = None  # set by the compiling thread when it failed

    @property
    def ready(self) -> bool:
        return self.grammar is not None or self.error is not None
