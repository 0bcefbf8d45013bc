"""Pure-jnp references for the Pallas kernels in this package.

These are the oracles the kernel tests compare against, so they are written to be
obviously correct rather than fast: every query token gathers the *whole* K/V of its
own sequence through the block table and does a plain masked softmax over it.

Memory is O(T * max_blocks_per_seq * block_size * num_kv_heads * head_dim): fine for
tests and small models; a production XLA path for long contexts should tile this.

Semantics shared with the kernels (see docs/kernels.md):

* ``q`` rows are the new tokens of all sequences, concatenated; sequence ``s`` owns
  rows ``query_start_loc[s] .. query_start_loc[s+1]-1``. Rows at or past
  ``query_start_loc[num_seqs]`` are padding (their output is unspecified; here 0).
* Sequence ``s`` has ``kv_lens[s]`` tokens in the cache, the last ``q_len`` of which
  are its new tokens. Its i-th new token sits at position
  ``kv_lens[s] - q_len + i`` and attends causally to positions ``0 .. that``.
* ``sliding_window=W`` keeps only keys with ``query_pos - key_pos < W``.
* ``soft_cap=c`` maps logits ``x -> c * tanh(x / c)`` (after ``sm_scale``).
* K/V cache layout ``[num_blocks, block_size, num_kv_heads, head_dim]``; token at
  position ``p`` of sequence ``s`` lives in block ``block_tables[s, p // block_size]``
  at offset ``p % block_size``.
* The cache holds float32, bfloat16, float16, float8_e4m3fn or int8 elements
  (``CACHE_DTYPES``; the formats of ``jaxllm.attention.kv_cache``). An int8 cache comes
  with float32 scales ``k_scale`` / ``v_scale`` ``[num_blocks, block_size,
  num_kv_heads]``, one per token and KV head: an element reads as its value times its
  row's scale. The other dtypes are read as they are (no scales).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

__all__ = ["ragged_paged_attention_reference", "write_kv_cache_reference", "CACHE_DTYPES",
           "check_kv_cache_scales"]

# The KV cache element dtypes the attention kernels read (jaxllm.attention.kv_cache's
# KV_CACHE_FORMATS); int8 is the one with per-row scales.
CACHE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16,
                                            jnp.float8_e4m3fn, jnp.int8))
SCALED_CACHE_DTYPE = jnp.dtype(jnp.int8)
FP8_E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value: writes saturate there


def check_kv_cache_scales(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Validate a cache's dtype and its scales; return whether it is scaled (int8).

    K and V share one of ``CACHE_DTYPES``; ``k_scale`` and ``v_scale`` are given
    together, exactly when the cache is int8, shaped like the cache without head_dim.
    """
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    if k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {k_cache.dtype} is not one of "
                         f"{', '.join(d.name for d in CACHE_DTYPES)}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass k_scale and v_scale together (both or neither)")
    scaled = k_cache.dtype == SCALED_CACHE_DTYPE
    if scaled and k_scale is None:
        raise ValueError("an int8 KV cache needs its per-row scales: pass k_scale and v_scale "
                         "([num_blocks, block_size, num_kv_heads] float32)")
    if not scaled and k_scale is not None:
        raise ValueError(f"k_scale/v_scale are for an int8 KV cache only; this cache is "
                         f"{k_cache.dtype} (its elements are read as they are)")
    if scaled:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc.shape != k_cache.shape[:3]:
                raise ValueError(f"{name} must be {k_cache.shape[:3]} (the cache's shape without "
                                 f"head_dim), got {sc.shape}")
    return scaled


def _num_seqs_scalar(num_seqs: Int[Array, ""] | Int[Array, 1] | int) -> Int[Array, ""]:
    return jnp.reshape(jnp.asarray(num_seqs, jnp.int32), (-1,))[0]


