"""The KV cache's formats (kv_cache_dtype): the write's quantization, and the cpu and xla
attention backends reading bfloat16, float16, float8_e4m3fn and int8 (with its scales)
caches against the plain-softmax reference over the same cache dequantized; the cpu
kernel's decode, prefill and common-prefix paths each; the engine with an int8 cache
against float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.attention import cpu, xla
from jaxllm.attention.kv_cache import (
    FP8_E4M3_MAX,
    KV_CACHE_FORMATS,
    KVCache,
    allocate_kv_caches,
    as_elements,
    cache_shapes,
    copy_blocks,
    dequantize_rows,
    kv_cache_format,
    quantize_rows,
    write_kv_cache,
)
from jaxllm.config import KV_CACHE_DTYPES
from pallas_kernels import ragged_paged_attention_reference
from tests.support.attention import make_batch, shared_prefix_batch

FORMATS = ["bfloat16", "float16", "fp8_e4m3", "int8"]
# the default run reads bfloat16 and int8 through the backends; float16 and fp8 (the same
# paths, other conversions) with -m slow (the 15-minute budget)
READ_FORMATS = ["bfloat16", pytest.param("float16", marks=pytest.mark.slow),
                pytest.param("fp8_e4m3", marks=pytest.mark.slow), "int8"]
SEQS = [(1, 1), (1, 17), (1, 300), (70, 70), (1, 40), (45, 200), (2, 2), (64, 190)]


def quantized(args, fmt_name):
    """The batch's float32 caches stored in the format: (args with the stored caches,
    their scales, the reference's float32 view of what is stored)."""
    fmt = KV_CACHE_FORMATS[fmt_name]
    q, k, v, *rest = args
    (kq, ks), (vq, vs) = quantize_rows(k, fmt), quantize_rows(v, fmt)
    view = (q, dequantize_rows(kq, ks), dequantize_rows(vq, vs), *rest)
    return (q, kq, vq, *rest), dict(k_scale=ks, v_scale=vs), view


def test_quantize_rows():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 2, 64)).astype(np.float32) * np.array([1, 100, 1e-3, 0, 7])[:, None, None])
    q, s = quantize_rows(x, KV_CACHE_FORMATS["int8"])
    assert q.dtype == jnp.int8 and s.shape == (5, 2)
    back = np.asarray(dequantize_rows(q, s))
    assert (np.abs(back - np.asarray(x)) <= np.asarray(s)[..., None] / 2 * (1 + 1e-6)).all()  # half a step
    np.testing.assert_array_equal(np.abs(np.asarray(q)).max(axis=-1)[[0, 1, 2, 4]], 127)  # each row's max -> 127
    np.testing.assert_array_equal(np.asarray(s)[3], 0)  # an all-zero row
    np.testing.assert_array_equal(back[3], 0)
    f8, none = quantize_rows(jnp.asarray([[[1000.0, -1e6, 0.3, 448.0]]]), KV_CACHE_FORMATS["fp8_e4m3"])
    assert none is None
    np.testing.assert_array_equal(np.asarray(f8.astype(jnp.float32)), [[[FP8_E4M3_MAX, -FP8_E4M3_MAX, 0.3125, 448]]])
    b, _ = quantize_rows(x, KV_CACHE_FORMATS["bfloat16"])
    np.testing.assert_array_equal(np.asarray(b), np.asarray(x.astype(jnp.bfloat16)))


def test_format_names():
    assert kv_cache_format("auto", jnp.float32).name == "float32"
    assert kv_cache_format("auto", jnp.bfloat16).name == "bfloat16"
    assert kv_cache_format("fp8", jnp.float32).name == "fp8_e4m3"
    assert kv_cache_format("int8", jnp.float32).row_bytes(64) == 68
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown 'int4'"):
        kv_cache_format("int4", jnp.float32)
    assert {kv_cache_format(n, jnp.float32).name for n in KV_CACHE_DTYPES} == set(KV_CACHE_FORMATS)  # the CLI's names
    assert KV_CACHE_FORMATS["bfloat16"].storage_dtype("cpu") == jnp.uint16  # bits on the CPU (XLA:CPU's scatter)
    assert KV_CACHE_FORMATS["bfloat16"].storage_dtype("gpu") == jnp.bfloat16
    assert KV_CACHE_FORMATS["int8"].storage_dtype("cpu") == jnp.int8


