"""The paged KV cache: per layer, K and V of shape [num_blocks, block_size, Hkv, hd],
in one of KV_CACHE_FORMATS (the `kv_cache_dtype` option), plus for int8 a float32
scale per token and KV head ([num_blocks, block_size, Hkv]), and for fp8 with scales
(vLLM's k_scale / v_scale: `calculate_kv_scales`, or a checkpoint's) one float32 scale
per KV head for the whole cache array ([Hkv]).

fp8 with scales stores x / scale; attention reads the stored elements as they are and
the scales are folded around it: the queries are multiplied by K's scale and the output
by V's (softmax(q . k) v = softmax((q * ks) . (k / ks)) (v / vs) * vs), so every
attention backend serves it unchanged. Scales left at 0 are calculated by the first
write of real tokens (vLLM's calculate_kv_scales: max |x| over that step's tokens per
KV head, divided by vLLM's constants 200 for K and 100 for V, which leave fp8's range
of 448 headroom above what the first batch saw; beyond it values saturate) and kept.

Allocated once; the jitted step takes the caches as a donated argument, so the scatter
of new K/V below is done in place by XLA. The write quantizes; every attention backend
reads the stored elements, times the row's scale where there is one (`dequantize_rows`
is that arithmetic for the jnp backends).

On the CPU platform 16- and 8-bit float caches are stored as the unsigned integers of
their bits (`KVCache.dtype` names the element type): XLA:CPU runs a scatter into a
bfloat16 buffer by converting the whole buffer to float32 and back, 23 ms a SmolLM2
layer of 5000 blocks against 0.01 ms for the same bits as uint16 (so every step's K/V
write, and every block copy, would cost that).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int, Num, Shaped

FP8_E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448: writes saturate there (it has no inf)
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0  # calculated scales: the first batch's max |x| maps there (vLLM's)
INT8_MAX = 127.0


@dataclasses.dataclass(frozen=True)
class KVCacheFormat:
    """How the cache stores K and V: `dtype` elements, and where `scaled`, a float32
    scale per (token, KV head) row (x ~ q * scale, the row's max |x| maps to 127)."""

    name: str
    dtype: jnp.dtype
    scaled: bool = False
    layer_scaled: bool = False  # fp8 with a scale per KV head for the whole array (module docstring)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one token's K (or V) of one KV head takes, its scale included."""
        return head_dim * jnp.dtype(self.dtype).itemsize + (4 if self.scaled else 0)

    def token_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of K and V one token takes over all layers."""
        return 2 * num_layers * num_kv_heads * self.row_bytes(head_dim)

    def storage_dtype(self, platform: str | None = None) -> jnp.dtype:
        """The arrays' dtype on `platform` (default: JAX's): the element type, or on the
        CPU the unsigned integers of a 16- or 8-bit float's bits (module docstring)."""
        if (platform or jax.default_backend()) == "cpu" and jnp.issubdtype(self.dtype, jnp.floating) \
                and self.dtype.itemsize < 4:
            return jnp.dtype({2: jnp.uint16, 1: jnp.uint8}[self.dtype.itemsize])
        return self.dtype

    def bits_of(self) -> str:
        """KVCache.dtype of caches of this format: the element type's name where the
        arrays hold its bits, else ""."""
        return self.dtype.name if self.storage_dtype() != self.dtype else ""


KV_CACHE_FORMATS = {
    "float32": KVCacheFormat("float32", jnp.dtype(jnp.float32)),
    "bfloat16": KVCacheFormat("bfloat16", jnp.dtype(jnp.bfloat16)),
    "float16": KVCacheFormat("float16", jnp.dtype(jnp.float16)),
    "int8": KVCacheFormat("int8", jnp.dtype(jnp.int8), scaled=True),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", jnp.dtype(jnp.float8_e4m3fn)),
}


def kv_cache_format(name: str, model_dtype) -> KVCacheFormat:
    """The format of a `kv_cache_dtype` name (KV_CACHE_DTYPES): "auto" is the model's
    dtype (as vLLM's auto: bfloat16 for a bfloat16 model, also on the CPU where its
    activations stay float32), "fp8" is "fp8_e4m3"."""
    if name == "auto":
        name = jnp.dtype(model_dtype).name
    name = {"fp8": "fp8_e4m3"}.get(name, name)
    if name not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache_dtype: unknown {name!r}; choose one of auto, {', '.join(KV_CACHE_FORMATS)}")
    return KV_CACHE_FORMATS[name]


