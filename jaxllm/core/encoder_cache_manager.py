"""The encoder cache (vLLM's): where a vision-language model's image embeddings live
between the step that encodes an image and the steps that compute its tokens.

The model runner holds a table of `num_slots * tokens_per_image` embedding rows on the
device; each image takes one slot, found by the hash of its content. A slot is held by
the requests whose image tokens are still to be computed; when none holds it, it stays
as it is, and a later request with the same image reuses it without encoding (a hit),
until the slot is needed for another image (least recently used first).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict


@dataclasses.dataclass
class EncoderCacheStats:
    """Images looked up, found encoded already (no encoder step), and encoded."""

    queries: int = 0
    hits: int = 0
    encoded: int = 0


class EncoderCacheManager:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}  # image hash -> its slot (encoded, or encoding this step)
        self.holders: dict[str, set[str]] = {}  # image hash -> the requests holding it
        self.free: OrderedDict[str, None] = OrderedDict()  # encoded, held by nobody: least recently used first
        self._never_used = list(range(num_slots - 1, -1, -1))
        self.stats = EncoderCacheStats()

    def lookup(self, mm_hash: str, request_id: str) -> int | None:
        """The slot of an encoded image, now held by `request_id` (None: not cached)."""
        slot = self.slot_of.get(mm_hash)
        if slot is not None:
            self._hold(mm_hash, request_id)
        return slot

    def can_allocate(self) -> bool:
        return bool(self._never_used or self.free)

    def allocate(self, mm_hash: str, request_id: str) -> int:
        """A slot for an image to encode this step (the least recently used free one
        evicted where none was ever used), held by `request_id`."""
        if self._never_used:
            slot = self._never_used.pop()
        else:
            evicted, _ = self.free.popitem(last=False)
            slot = self.slot_of.pop(evicted)
        self.slot_of[mm_hash] = slot
        self._hold(mm_hash, request_id)
        self.stats.encoded += 1
        return slot

    def release(self, mm_hash: str, request_id: str) -> None:
        """`request_id` needs the image no more (its tokens are computed, or it ended)."""
        holders = self.holders.get(mm_hash)
        if holders is None or request_id not in holders:
            return
        holders.discard(request_id)
        if not holders:
            del self.holders[mm_hash]
            self.free[mm_hash] = None

    def count_lookup(self, hit: bool) -> None:
        self.stats.queries += 1
        self.stats.hits += hit

    def _hold(self, mm_hash: str, request_id: str) -> None:
        self.free.pop(mm_hash, None)
        self.holders.setdefault(mm_hash, set()).add(request_id)