def stored(cache: KVCache, which: str) -> np.ndarray:
    """A cache's K or V as float32 values (its elements, times their scales)."""
    rows = as_elements(getattr(cache, which), cache.dtype)
    return np.asarray(dequantize_rows(rows, getattr(cache, which + "_scale")))


def test_allocation_compiles_once_per_kind_of_array():
    """Every layer's K and V are alike, so allocating an engine's caches compiles one
    zero-filling program per kind of array (an int8 cache's values and its scales), not one
    per array (~60 compiles, 2-3 s of a start on a 2-vCPU CPU); each array is a buffer of
    its own, zero-filled (each layer's is donated on its own)."""
    compiles = []
    listener = lambda event, seconds, **kw: compiles.append(event == "/jax/core/compile/backend_compile_duration")
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        caches = allocate_kv_caches(cache_shapes(KV_CACHE_FORMATS["int8"], 6, 7, 8, 2, 16))  # shapes no other test has
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert sum(compiles) == 2
    arrays = [a for c in caches for a in (c.k, c.v, c.k_scale, c.v_scale)]
    assert len({a.unsafe_buffer_pointer() for a in arrays}) == len(arrays) == 24
    assert all(not np.asarray(a).any() for a in arrays)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_write_and_copy_blocks_keep_scales(fmt_name):
    """On the CPU 16- and 8-bit floats are stored as their bits (KVCache.dtype names
    them); the write quantizes, the copy moves scales with their rows."""
    fmt = KV_CACHE_FORMATS[fmt_name]
    (cache,) = allocate_kv_caches(cache_shapes(fmt, 1, 4, 8, 2, 16))
    assert cache.format == fmt and (cache.k.dtype != fmt.dtype) == (fmt.dtype.itemsize < 4 and fmt_name != "int8")
    k = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 16)).astype(np.float32))
    cache = jax.jit(write_kv_cache)(cache, k, -k, jnp.asarray([9, 10, 31]))
    want = np.asarray(dequantize_rows(*quantize_rows(k, fmt)))
    np.testing.assert_array_equal(stored(cache, "k").reshape(32, 2, 16)[[9, 10, 31]], want)
    np.testing.assert_array_equal(stored(cache, "v").reshape(32, 2, 16)[[9, 10, 31]], -want)
    (copied,) = jax.jit(copy_blocks)((cache,), jnp.asarray([1]), jnp.asarray([2]))
    assert copied.dtype == cache.dtype
    np.testing.assert_array_equal(stored(copied, "v")[2], stored(cache, "v")[1])


@pytest.mark.parametrize("fmt_name", READ_FORMATS)
@pytest.mark.parametrize("heads", [(2, 3, 64), pytest.param((1, 8, 128), marks=pytest.mark.slow),
                                   pytest.param((4, 1, 16), marks=pytest.mark.slow)],
                         ids=lambda h: f"hkv{h[0]}-g{h[1]}-d{h[2]}")
def test_cpu_and_xla_read_each_format(fmt_name, heads):
    """Both backends attend over what the cache stores: the reference over the same
    cache dequantized (decodes take the kernel's decode path, long prefill chunks its
    prefill path)."""
    hkv, group, head_dim = heads
    rng = np.random.default_rng(head_dim + group)
    args, valid = make_batch(rng, SEQS, block_size=16, num_kv_heads=hkv, group=group, head_dim=head_dim)
    stored, scales, view = quantized(args, fmt_name)
    want = np.asarray(ragged_paged_attention_reference(*view, sm_scale=0.3))[:valid]
    fmt = KV_CACHE_FORMATS[fmt_name]
    scales = scales if fmt.scaled else {}
    bits = tuple(jax.lax.bitcast_convert_type(a, fmt.storage_dtype("cpu")) for a in stored[1:3])  # as the engine keeps them
    for fn in (cpu.ragged_paged_attention_cpu, xla.ragged_paged_attention_xla):
        got = np.asarray(jax.jit(lambda *a, fn=fn: fn(*a, sm_scale=0.3, **scales))(*stored))
        np.testing.assert_allclose(got[:valid], want, atol=3e-5, rtol=0, err_msg=fn.__name__)
        if bits[0].dtype != fmt.dtype:
            got = jax.jit(lambda *a, fn=fn: fn(*a, sm_scale=0.3, cache_dtype=fmt.dtype.name))(
                stored[0], *bits, *stored[3:])
            np.testing.assert_allclose(np.asarray(got)[:valid], want, atol=3e-5, rtol=0, err_msg=fn.__name__)


