"""Building blocks of the paged KV cache manager: blocks, the free queue, block hashes.

A KV cache *block* holds the keys and values of ``block_size`` consecutive tokens of
one sequence. On the host a block is only bookkeeping (:class:`KVCacheBlock`); the
device arrays are indexed by ``block_id``.

Block hashes identify the *content* of a full block for prefix caching. The hash of
block ``i`` of a request covers

* the hash of block ``i - 1`` (or a fixed root for block 0), so a block's hash
  identifies the whole token prefix up to and including it,
* the request's extra keys (LoRA id, cache salt), which change the KV values or must
  isolate tenants, and
* the block's token ids.

The hash is SHA-256 over a compact, unambiguous byte encoding, so it is identical
across processes, runs and machines (unlike Python's salted ``hash``)::

    parent hash (32 bytes)
    | u32 length of extra keys | extra keys (see encode_extra_keys)
    | u32 number of tokens     | token ids as little-endian int64
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest (32 bytes) of a full block's token prefix; see the module docstring."""

ROOT_BLOCK_HASH = BlockHash(hashlib.sha256(b"jaxllm.kv_cache.root_block_hash").digest())
"""Parent hash used for the first block of every request."""

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_token_structs: dict[int, struct.Struct] = {}


def _pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Encode ``token_ids`` as a u32 count followed by little-endian int64 values."""
    n = len(token_ids)
    packer = _token_structs.get(n)
    if packer is None:
        packer = _token_structs[n] = struct.Struct(f"<I{n}q")
    return packer.pack(n, *token_ids)


def encode_extra_keys(lora_id: int | None = None, cache_salt: str | None = None) -> bytes:
    """Encode a request's extra hash keys into a self-delimiting byte string.

    Each present key is tagged (``L`` + int64 LoRA id, ``S`` + u32 length + UTF-8
    salt) and the whole is prefixed by its u32 length, so different key sets can
    never encode to the same bytes. With no keys the result is four zero bytes.
    """
    body = b""
    if lora_id is not None:
        body += b"L" + _I64.pack(lora_id)
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8")
        body += b"S" + _U32.pack(len(salt)) + salt
    return _U32.pack(len(body)) + body


NO_EXTRA_KEYS = encode_extra_keys()
"""Encoded extra keys of a request without LoRA and without cache salt."""


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: bytes = NO_EXTRA_KEYS,
) -> BlockHash:
    """Stable hash of one full block.

    Args:
        parent_block_hash: hash of the previous block of the same request, or None
            for the first block (then :data:`ROOT_BLOCK_HASH` is used).
        token_ids: the block's token ids (``block_size`` of them).
        extra_keys: output of :func:`encode_extra_keys` for the request.
    """
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    return BlockHash(hashlib.sha256(parent + extra_keys + _pack_token_ids(token_ids)).digest())


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: bytes = NO_EXTRA_KEYS,
    parent_block_hash: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block is skipped)."""
    hashes: list[BlockHash] = []
    parent = parent_block_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


@dataclass(slots=True, eq=False, repr=False)
class KVCacheBlock:
    """Host-side metadata of one physical KV cache block.

    Attributes:
        block_id: index of the block in the device KV cache arrays.
        ref_cnt: number of requests whose block table holds this block; 0 means the
            block sits in the free queue (possibly still holding cached content).
        block_hash: hash of the full block's content while the block is in the
            prefix cache (the pool's hash -> block map points at it); None otherwise.
        prev_free_block, next_free_block: links of the free queue's doubly-linked
            list; only meaningful while the block is in the queue.
        is_null: True only for the reserved null block that padding writes into.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        block_hash = self.block_hash.hex()[:12] if self.block_hash else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={block_hash}, prev_free={prev_id}, next_free={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks as a doubly-linked list threaded through the blocks themselves.

    The front holds the block to reuse next (least recently freed), the back the most
    recently freed one. Popping from the front, appending at the back and removing a
    block from anywhere (a prefix-cache hit on a free block) are all O(1). Two sentinel
    blocks (id -1) bound the list so no operation needs a None check.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Build the queue holding ``blocks`` in the given order."""
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self.num_free_blocks = 0
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            self.num_free_blocks += 1
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block; raises IndexError when the queue is empty."""
        block = self._head.next_free_block
        if block is self._tail:
            raise IndexError("pop from an empty free block queue")
        assert block is not None
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` front blocks in queue order; IndexError if fewer."""
        if n > self.num_free_blocks:
            raise IndexError(f"cannot pop {n} blocks from a free queue of {self.num_free_blocks}")
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            out.append(block)
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue; ValueError if it is not in it."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back of the queue (it will be reused last)."""
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` at the back, in order."""
        if not blocks:
            return
        last = self._tail.prev_free_block
        assert last is not None
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All queued blocks, front to back (O(n); for tests and debugging)."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free_block
        return out
