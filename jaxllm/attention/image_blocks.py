"""Images whose tokens attend to each other both ways (Gemma 3's vision-language model,
issue 65), on top of any attention backend.

The backends attend causally. For a step that computes an image's tokens (all of them
that are not in the prefix cache: the scheduler never splits an image between steps),
those tokens' outputs are computed again here, in plain jnp: each attends to its
sequence's keys before it (within the layer's window) and to every key of its image,
read through the block table after the step's K/V were written. Steps without such
an image skip it (a `lax.cond`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from jaxllm.attention.kv_cache import KVCache, fold_layer_scales, unfold_layer_scales
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.attention.xla import _gather_blocks, apply_soft_cap


@struct.dataclass
class ImageBlocks:
    """A step's images of bidirectional attention, G per step (padding: count 0)."""

    first_row: Int[Array, " G"]  # the step's row of the image's first token computed this step
    first_pos: Int[Array, " G"]  # that token's position in its sequence
    count: Int[Array, " G"]  # the image's tokens computed this step
    end: Int[Array, " G"]  # the position after the image's last token
    seq: Int[Array, " G"]  # the step's sequence holding it (its block table row)

    def attend(self, o: Float[Array, "T Q"], q: Float[Array, "T H hd"], cache: KVCache, md: AttentionMetadata, *,
               tokens_per_image: int, sm_scale: float, window: int | None, soft_cap: float | None
               ) -> Float[Array, "T Q"]:
        """`o` with the images' rows as bidirectional attention gives them."""
        def recompute(o):
            return self._recompute(o, q, cache, md, tokens_per_image, sm_scale, window, soft_cap)
        return jax.lax.cond((self.count > 0).any(), recompute, lambda o: o, o)

    def _recompute(self, o, q, cache: KVCache, md: AttentionMetadata, p: int, sm_scale: float, window, soft_cap):
        t, h, hd = q.shape
        step = jnp.arange(p, dtype=jnp.int32)
        valid = step[None, :] < self.count[:, None]  # [G, P]
        rows = jnp.where(valid, self.first_row[:, None] + step[None, :], 0)
        pos = self.first_pos[:, None] + step[None, :]
        tables = md.block_tables[self.seq]  # [G, MB]
        k = _gather_blocks(cache.k, tables, cache.k_scale, cache.dtype)  # [G, L, Hkv * hd]
        v = _gather_blocks(cache.v, tables, cache.v_scale, cache.dtype)
        hkv = cache.k.shape[2]
        k, v = (a.reshape(*a.shape[:2], hkv, hd) for a in (k, v))
        qg = fold_layer_scales(q, cache)[rows].astype(jnp.float32).reshape(*rows.shape, hkv, h // hkv, hd)
        scores = apply_soft_cap(jnp.einsum("gpkjd,glkd->gkjpl", qg, k) * sm_scale, soft_cap)
        k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :]
        visible = k_pos <= pos[..., None]
        if window is not None:
            visible &= k_pos > pos[..., None] - window
        start = (self.end - p)[:, None, None]
        visible |= (k_pos >= start) & (k_pos < self.end[:, None, None])  # [G, P, L]
        probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("gkjpl,glkd->gpkjd", probs, v).reshape(*rows.shape, h, hd)
        out = unfold_layer_scales(out.reshape(-1, h, hd), cache).reshape(-1, h * hd).astype(o.dtype)
        target = jnp.where(valid, rows, t).reshape(-1)  # padding rows dropped
        return o.at[target].set(out, mode="drop")