@pytest.mark.parametrize("fmt_name", [pytest.param("bfloat16", marks=pytest.mark.slow), "int8"])
def test_cpu_common_prefix_pass_reads_each_format(fmt_name):
    prefix_blocks, block_size = 8, 16
    p = prefix_blocks * block_size
    seqs = [(1, p + 1), (1, p + 40), (20, p + 20), (1, p + 130), (45, p + 100)]
    args, valid = shared_prefix_batch(np.random.default_rng(5), prefix_blocks, seqs, block_size=block_size,
                                      num_kv_heads=2, group=3, head_dim=64)
    stored, scales, view = quantized(args, fmt_name)
    scales = scales if KV_CACHE_FORMATS[fmt_name].scaled else {}
    got = jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, sm_scale=0.2, common_prefix_blocks=jnp.int32(prefix_blocks),
                                                            **scales))(*stored)
    want = ragged_paged_attention_reference(*view, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(got)[:valid], np.asarray(want)[:valid], atol=3e-5, rtol=0)


def test_int8_cache_is_close_to_float32():
    """The quantization error, end to end through attention: an int8 cache's output
    within 2% of the output's scale of float32's (bfloat16: 1%)."""
    args, valid = make_batch(np.random.default_rng(7), SEQS, block_size=16, num_kv_heads=2, group=3, head_dim=64)
    exact = np.asarray(cpu.ragged_paged_attention_cpu(*args, sm_scale=0.125))[:valid]
    for fmt_name, bound in (("int8", 0.02), ("bfloat16", 0.01)):
        stored, scales, _ = quantized(args, fmt_name)
        scales = scales if KV_CACHE_FORMATS[fmt_name].scaled else {}
        got = np.asarray(cpu.ragged_paged_attention_cpu(*stored, sm_scale=0.125, **scales))[:valid]
        assert np.abs(got - exact).max() < bound * np.abs(exact).max(), fmt_name


def test_cpu_backend_refuses_missing_scales():
    args, _ = make_batch(np.random.default_rng(2), [(1, 5)], block_size=16, num_kv_heads=1, group=2, head_dim=32)
    stored, _, _ = quantized(args, "int8")
    with pytest.raises(ValueError, match="scales with an int8 cache"):
        cpu.ragged_paged_attention_cpu(*stored, sm_scale=0.3)


@pytest.mark.parametrize("fmt_name", ["bfloat16", "float16", "fp8_e4m3"])
def test_cpu_kernel_widens_every_value_exactly(fmt_name):
    """One key per sequence: the output is its value row, so every finite value of the
    type the kernel widens shows up as it is: float16's and e4m3's subnormals (built
    from integers, or by F16C, since XLA's threads flush denormal floats), signs, the
    largest values; through the cache's bits."""
    fmt = KV_CACHE_FORMATS[fmt_name]
    bits = np.arange(2 ** (8 * fmt.dtype.itemsize), dtype=fmt.storage_dtype("cpu"))
    values = bits.view(fmt.dtype).astype(np.float32)
    bits = bits[np.isfinite(values)]  # no inf or nan rows: every finite value of the type
    d = 64
    rows = -(-len(bits) // d)
    v = np.zeros(rows * d, bits.dtype)
    v[: len(bits)] = bits
    v = v.reshape(rows, 1, 1, d)  # one block of one token per sequence, one KV head
    q = jnp.zeros((rows, 1, d), jnp.float32)
    ones = np.ones(rows, np.int32)
    args = (q, jnp.asarray(v), jnp.asarray(v), jnp.asarray(ones), jnp.arange(rows, dtype=jnp.int32)[:, None],
            jnp.arange(rows + 1, dtype=jnp.int32), jnp.int32(rows))
    got = np.asarray(jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, sm_scale=1.0, cache_dtype=fmt.dtype.name))(
        *args)).reshape(-1)[: len(bits)]
    want = bits.view(fmt.dtype).astype(np.float32)
    # bfloat16's subnormals are float32's: float32 arithmetic on XLA's threads flushes
    # them (as XLA's own ops do); float16's and e4m3's are normal float32 numbers.
    want = np.where(np.abs(want) < np.finfo(np.float32).tiny, 0.0, want) if fmt_name == "bfloat16" else want
    np.testing.assert_array_equal(got, want)


