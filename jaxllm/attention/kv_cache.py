"""The paged KV cache: per layer, K and V of shape [num_blocks, block_size, Hkv, hd].

Allocated once; the jitted step takes the caches as a donated argument, so the scatter
of new K/V below is done in place by XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int


@struct.dataclass
class KVCache:
    k: Float[Array, "N B Hkv hd"]
    v: Float[Array, "N B Hkv hd"]


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, sharding=None
) -> tuple[KVCache, ...]:
    """Zero-filled caches, one KVCache per layer (per-layer arrays are donated one by
    one), each filled where `sharding` places it (default: the default device)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return tuple(KVCache(k=zeros(), v=zeros()) for _ in range(num_layers))


def write_kv_cache(
    cache: KVCache,
    k: Float[Array, "T Hkv hd"],
    v: Float[Array, "T Hkv hd"],
    slot_mapping: Int[Array, "T"],
) -> KVCache:
    """Scatter the new tokens' K/V into their slots (slot = block * block_size + offset)."""
    n, bs, hkv, hd = cache.k.shape

    def scatter(dst, src):
        flat = dst.reshape(n * bs, hkv, hd)
        return flat.at[slot_mapping].set(src.astype(dst.dtype), mode="drop").reshape(n, bs, hkv, hd)

    return KVCache(k=scatter(cache.k, k), v=scatter(cache.v, v))


def copy_blocks(
    caches: tuple[KVCache, ...], src: Int[Array, "C"], dst: Int[Array, "C"]
) -> tuple[KVCache, ...]:
    """Copy whole blocks ``src[i]`` -> ``dst[i]`` in every layer (all reads before any
    write; padding pairs copy the null block onto itself)."""
    return tuple(KVCache(k=c.k.at[dst].set(c.k[src]), v=c.v.at[dst].set(c.v[src])) for c in caches)
