"""KV cache groups: which layers share a block table (vLLM's hybrid KV cache layout).

A model whose layers all attend the same way has one group of all its layers, and
every layer has its own cache array. A model that mixes sliding-window and full
layers (Gemma 2 and 3; Qwen2 with `max_window_layers`) has groups of one attention
type each, of `group_size` layers (the fewest layers of any type; a type's last group
may be shorter). Group `g`'s layer `j` stores its K/V in cache array `j` (a *slot*):
the arrays are shared by the groups, a block id belongs to one group at a time, and a
block holds `group_size` layers' K/V. A sliding group then frees the blocks wholly
outside its window (`jaxllm.core.kv_cache_manager`), so a long request holds about
`window / block_size + 1` blocks in each sliding group instead of one per
`block_size` tokens in every layer.

This module is the one statement of that layout: the KV cache managers (host) and the
forward pass and runner (device) all read it. It imports nothing of JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def peak_blocks(num_tokens: int, block_size: int, window: int | None, chunk: int) -> int:
    """Blocks one request of `num_tokens` tokens holds at most in one group, computing
    at most `chunk` tokens a step: one per `block_size` tokens, or with a sliding
    `window` those the window and a step's chunk span (a block more where they
    straddle block boundaries)."""
    total = cdiv(num_tokens, block_size)
    return total if window is None else min(total, cdiv(window - 1 + min(chunk, num_tokens), block_size) + 1)


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    """Attributes:
        layers: per group, its layers in order (group g's j-th layer uses slot j).
        windows: per group, the sliding window its layers attend through (None: full).
        group_size: cache arrays (slots): the most layers of any group.
    """

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    def group_of(self, layer: int) -> int:
        return next(g for g, ls in enumerate(self.layers) if layer in ls)

    def slot_of(self, layer: int) -> int:
        return self.layers[self.group_of(layer)].index(layer)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds over all groups
        (module function `peak_blocks`)."""
        return sum(peak_blocks(num_tokens, block_size, w, chunk) for w in self.windows)


def kv_cache_groups(windows: Sequence[int | None], hybrid: bool = True) -> KVCacheGroups:
    """The groups of a model whose layer `i` attends through `windows[i]` (None: every
    earlier key). `hybrid=False` (vLLM's `disable_hybrid_kv_cache_manager`): one group
    of all layers that never frees a block (its layers still slide)."""
    num_layers = len(windows)
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full first
    if not hybrid or len(kinds) == 1:
        window = kinds[0] if hybrid and len(kinds) == 1 else None
        return KVCacheGroups((tuple(range(num_layers)),), (window,), num_layers)
    by_kind = {w: [i for i in range(num_layers) if windows[i] == w] for w in kinds}
    size = min(len(ls) for ls in by_kind.values())
    layers, group_windows = [], []
    for w, ls in by_kind.items():
        for start in range(0, len(ls), size):
            layers.append(tuple(ls[start:start + size]))
            group_windows.append(w)
    return KVCacheGroups(tuple(layers), tuple(group_windows), size)