def ragged_paged_attention_reference(
    q: Float[Array, "T H hd"],
    k_cache: Shaped[Array, "N B Hkv hd"],
    v_cache: Shaped[Array, "N B Hkv hd"],
    kv_lens: Int[Array, " S"],
    block_tables: Int[Array, "S MB"],
    query_start_loc: Int[Array, " S+1"],
    num_seqs: Int[Array, ""] | Int[Array, 1] | int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,  # accepted for signature parity with the kernel; unused
    k_scale: Float[Array, "N B Hkv"] | None = None,
    v_scale: Float[Array, "N B Hkv"] | None = None,
) -> Float[Array, "T H hd"]:
    """Ragged paged attention, the simple way. Same signature as the kernel.

    ``k_scale`` / ``v_scale``: an int8 cache's per-row scales (required exactly then);
    the gathered K/V are dequantized in float32 (element * scale) before any math.
    """
    del interpret
    scaled = check_kv_cache_scales(k_cache, v_cache, k_scale, v_scale)
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    S, MB = block_tables.shape
    G = Hq // Hkv
    L = MB * BS
    n = _num_seqs_scalar(num_seqs)
    qsl = query_start_loc.astype(jnp.int32)

    # Which sequence each query row belongs to: the first s with qsl[s+1] > t
    # (empty sequences have qsl[s+1] == qsl[s] and are skipped naturally). Only the
    # first num_seqs entries count, so qsl may hold anything past num_seqs.
    tok = jnp.arange(T, dtype=jnp.int32)
    real = jnp.arange(S, dtype=jnp.int32) < n
    seq = jnp.sum((qsl[1 : S + 1][None, :] <= tok[:, None]) & real[None, :], axis=1)
    seq = seq.astype(jnp.int32)
    seq = jnp.minimum(seq, S - 1)
    row_valid = tok < qsl[n]

    q_len = qsl[seq + 1] - qsl[seq]
    kv_len = kv_lens[seq]
    q_pos = kv_len - q_len + (tok - qsl[seq])  # absolute position of each query row

    # Gather each row's full K/V through its sequence's block table.
    blocks = block_tables[seq]  # [T, MB]
    k = k_cache[blocks].reshape(T, L, Hkv, D).astype(jnp.float32)
    v = v_cache[blocks].reshape(T, L, Hkv, D).astype(jnp.float32)
    if scaled:  # int8: element * its row's scale (float32)
        k = k * k_scale[blocks].reshape(T, L, Hkv, 1).astype(jnp.float32)
        v = v * v_scale[blocks].reshape(T, L, Hkv, 1).astype(jnp.float32)

    k_pos = jnp.arange(L, dtype=jnp.int32)[None, :]  # [1, L]
    mask = (k_pos <= q_pos[:, None]) & (k_pos < kv_len[:, None]) & row_valid[:, None]
    if sliding_window is not None:
        mask = mask & (q_pos[:, None] - k_pos < sliding_window)

    # Never let bytes outside the mask (stale or NaN cache contents) reach the output.
    v = jnp.where(mask[:, :, None, None], v, 0.0)

    qg = q.reshape(T, Hkv, G, D).astype(jnp.float32)
    logits = jnp.einsum("thgd,tlhd->thgl", qg, k, precision=jax.lax.Precision.HIGHEST)
    logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    m4 = mask[:, None, None, :]
    logits = jnp.where(m4, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(m4, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("thgl,tlhd->thgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(T, Hq, D).astype(q.dtype)


def write_kv_cache_reference(
    k: Float[Array, "T Hkv hd"],
    v: Float[Array, "T Hkv hd"],
    k_cache: Shaped[Array, "N B Hkv hd"],
    v_cache: Shaped[Array, "N B Hkv hd"],
    slot_mapping: Int[Array, " T"],
    *,
    interpret: bool = False,  # signature parity with the kernel; unused
) -> tuple[Shaped[Array, "N B Hkv hd"], Shaped[Array, "N B Hkv hd"]]:
    """Scatter the new tokens' K/V into the paged cache.

    ``slot_mapping[t] = block_id * block_size + offset``. Padding tokens point into the
    reserved null block; their slots may repeat and what lands there is never read.
    Values are cast to the cache's dtype (a float8_e4m3fn cache saturates at +-448).
    Unscaled caches only: an int8 cache's write is jaxllm.attention.kv_cache's.
    """
    del interpret
    NB, BS, Hkv, D = k_cache.shape

    def to_cache(x, dtype):
        if dtype == jnp.float8_e4m3fn:
            x = jnp.clip(x.astype(jnp.float32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
        return x.astype(dtype)

    kc = k_cache.reshape(NB * BS, Hkv, D).at[slot_mapping].set(to_cache(k, k_cache.dtype))
    vc = v_cache.reshape(NB * BS, Hkv, D).at[slot_mapping].set(to_cache(v, v_cache.dtype))
    return kc.reshape(NB, BS, Hkv, D), vc.reshape(NB, BS, Hkv, D)