def choose_kv_cache_format(name: str, model_dtype, rounded_projections: bool = False) -> tuple[KVCacheFormat, str]:
    """The format `kv_cache_dtype` gives, and why (the engine's start-up line). "auto"
    is the model's dtype, as vLLM's auto, except for a float32 model whose projections
    round more than bfloat16 would (`rounded_projections`: kept in blocks of 32 that
    multiply quantized activations on the CPU, a GGUF's defaults there): bfloat16,
    halving the bytes decode attention reads at the memory's rate (docs/quantization.md
    measures both the speed and the logprobs)."""
    if name == "auto" and rounded_projections and jnp.dtype(model_dtype) == jnp.float32:
        return KV_CACHE_FORMATS["bfloat16"], "auto: the projections' blocks and activations round more"
    fmt = kv_cache_format(name, model_dtype)
    return fmt, "auto: the model's dtype" if name == "auto" else "as asked"


@struct.dataclass
class KVCache:
    k: Shaped[Array, "N B Hkv hd"]
    v: Shaped[Array, "N B Hkv hd"]
    k_scale: Float[Array, "N B Hkv"] | None = None  # scaled formats only
    v_scale: Float[Array, "N B Hkv"] | None = None
    k_layer_scale: Float[Array, " Hkv"] | None = None  # layer-scaled formats only (0: not calculated yet)
    v_layer_scale: Float[Array, " Hkv"] | None = None
    # The element type's name where k and v hold its bits ("": their own dtype).
    dtype: str = struct.field(pytree_node=False, default="")

    @property
    def format(self) -> KVCacheFormat:
        """The format of the elements these arrays hold."""
        dtype = jnp.dtype(self.dtype or self.k.dtype)
        fmt = next(f for f in KV_CACHE_FORMATS.values() if f.dtype == dtype)
        return dataclasses.replace(fmt, layer_scaled=self.k_layer_scale is not None)


def cache_shapes(fmt: KVCacheFormat, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, sharding: KVCache | None = None) -> tuple[KVCache, ...]:
    """The caches' jax.ShapeDtypeStructs (what compiling a step needs), stored as
    `fmt.storage_dtype()`; `sharding`: each array's (a KVCache of shardings)."""
    def at(name: str):
        return None if sharding is None else getattr(sharding, name)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = jax.ShapeDtypeStruct(shape, fmt.storage_dtype(), sharding=at("k"))
    scale = jax.ShapeDtypeStruct(shape[:3], jnp.float32, sharding=at("k_scale")) if fmt.scaled else None
    layer = jax.ShapeDtypeStruct(shape[2:3], jnp.float32, sharding=at("k_layer_scale")) if fmt.layer_scaled else None
    return tuple(KVCache(k, k, scale, scale, layer, layer, fmt.bits_of()) for _ in range(num_layers))


