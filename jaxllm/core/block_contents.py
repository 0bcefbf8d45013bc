"""What each KV cache block holds, token by token, so a prompt can reuse part of a block.

The prefix cache (block hashes) shares whole blocks. A prompt that shares only the first
few tokens of a block with an earlier one (the context of a multiple-choice question
and its answers: a 12-token question is shorter than a block) would recompute them. So
every block written by a finished step has a :class:`BlockContent`: the tokens whose K/V
it holds, and the prompt logprob rows that predict them when its writer scored its
prompt. A new request looks up the blocks that follow its last full-block hit (by the
parent key: the hash of the previous full block), takes the one sharing the most
leading tokens, and copies that block's K/V into a block of its own (copy-on-write):
it then computes only its own tokens.

A record stays valid while its block keeps its content, freed or not; the block pool
forgets it when it hands the block out again. Only tokens of finished steps are
recorded, so a copy taken before a step reads K/V that is already written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

Row = tuple[list[int], list[float], int]  # (scored token then alternatives, their logprobs, rank)


@dataclasses.dataclass
class BlockContent:
    """The tokens in one block (from its first slot) and the rows that score them.

    Attributes:
        block_id: the block.
        parent: the key of what precedes the block (see :func:`parent_key`).
        tokens: tokens whose K/V finished steps wrote, in slot order.
        rows: ``rows[i]`` predicts ``tokens[i]`` (None for a prompt's token 0); at most
            ``len(tokens)`` rows, none when the writer did not score its prompt.
        k: alternatives per row (``-1`` without rows).
    """

    block_id: int
    parent: bytes
    tokens: list[int]
    rows: list[Row | None]
    k: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class BlockContents:
    """The records of written blocks, by block id and by parent key."""

    def __init__(self) -> None:
        self._by_block: dict[int, BlockContent] = {}
        self._children: dict[bytes, dict[int, BlockContent]] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def get(self, block_id: int) -> BlockContent | None:
        return self._by_block.get(block_id)

    def set(self, content: BlockContent) -> None:
        """Record (or replace) what a block holds."""
        self.forget(content.block_id)
        self._by_block[content.block_id] = content
        self._children.setdefault(content.parent, {})[content.block_id] = content

    def forget(self, block_id: int) -> None:
        """The block is being reused: its content is no longer there."""
        content = self._by_block.pop(block_id, None)
        if content is None:
            return
        siblings = self._children[content.parent]
        del siblings[block_id]
        if not siblings:
            del self._children[content.parent]

    def children(self, parent: bytes) -> list[BlockContent]:
        """The recorded blocks that follow ``parent``."""
        return list(self._children.get(parent, {}).values())

    def clear(self) -> None:
        self._by_block.clear()
        self._children.clear()
