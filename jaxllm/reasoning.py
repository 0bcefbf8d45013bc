"""Reasoning models' thinking kept apart from their answer (vLLM's `--reasoning-parser`).

Qwen3 and the DeepSeek-R1 family think inside `<think> ... </think>` before they answer.
A parser names the markers and where thinking starts:

- `deepseek_r1`: the output starts inside the thinking (R1's templates open it in the
  prompt; an output that opens it again has that `<think>` dropped); everything before
  `</think>` is reasoning, the rest the answer; an output that never closes it is all
  reasoning (cut short while thinking).
- `qwen3`: the output thinks if the prompt leaves a think block open (Qwen3's thinking
  templates) or the output begins with `<think>`; otherwise it is all answer (Qwen3 with
  `enable_thinking: false`, whose template closes an empty block in the prompt).

Text is split by `ReasoningSplitter`, one piece at a time as it streams (a whole output
is one piece), holding back what could be the start of a marker. Tokens are followed by
`ThinkingState` (the engine: a structured output's grammar applies from the end of the
thinking on, as vLLM's structured outputs with a reasoning parser do).
"""

from __future__ import annotations

import dataclasses

from jaxllm.stop_strings import partial_stop_len


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_thinking: bool  # the output begins inside the thinking, whatever the prompt says
    start: str = "<think>"
    end: str = "</think>"

    def prompt_state(self, prompt: str) -> str:
        """What `prompt` (the rendered chat) leaves the output: "open" (a think block
        opened for it), "closed" (it ends with a closed one: no thinking, as Qwen3's
        enable_thinking false) or "none" (the output may open one)."""
        if prompt.rfind(self.start) > prompt.rfind(self.end):
            return "open"
        return "closed" if prompt.rstrip().endswith(self.end) else "none"

    def token_ids(self, tokenizer) -> tuple[int, int]:
        """(start, end) marker token ids; ValueError where the tokenizer does not have
        each marker as one token (the template cannot be this parser's)."""
        ids = []
        for marker in (self.start, self.end):
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"reasoning_parser {self.name}: the model's tokenizer has no single token for "
                                 f"{marker!r} (it encodes it as {len(encoded)} tokens); it is not a {self.name} "
                                 "model")
            ids.append(encoded[0])
        return ids[0], ids[1]


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_thinking=True),
    "qwen3": ReasoningParser("qwen3", starts_thinking=False),
}


class ReasoningSplitter:
    """One output's text split into (reasoning, content) pieces as it arrives."""

    def __init__(self, parser: ReasoningParser, prompt_state: str) -> None:
        """`prompt_state`: ReasoningParser.prompt_state of the prompt."""
        self.parser = parser
        # "undecided": the output may still open a think block (only at its start)
        self.mode = ("reasoning" if parser.starts_thinking or prompt_state == "open"
                     else "content" if prompt_state == "closed" else "undecided")
        self.pending = ""  # text held back: it may be the start of a marker
        self.dropping_start = parser.starts_thinking  # a leading <think> is dropped
        self.after_marker = False  # the newlines right after a marker are dropped, in whichever piece

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) of this piece; `final`: nothing more will come, so
        nothing is held back."""
        reasoning, content = "", ""
        self.pending += text
        while self.pending:
            if self.after_marker:
                self.pending = self.pending.lstrip("\n")
                self.after_marker = not self.pending
                continue
            if self.mode == "content":
                content, self.pending = content + self.pending, ""
            elif self.mode == "undecided" or self.dropping_start:
                if not self._leading_start(final):
                    break
            else:  # reasoning, until the end marker
                at = self.pending.find(self.parser.end)
                if at >= 0:
                    reasoning += self.pending[:at]
                    self.pending = self.pending[at + len(self.parser.end):]
                    self.mode, self.after_marker = "content", True
                    continue
                keep = 0 if final else partial_stop_len(self.pending, [self.parser.end])
                reasoning += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
        return reasoning, content

    def _leading_start(self, final: bool) -> bool:
        """Decide whether the output opens with the start marker (dropping it); False
        while the text so far could still be it."""
        stripped = self.pending.lstrip()
        if stripped.startswith(self.parser.start):
            self.pending = stripped[len(self.parser.start):]
            self.mode, self.dropping_start, self.after_marker = "reasoning", False, True
            return True
        if not final and self.parser.start.startswith(stripped):
            return False  # maybe the marker, not all here yet
        self.dropping_start = False
        if self.mode == "undecided":
            self.mode = "content"
        return True


def split(parser: ReasoningParser, text: str, prompt_state: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), each None where empty."""
    reasoning, content = ReasoningSplitter(parser, prompt_state).feed(text, final=True)
    return reasoning or None, content or None


CLOSED_TAIL = 3  # a closed block ending the prompt: its end marker within its last tokens


@dataclasses.dataclass
class ThinkingState:
    """Whether a request's output is still thinking, token by token (the engine's side:
    its structured output's grammar waits until the thinking ends). `thinking` starts
    as the prompt leaves it (a think block opened after the last one closed, or, with
    `deepseek_r1`, always) and ends at the end marker's token."""

    start_id: int
    end_id: int
    thinking: bool
    may_open: bool  # qwen3 without an open block: the first output token may open one

    @classmethod
    def of_prompt(cls, parser: ReasoningParser, start_id: int, end_id: int, prompt_ids: list[int]) -> ThinkingState:
        """The state at the output's start: thinking where the prompt leaves a block open
        (or always, `deepseek_r1`); else the first token may open one, unless the prompt
        ends with a closed block (Qwen3's enable_thinking false: `</think>` and its
        newlines, at most CLOSED_TAIL tokens before the end)."""
        last_start = max((i for i, t in enumerate(prompt_ids) if t == start_id), default=-1)
        last_end = max((i for i, t in enumerate(prompt_ids) if t == end_id), default=-1)
        opened = last_start > last_end
        closed = last_end > last_start and last_end >= len(prompt_ids) - CLOSED_TAIL
        return cls(start_id, end_id, thinking=parser.starts_thinking or opened, may_open=not (opened or closed))

    def accept(self, token: int) -> bool:
        """Advance by an output token; True if it belongs to the thinking (the grammar
        does not see it)."""
        if self.thinking:
            self.may_open = False
            self.thinking = token != self.end_id
            return True
        if self.may_open:
            self.may_open = False
            if token == self.start_id:
                self.thinking = True
                return True
        return False

    @property
    def free(self) -> bool:
        """Whether the next token is the thinking's, unconstrained."""
        return self.thinking

    @property
    def also_allowed(self) -> int | None:
        """A token the grammar's mask must also allow next: the start marker, at an
        output's start that may open a think block."""
        return self.start_id if self.may_open and not self.thinking else None