@functools.lru_cache(maxsize=32)
def _zeros(shape: tuple[int, ...], dtype, sharding):
    """A program filling an array of `shape` with zeros where `sharding` places it, one per
    kind of array: every layer's K (and V) is alike, so one compile serves them all, where a
    program per array compiled ~60 times an engine (~2-3 s of a start, on a 2-vCPU CPU).
    Bounded: a process that builds engine after engine (a notebook, a training loop's
    rollouts), each with a pool sized anew, does not keep every size's program."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def allocate_kv_caches(abstract: tuple[KVCache, ...]) -> tuple[KVCache, ...]:
    """Zero-filled caches of `cache_shapes`' shapes, each array filled where its
    sharding places it (none: the default device); per-layer arrays are donated one by one."""
    return tuple(jax.tree.map(lambda spec: _zeros(spec.shape, spec.dtype, spec.sharding)(), c) for c in abstract)


def as_elements(rows: Shaped[Array, "*r"], dtype: str = "") -> Shaped[Array, "*r"]:
    """Cache rows as their element type (`dtype`: KVCache.dtype; "": as they are)."""
    return rows if not dtype or rows.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(rows, jnp.dtype(dtype))


def quantize_rows(x: Float[Array, "T Hkv hd"], fmt: KVCacheFormat, layer_scale: Float[Array, " Hkv"] | None = None
                  ) -> tuple[Num[Array, "T Hkv hd"], Float[Array, "T Hkv"] | None]:
    """New K (or V) rows as the cache stores them: int8 with the scale max|x| / 127 per
    row (an all-zero row: scale 0), fp8 divided by `layer_scale` where given and
    saturated at +-448, others rounded to the dtype."""
    if layer_scale is not None:
        inv = jnp.where(layer_scale > 0, 1.0 / jnp.where(layer_scale > 0, layer_scale, 1.0), 1.0)
        x = x.astype(jnp.float32) * inv[:, None]
    if fmt.scaled:
        x = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
        inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
        q = jnp.clip(jnp.round(x * inv[..., None]), -INT8_MAX, INT8_MAX).astype(fmt.dtype)
        return q, scale
    if fmt.dtype == jnp.float8_e4m3fn:
        x = jnp.clip(x.astype(jnp.float32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.astype(fmt.dtype), None


def dequantize_rows(rows: Shaped[Array, "*r hd"], scale: Float[Array, "*r"] | None) -> Float[Array, "*r hd"]:
    """Stored rows back to float32 (times their scales, where the format has them)."""
    rows = rows.astype(jnp.float32)
    return rows if scale is None else rows * scale[..., None]


def write_kv_cache(
    cache: KVCache,
    k: Float[Array, "T Hkv hd"],
    v: Float[Array, "T Hkv hd"],
    slot_mapping: Int[Array, " T"],
) -> KVCache:
    """Scatter the new tokens' K/V (quantized as the cache's format stores them) into
    their slots (slot = block * block_size + offset)."""
    fmt = cache.format
    n, bs, hkv, hd = cache.k.shape

    def scatter(dst, src):
        if dst is None:
            return None
        if src.dtype != dst.dtype:  # the element type's bits
            src = jax.lax.bitcast_convert_type(src, dst.dtype)
        flat = dst.reshape(n * bs, *dst.shape[2:])
        slots = slot_mapping
        if slots.shape[0] == 1:  # a lone row as two, the second out of range and dropped: XLA makes a
            # one-row scatter a dynamic-update-slice, which copied whole cache arrays every such step
            slots = jnp.concatenate([slots, jnp.full((1,), n * bs, slots.dtype)])
            src = jnp.concatenate([src, src])
        return flat.at[slots].set(src, mode="drop").reshape(dst.shape)

    k_layer, v_layer = cache.k_layer_scale, cache.v_layer_scale
    if k_layer is not None:  # the first write of real tokens calculates them (slot 0: the null block's padding)
        real = (slot_mapping >= bs)[:, None, None]
        k_layer = _calculated(k_layer, k, real, K_SCALE_RANGE)
        v_layer = _calculated(v_layer, v, real, V_SCALE_RANGE)
    kq, ks = quantize_rows(k, fmt, k_layer)
    vq, vs = quantize_rows(v, fmt, v_layer)
    return KVCache(k=scatter(cache.k, kq), v=scatter(cache.v, vq), k_scale=scatter(cache.k_scale, ks),
                   v_scale=scatter(cache.v_scale, vs), k_layer_scale=k_layer, v_layer_scale=v_layer, dtype=cache.dtype)


def _calculated(scale: Float[Array, " Hkv"], x: Float[Array, "T Hkv hd"], real: Bool[Array, "T 1 1"],
                value_range: float) -> Float[Array, " Hkv"]:
    """`scale`, or where it is 0 (not calculated yet) max |x| of the real rows per KV
    head over `value_range` (still 0 if there are none)."""
    amax = jnp.max(jnp.where(real, jnp.abs(x.astype(jnp.float32)), 0.0), axis=(0, 2))
    return jnp.where(scale > 0, scale, amax / value_range)


def fold_layer_scales(q: Float[Array, "T H hd"], cache: KVCache) -> Float[Array, "T H hd"]:
    """The queries times their KV head's K scale (a layer-scaled cache; else as they are)."""
    if cache.k_layer_scale is None:
        return q
    return q * _per_query_head(cache.k_layer_scale, q.shape[1]).astype(q.dtype)[:, None]


def unfold_layer_scales(o: Float[Array, "T H hd"], cache: KVCache) -> Float[Array, "T H hd"]:
    """Attention outputs times their KV head's V scale (a layer-scaled cache)."""
    if cache.v_layer_scale is None:
        return o
    return o * _per_query_head(cache.v_layer_scale, o.shape[1]).astype(o.dtype)[:, None]


def _per_query_head(scale: Float[Array, " Hkv"], num_heads: int) -> Float[Array, " H"]:
    """A KV head's value for each query head (query head h reads KV head h // group)."""
    return jnp.repeat(scale, num_heads // scale.shape[0])


def copy_blocks(
    caches: tuple[KVCache, ...], src: Int[Array, " C"], dst: Int[Array, " C"]
) -> tuple[KVCache, ...]:
    """Copy whole blocks ``src[i]`` -> ``dst[i]`` in every layer, their rows' scales too
    (all reads before any write; padding pairs copy the null block onto itself); a
    layer's fp8 scales stay."""
    def blocks(a):
        return None if a is None else a.at[dst].set(a[src])

    return tuple(dataclasses.replace(c, k=blocks(c.k), v=blocks(c.v), k_scale=blocks(c.k_scale),
                                     v_scale=blocks(c.v_scale)) for c in caches)