def test_fp8_layer_scales_are_calculated_once_from_real_rows():
    """A layer-scaled fp8 cache (calculate_kv_scales): the first write with real rows
    sets each KV head's scale to that step's max |K| / 200 (|V| / 100), the null block's
    padding rows left out; later writes keep it and store x / scale; block copies leave
    the scales alone."""
    fmt = dataclasses.replace(KV_CACHE_FORMATS["fp8_e4m3"], layer_scaled=True)
    (cache,) = allocate_kv_caches(cache_shapes(fmt, 1, 4, 8, 2, 16))
    assert cache.format == fmt and cache.k_layer_scale.shape == (2,)
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((4, 2, 16)).astype(np.float32) * np.array([1.0, 30.0])[:, None])
    k = k.at[3].set(1e4)  # a padding row, written into the null block (slot 0): not counted
    write = jax.jit(write_kv_cache)
    cache = write(cache, k, 2 * k, jnp.asarray([9, 10, 31, 0]))
    amax = np.abs(np.asarray(k[:3])).max(axis=(0, 2))
    np.testing.assert_allclose(np.asarray(cache.k_layer_scale), amax / 200, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cache.v_layer_scale), 2 * amax / 100, rtol=1e-6)
    later = write(cache, 5 * k, k, jnp.asarray([11, 12, 13, 0]))
    np.testing.assert_array_equal(np.asarray(later.k_layer_scale), np.asarray(cache.k_layer_scale))
    elements = np.asarray(as_elements(later.k, later.dtype).astype(jnp.float32)).reshape(32, 2, 16)
    want = np.clip(np.asarray(5 * k[:3]) / np.asarray(cache.k_layer_scale)[:, None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    np.testing.assert_array_equal(elements[[11, 12, 13]], np.asarray(jnp.asarray(want).astype(jnp.float8_e4m3fn)
                                                                      .astype(jnp.float32)))
    (copied,) = jax.jit(copy_blocks)((later,), jnp.asarray([1]), jnp.asarray([2]))
    np.testing.assert_array_equal(np.asarray(copied.v_layer_scale), np.asarray(later.v_layer_scale))


def test_fp8_layer_scales_fold_around_every_backend():
    """Attention over a layer-scaled fp8 cache (queries times K's scale, output times
    V's, the backend reading the stored elements) equals the reference over the cache
    dequantized (elements times the scales), for GQA heads with different scales."""
    from jaxllm.attention.kv_cache import fold_layer_scales, unfold_layer_scales

    hkv, group = 2, 3
    args, valid = make_batch(np.random.default_rng(9), SEQS, block_size=16, num_kv_heads=hkv, group=group, head_dim=64)
    q, k, v, *rest = args
    k, v = k * jnp.asarray([500.0, 0.01])[:, None], v * jnp.asarray([3.0, 900.0])[:, None]  # past fp8's range, and tiny
    ks, vs = jnp.abs(k).max(axis=(0, 1, 3)) / 200, jnp.abs(v).max(axis=(0, 1, 3)) / 100
    fmt = KV_CACHE_FORMATS["fp8_e4m3"]
    kq, _ = quantize_rows(k.reshape(-1, hkv, 64), fmt, ks)
    vq, _ = quantize_rows(v.reshape(-1, hkv, 64), fmt, vs)
    kq, vq = kq.reshape(k.shape), vq.reshape(v.shape)
    view = (q, kq.astype(jnp.float32) * ks[:, None], vq.astype(jnp.float32) * vs[:, None], *rest)
    want = np.asarray(ragged_paged_attention_reference(*view, sm_scale=0.125))[:valid]
    cache = KVCache(kq, vq, k_layer_scale=ks, v_layer_scale=vs)
    for fn in (cpu.ragged_paged_attention_cpu, xla.ragged_paged_attention_xla):
        o = fn(fold_layer_scales(q, cache), kq, vq, *rest, sm_scale=0.125)
        got = np.asarray(unfold_layer_scales(o, cache))[:valid]
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0, err_msg=fn.__name__)
    unscaled = np.asarray(ragged_paged_attention_reference(q, *(quantize_rows(a.reshape(-1, hkv, 64), fmt)[0]
                                                                .reshape(a.shape).astype(jnp.float32) for a in (k, v)),
                                                           *rest, sm_scale=0.125))[:valid]
    exact = np.asarray(ragged_paged_attention_reference(*args[:1], k, v, *rest, sm_scale=0.125))[:valid]
    assert np.abs(got - exact).max() < 0.2 * np.abs(unscaled - exact).max()  # saturation and subnormals avoided
