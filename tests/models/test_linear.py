"""The `cpu` linear backend: the packed-weight dense kernel (jaxllm/cpu_kernels/dense.cc)
against float64 numpy over row counts around its 12-row tiles and 96-row blocks, widths
that are not whole 32-column panels, and odd depths; packing and unpacking, abstract
params included; the model forward with packed weights against the plain one; how the
backend is chosen; and the engine's greedy tokens with either backend."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import SamplingParams, cpu_kernels
from jaxllm.loaders import load_model
from jaxllm.models import linear as linear_mod
from jaxllm.models.formats import GATED_MIN_ROWS, Panels
from jaxllm.models.linear import linear, linear_candidates, pack_params, pack_weight, packed_rows, unpack_weight
from jaxllm.models.llama import compute_logits
from jaxllm.models.moe import gated
from jaxllm.models.params import QUANT_FORMATS, PackedWeight, abstract_params
from jaxllm.models.quant import dequantize, quantize_blocks, quantize_grouped, quantize_weight
from tests.support.llm import assert_no_leaks, make_llm
from tests.support.paged_driver import PagedDriver


@pytest.mark.parametrize(
    "m,k,n",
    [(1, 64, 32), (11, 576, 960), (12, 64, 64), (13, 64, 40), (64, 576, 576), (96, 33, 96), (97, 1536, 576),
     (200, 576, 3072), (5, 7, 5), (300, 16, 33)],
)
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "int8_g32", "q8_0", "q4_0", "q4_1"])
def test_dense_kernel_matches_numpy(m, k, n, weights):
    """float32 panels, bfloat16 ones (x rounded to bfloat16, float32 sums: vdpbf16ps
    where the build has AVX512_BF16, float32 lanes elsewhere), and quantized ones
    (jaxllm.models.quant: int8 with scales per column; GGUF's Q8_0, Q4_0 and Q4_1 blocks
    of 32 inputs) against their dequantized matrix; the block formats give the very
    sums of that matrix packed as floats, and in a bfloat16 model (`float_dtype`) those
    of that matrix rounded to bfloat16 and packed as bfloat16 pairs."""
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if weights == "bfloat16":
        w = np.asarray(jnp.asarray(w, jnp.bfloat16))
        packed = pack_weight(jnp.asarray(w))
        assert packed.panels.shape == (-(-n // 32), -(-k // 2), 32, 2) and packed.in_features == k + k % 2
        np.testing.assert_array_equal(np.asarray(unpack_weight(packed))[:k], w)
        got = np.asarray(jax.jit(linear)(jnp.asarray(x), packed))
        ref = np.asarray(jnp.asarray(x, jnp.bfloat16)).astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
        return
    fmt = QUANT_FORMATS.get(weights)
    if fmt is not None and fmt.group and k % fmt.group:  # such a matrix is refused, naming why
        with pytest.raises(ValueError, match=f"has {k} inputs, not a multiple of {fmt.group}"):
            quantize_weight(w, weights)
        return
    if fmt is not None:
        quantized = quantize_weight(w, weights)
        w = np.asarray(dequantize(quantized))
        packed = pack_weight(quantized)
        assert packed.panels.dtype == (jnp.uint8 if fmt.bits == 4 else jnp.int8)
        assert packed.panels.shape == (-(-n // 32), k, 32 * fmt.bits // 8)
        assert packed.scale.shape == ((packed.panels.shape[0] * 32,) if weights == "int8" else
                                      (packed.panels.shape[0], k // fmt.group, 32))
        assert (packed.mins is not None) == fmt.mins
        np.testing.assert_array_equal(np.asarray(unpack_weight(packed)), w)
    else:
        packed = pack_weight(jnp.asarray(w))
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), packed))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, ref, rtol=0, atol=(2e-6 if weights == "float32" else 4e-6) * np.abs(ref).max())
    if fmt is not None and fmt.group:  # each weight as dequantized at load: the float panels' very sums
        np.testing.assert_array_equal(got, np.asarray(jax.jit(linear)(jnp.asarray(x), pack_weight(jnp.asarray(w)))))
        # in a bfloat16 model: the sums of those weights rounded to bfloat16, packed as bfloat16 pairs
        in_bf16 = pack_weight(quantized.replace(float_dtype="bfloat16"))
        w16 = jnp.asarray(w, jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(unpack_weight(in_bf16)), np.asarray(w16))
        np.testing.assert_array_equal(np.asarray(jax.jit(linear)(jnp.asarray(x), in_bf16)),
                                      np.asarray(jax.jit(linear)(jnp.asarray(x), pack_weight(w16))))


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "q8_0", "q4_1", "q4_1+a8", "q8_0+a8"])
def test_a_row_count_leaves_the_padding_rows_zero(weights):
    """`rows` (a step's real tokens): the first rows are the very sums of the call over
    every row, the bucket's padding rows after them zeros; 0 and M rows too, in one
    jitted function (the count is an array, not a shape)."""
    rng = np.random.default_rng(7)
    m, k, n = 30, 64, 70
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    fmt, _, acts = weights.partition("+")
    if fmt in ("float32", "bfloat16"):
        packed = pack_weight(jnp.asarray(w, fmt))
    else:
        q = quantize_weight(w, fmt)
        packed = pack_weight(q.replace(activations="int8") if acts else q)
    full = np.asarray(jax.jit(linear)(x, packed))
    with_rows = jax.jit(lambda x, w, r: linear(x, w, rows=r))
    for r in (0, 1, 13, m):
        got = np.asarray(with_rows(x, packed, jnp.int32(r)))
        np.testing.assert_array_equal(got[:r], full[:r])
        assert not got[r:].any()


def _pair_order_sums(x16: np.ndarray, w16: np.ndarray) -> np.ndarray:
    """x [M, K] @ w [K, N] (bfloat16 values, as float32) summed as the kernel's bfloat16
    tiles sum: input by input in float32, each pair's odd input first (vdpbf16ps's
    order; every product of two bfloat16 values is exact in float32)."""
    k = x16.shape[1]
    acc = np.zeros((x16.shape[0], w16.shape[1]), np.float32)
    for j in range(0, k, 2):
        for i in (j + 1, j):
            if i < k:
                acc = (acc + np.outer(x16[:, i], w16[i])).astype(np.float32)
    return acc


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 33, 40), (12, 96, 64), (30, 128, 96), (100, 65, 33)])
@pytest.mark.parametrize("weights", ["bfloat16", "q4_1", "q8_0"])
def test_both_bfloat16_paths_give_the_same_sums(m, k, n, weights):
    """bfloat16 sums (plain bfloat16 panels, or a bfloat16 model's quantized ones) by
    vdpbf16ps (`bf16_tiles` dot, where the build has AVX512_BF16) and by the float tiles are
    the same sums bit for bit: those of an exact float32 oracle that adds the products
    in vdpbf16ps's order. One tile (in registers), several (the panel converted once),
    odd depths (a zero pair partner), widths that are not whole panels."""
    rng = np.random.default_rng(m * 100 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if weights == "bfloat16":
        packed = pack_weight(jnp.asarray(w, jnp.bfloat16))
        w16 = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
    else:  # whole blocks of 32 inputs
        k = -(-k // 32) * 32
        x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        quantized = quantize_blocks(w, QUANT_FORMATS[weights]).replace(float_dtype="bfloat16")
        packed = pack_weight(quantized)
        w16 = np.asarray(dequantize(quantized).astype(jnp.bfloat16).astype(jnp.float32))
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    want = _pair_order_sums(x16, w16)
    for tiles in ("dot", "float"):
        got = np.asarray(jax.jit(linear)(jnp.asarray(x), packed.replace(bf16_tiles=tiles)))
        np.testing.assert_array_equal(got, want, err_msg=f"bf16_tiles={tiles}")


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (16, 576, 96), (17, 33, 40), (32, 96, 64), (45, 1536, 33),
                                   (48, 96, 709), (100, 65, 200), (200, 576, 3072), (530, 96, 64)])
@pytest.mark.parametrize("weights", ["bfloat16", "q4_1", "q8_0", "gguf_int8"])
def test_amx_tiles_sum_the_bfloat16_products(m, k, n, weights):
    """AMX's tiles (`bf16_tiles` amx, where the CPU has them) multiply the same bfloat16
    values as vdpbf16ps and sum them in float32 in the tile unit's order: within float32
    rounding of the exact sums (float64 of the bfloat16 values), and of vdpbf16ps's.
    Rows around the 16-row tiles and pairs of them and past an item's block of rows (512),
    odd depths and depths that are not whole 32-input steps (zeros past K; a kept panel of
    16-input groups ends mid-step), widths that are not whole panels, and from three tiles
    items of several panels (23 panels: groups of 3 on two threads, the last of 2, its
    last panel 5 columns). A kept panel's item of at most 32 rows converts it a step at a
    time, a larger one all at once: the same pairs."""
    if not cpu_kernels.has_amx():  # the kernels build for every other test here
        pytest.skip("this CPU (or its OS) has no AMX")
    rng = np.random.default_rng(m * 100 + k)
    if weights != "bfloat16":
        group = QUANT_FORMATS[weights].group
        k = -(-k // group) * group
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if weights == "bfloat16":
        packed = pack_weight(jnp.asarray(w, jnp.bfloat16))
        w16 = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
    else:
        quantize = quantize_grouped if weights == "gguf_int8" else quantize_blocks  # its 16-input groups
        quantized = quantize(w, QUANT_FORMATS[weights]).replace(float_dtype="bfloat16")
        packed = pack_weight(quantized)
        w16 = np.asarray(dequantize(quantized).astype(jnp.bfloat16).astype(jnp.float32))
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    exact = x16.astype(np.float64) @ w16.astype(np.float64)
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), packed.replace(bf16_tiles="amx")))
    dot = np.asarray(jax.jit(linear)(jnp.asarray(x), packed.replace(bf16_tiles="dot")))
    bound = 2e-6 * np.sqrt(k) * np.abs(x16) @ np.abs(w16) + 1e-30  # float32 sums of k products
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)
    np.testing.assert_allclose(got, dot, rtol=0, atol=4e-6 * np.abs(exact).max())


@pytest.mark.parametrize("m", [1, 17, 32, 100])
@pytest.mark.parametrize("weights", ["q4_1", "q4_0", "q8_0", "int4", "gguf_int8"])
def test_kept_blocks_on_amx_sum_their_bfloat16_values_as_plain_panels(m, weights):
    """A bfloat16 model's kept blocks on AMX (each step of 32 inputs converted to bfloat16
    pairs as it is multiplied, or the whole panel first at more than two tiles of rows;
    4-bit and int8 blocks by interleaving two inputs' bytes before widening) give, bit for
    bit, the sums of plain bfloat16 panels holding the same values (dequantized, rounded to
    bfloat16): the same pairs in the same tile order."""
    if not cpu_kernels.has_amx():
        pytest.skip("this CPU (or its OS) has no AMX")
    rng = np.random.default_rng(m)
    k, n = 256, 96
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if weights == "int4":
        quantized = quantize_weight(w, "int4")
    else:
        quantize = quantize_grouped if weights == "gguf_int8" else quantize_blocks
        quantized = quantize(w, QUANT_FORMATS[weights])
    quantized = quantized.replace(float_dtype="bfloat16")
    kept = pack_weight(quantized).replace(bf16_tiles="amx")
    plain = pack_weight(dequantize(quantized).astype(jnp.bfloat16)).replace(bf16_tiles="amx")
    for rows in (None, jnp.int32(m)):
        got = np.asarray(jax.jit(lambda a, r, w=kept: linear(a, w, rows=r))(x, rows))
        want = np.asarray(jax.jit(lambda a, r, w=plain: linear(a, w, rows=r))(x, rows))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("m,rows,f", [(64, 64, 64), (100, 77, 64), (530, 530, 64), (16, 9, 64), (200, 190, 1600)])
@pytest.mark.parametrize("weights", ["bfloat16", "q4_1"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_gate_up_projection_applies_the_activation(m, rows, f, weights, act):
    """A gated MLP's [gate | up] panels giving act(gate) * up themselves (formats.Panels.
    gated_matmul: each item a gate panel and its up panel on AMX's tiles): the same sums as
    the plain projection, then the activation (a few ulps: exp and the reciprocal computed
    otherwise than XLA's), padding rows zeros. Items of one or two tiles (converted a step
    at a time), and from three tiles blocks of up to 512 rows times groups of gate panels,
    each with its up panel (50 of them: groups of 8 on two threads, 4 on four, the last
    of 2); the other tiles (vdpbf16ps) in items of a gate panel and its up panel too, the
    same sums."""
    if not cpu_kernels.has_amx():
        pytest.skip("this CPU (or its OS) has no AMX")
    rng = np.random.default_rng(m + rows)
    k = 96
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, 2 * f)) / 4).astype(np.float32)
    if weights == "bfloat16":
        packed = pack_weight(jnp.asarray(w, jnp.bfloat16))
    else:
        packed = pack_weight(quantize_blocks(w, QUANT_FORMATS["q4_1"]).replace(float_dtype="bfloat16"))
    packed = packed.replace(bf16_tiles="amx")
    n = jnp.int32(rows)
    plain = np.asarray(jax.jit(lambda a, r: gated(linear(a, packed, rows=r), act))(x, n))
    for tiles in ("amx", "dot"):
        fused = packed.replace(bf16_tiles=tiles)
        got = np.asarray(jax.jit(lambda a, r, w=fused: Panels.gated_matmul(a, w, act, r))(x, n))
        assert got.shape == (m, f)
        np.testing.assert_allclose(got[:rows], plain[:rows], rtol=2e-6, atol=2e-6 * np.abs(plain).max())
        np.testing.assert_array_equal(got[rows:], 0)
    assert Panels.gates(packed, GATED_MIN_ROWS) and not Panels.gates(packed, GATED_MIN_ROWS - 1)
    assert not Panels.gates(packed.replace(bf16_tiles="dot"), GATED_MIN_ROWS)


@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "q4_1", "q4_1+a8", "q8_0 experts", "q4_1+a8 experts"])
def test_float16_scales_give_the_sums_of_float32_ones(weights):
    """GGUF's blocks hold the file's float16 scales (and mins: QuantFormat.scale_dtype),
    half the bytes of float32 ones; the kernels widen them exactly (a group's in
    registers, or a panel's into a buffer), so the same scales passed as float32 give
    the very same sums: dense at one tile (1 and 12 rows) and several (30), with int8
    activations, over experts. Scales of another dtype, or mins of another dtype than
    the scales, are refused naming what is accepted."""
    from jaxllm.models.linear import grouped_linear
    from jaxllm.models.params import stack_experts

    name, _, experts = weights.partition(" ")
    name, _, a8 = name.partition("+")
    fmt, rng = QUANT_FORMATS[name], np.random.default_rng(7)
    k, n = 128, 70
    one = lambda: quantize_blocks(rng.standard_normal((k, n)).astype(np.float32), fmt)
    q = stack_experts([one() for _ in range(3)]) if experts else one()
    assert q.scale.dtype == np.float16 and (q.mins is None or q.mins.dtype == np.float16)
    q = q.map_arrays(jnp.asarray).replace(activations="int8" if a8 else "float")
    widened = q.map_arrays(lambda a: a.astype(jnp.float32) if a.dtype == jnp.float16 else a)
    half, full = pack_weight(q), pack_weight(widened)
    assert half.scale.dtype == jnp.float16 and full.scale.dtype == jnp.float32
    assert half.scale.nbytes * 2 == full.scale.nbytes
    floats = pack_weight(dequantize(q))
    for m in (1, 12, 30):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        if experts:
            sizes = jnp.asarray([m // 3, 0, m - m // 3], jnp.int32)
            call = lambda w, x=x, sizes=sizes: np.asarray(jax.jit(grouped_linear)(x, w, sizes))
        else:
            call = lambda w, x=x: np.asarray(jax.jit(linear)(x, w))
        got = call(half)
        np.testing.assert_array_equal(got, call(full))
        if not a8:  # and the sums of the dequantized matrix packed as floats
            np.testing.assert_array_equal(got, call(floats))
    if experts:
        return
    with pytest.raises(Exception, match="must be float32 or float16"):
        call(half.replace(scale=half.scale.astype(jnp.bfloat16)))
    if half.mins is not None:
        with pytest.raises(Exception, match="mins of the scales' type"):
            call(half.replace(mins=half.mins.astype(jnp.float32)))


def test_dense_kernel_keeps_leading_dims_and_a_second_call_with_fewer_rows():
    """The packed copy of x is reused between calls: a smaller call after a larger one
    must not read the larger one's rows."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 70)).astype(np.float32)
    packed = pack_weight(jnp.asarray(w))
    big = rng.standard_normal((150, 48)).astype(np.float32)
    small = rng.standard_normal((2, 3, 48)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(big), packed)), big @ w, rtol=1e-5, atol=1e-4)
    got = np.asarray(linear(jnp.asarray(small), packed))
    assert got.shape == (2, 3, 70)
    np.testing.assert_allclose(got, small @ w, rtol=1e-5, atol=1e-4)


def test_pack_and_unpack():
    w = jnp.arange(5 * 70, dtype=jnp.float32).reshape(5, 70)
    packed = pack_weight(w)
    assert packed.panels.shape == (3, 5, 32) and packed.out_features == 70 and packed.in_features == 5
    np.testing.assert_array_equal(packed.panels[1, 2], w[2, 32:64])
    np.testing.assert_array_equal(packed.panels[2, :, 6:], 0)  # the last panel's padding
    np.testing.assert_array_equal(unpack_weight(packed), w)
    abstract = pack_weight(jax.ShapeDtypeStruct((5, 70), jnp.float32))
    assert abstract.panels.shape == (3, 5, 32) and abstract.out_features == 70


def test_pack_and_unpack_bfloat16_pairs():
    """bfloat16 packs inputs in pairs, [N/32, K/2, 32, 2]: an odd K gets a zero row."""
    w = jnp.arange(5 * 70, dtype=jnp.float32).reshape(5, 70).astype(jnp.bfloat16)
    packed = pack_weight(w)
    assert packed.panels.shape == (3, 3, 32, 2) and packed.panels.dtype == jnp.bfloat16
    assert packed.in_features == 6 and packed.out_features == 70
    np.testing.assert_array_equal(packed.panels[1, 1, :, 0], w[2, 32:64])  # inputs 2 and 3 of columns 32..63
    np.testing.assert_array_equal(packed.panels[1, 1, :, 1], w[3, 32:64])
    np.testing.assert_array_equal(packed.panels[:, 2, :, 1], 0)  # the odd K's padding row
    np.testing.assert_array_equal(packed.panels[2, :, 6:], 0)  # the last panel's padding
    unpacked = unpack_weight(packed)
    np.testing.assert_array_equal(unpacked[:5], w)
    np.testing.assert_array_equal(unpacked[5], 0)
    abstract = pack_weight(jax.ShapeDtypeStruct((5, 70), jnp.bfloat16))
    assert abstract.panels.shape == (3, 3, 32, 2) and abstract.panels.dtype == jnp.bfloat16


def test_pack_params_of_a_tied_model_and_of_abstract_params(test_models_dir):
    """A tied output projection is packed in the embedding's place (one copy of the
    table), and the lookups read it."""
    model = load_model(test_models_dir / "llama", dtype="float32")
    assert model.params.lm_head is None  # the test model ties its output projection to embed
    packed = pack_params(model.params)
    assert packed.lm_head is None and isinstance(packed.embed, PackedWeight)
    assert isinstance(packed.layers[0].w_down, PackedWeight)
    np.testing.assert_array_equal(unpack_weight(packed.embed), model.params.embed.T)
    ids = jnp.asarray([0, 5, 31, 32, 33, model.config.vocab_size - 1])
    np.testing.assert_array_equal(packed_rows(packed.embed, ids), model.params.embed[ids])
    for a, b in zip(model.params.layers, packed.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            np.testing.assert_array_equal(unpack_weight(getattr(b, name)), getattr(a, name))
    h = jax.random.normal(jax.random.key(0), (7, model.config.hidden_size))
    np.testing.assert_allclose(compute_logits(packed, h, model.config), compute_logits(model.params, h, model.config),
                               rtol=0, atol=1e-5)
    # a step's sample rows padded to its bucket: the real ones' very logits, zeros after (one compile for any count)
    logits_of = jax.jit(lambda p, h, r: compute_logits(p, h, model.config, rows=r))
    full = np.asarray(compute_logits(packed, h, model.config))
    for r in (0, 3, 7):
        got = np.asarray(logits_of(packed, h, jnp.int32(r)))
        np.testing.assert_array_equal(got[:r], full[:r])
        assert not got[r:].any()
    spec = lambda tree: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)
    assert spec(pack_params(abstract_params(model.config, jnp.float32))) == spec(packed)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q8_0", "q4_0", "q4_1", "int4_g32", "q8_0+a8", "q4_1+a8",
                                 "q4_0+a8"])
def test_a_table_looked_up_from_its_packed_transpose(fmt):
    """packed_rows: rows of a [V, D] embedding from the panels of its packed [D, V]
    transpose, in every layout a tied head is packed in (float32 panels, bfloat16 pairs,
    int8 / 4-bit block panels, the int8-activation dot layouts), are the very values the
    table's own lookup gives (a quantized table's rows dequantized; both jitted, as in the
    step: XLA may fuse int4's float32 d * q + m into one multiply-add either way)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((200, 96)).astype(np.float32)
    ids = jnp.asarray([0, 1, 15, 16, 17, 31, 32, 100, 199])
    weights, _, acts = fmt.partition("+")
    if weights in ("float32", "bfloat16"):
        embed = jnp.asarray(table, weights)
        head, want = pack_weight(embed.T), embed[ids]
    else:
        embed = quantize_weight(table.T, weights).transposed().map_arrays(jnp.asarray)  # grouped along D
        embed = embed.replace(activations="int8" if acts else "float")
        head, want = pack_weight(embed.transposed()), jax.jit(lambda e, i: dequantize(e.take_rows(i)))(embed, ids)
    assert head.activations == ("int8" if acts else "float")
    got = jax.jit(packed_rows)(head, ids)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("arch,dtype", [pytest.param("llama", "float32", marks=pytest.mark.slow), ("qwen2", "float32"),
                                        ("llama", "bfloat16")])
def test_forward_with_packed_weights_matches_plain(test_models_dir, arch, dtype):
    """The forward with packed weights against XLA's dot on the same weights (bfloat16:
    both round each projection's input to bfloat16 and sum in float32, in different
    orders: a last-bit difference that flips one rounding of a later layer's bfloat16
    input grows to a few percent of one element; 0.0025 of the logits' scale seen on an
    Intel Xeon with AVX512_BF16, 2026-11-30)."""
    model = load_model(test_models_dir / arch, dtype=dtype)
    ids = list(range(3, 40))
    plain = PagedDriver(model.config, model.params, block_size=8).prompt_logits(ids, [9, len(ids) - 9])
    packed = PagedDriver(model.config, pack_params(model.params), block_size=8).prompt_logits(ids, [9, len(ids) - 9])
    np.testing.assert_allclose(packed, plain, rtol=0, atol=(1e-5 if dtype == "float32" else 4e-3) * np.abs(plain).max())
    if dtype == "bfloat16":  # a wrong panel would move many: the typical difference stays at rounding's
        assert np.abs(packed - plain).mean() < 2e-4 * np.abs(plain).max()


def test_linear_candidates(caplog):
    """auto on a CPU for float32 and bfloat16 weights: the kernel and XLA's dot,
    measured by the runner per step shape (whatever width the kernel was built for);
    an explicit name: itself."""
    assert linear_candidates("auto", jnp.float32) == ["cpu", "xla"]
    assert linear_candidates("auto", jnp.bfloat16) == ["cpu", "xla"]
    assert linear_candidates("cpu", jnp.float32) == ["cpu"]
    assert linear_candidates("xla", jnp.float32) == ["xla"]
    with caplog.at_level(logging.WARNING, logger="jaxllm.models.linear"):
        assert linear_candidates("auto", jnp.float16) == ["xla"]
    assert "needs float32 or bfloat16 weights" in caplog.text
    with pytest.raises(ValueError, match="linear_backend 'cpu': it needs float32 or bfloat16 weights"):
        linear_candidates("cpu", jnp.float16)
    with pytest.raises(ValueError, match="linear_backend: unknown 'onednn'"):
        linear_candidates("onednn", jnp.float32)


def test_auto_falls_back_to_xla_when_the_kernels_cannot_build(monkeypatch, caplog):
    import jaxllm.cpu_kernels

    def no_build():
        raise jaxllm.cpu_kernels.KernelBuildError("no C++ compiler found")

    monkeypatch.setattr(jaxllm.cpu_kernels, "load_kernels", no_build)
    with caplog.at_level(logging.WARNING, logger=linear_mod.__name__):
        assert linear_candidates("auto", jnp.float32) == ["xla"]
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ValueError, match="no C\\+\\+ compiler found"):
        linear_candidates("cpu", jnp.float32)


# the 15-minute budget: by default test_autotune's mixed plan (cpu kernels for small steps) equals all-xla
@pytest.mark.slow
def test_engine_gives_the_same_tokens_with_either_linear_backend(test_models_dir):
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, k)] for k in (5, 40, 90)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    results = {}
    for backend in ("xla", "cpu"):
        llm = make_llm(test_models_dir, linear_backend=backend)
        runner = llm.llm_engine.core.runner
        assert runner.plan.backends("linear") == [backend] and list(runner.weights) == [backend]
        assert isinstance(runner.weights[backend].layers[0].wqkv, PackedWeight) == (backend == "cpu")
        assert llm.llm_engine.core.model.params is None  # the runner holds the only copy
        results[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_no_leaks(llm)
    for a, b in zip(results["xla"], results["cpu"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            np.testing.assert_allclose([x.logprob for x in la.values()], [x.logprob for x in lb.values()], atol=1e-4)


def test_engine_rejects_an_unknown_linear_backend(test_models_dir):
    with pytest.raises(ValueError, match="linear_backend: unknown 'gpu'"):
        make_llm(test_models_dir, linear_backend="gpu")


def test_set_params_lays_out_loaded_weights_and_rejects_other_shapes(test_models_dir):
    llm = make_llm(test_models_dir, linear_backend="cpu")
    runner = llm.llm_engine.core.runner
    model = load_model(test_models_dir / "llama", dtype="float32")
    prompt, greedy = [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=6, temperature=0)
    before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    runner.set_params(model.params)  # as loaded: packed by the runner
    assert isinstance(runner.weights["cpu"].layers[1].w_down, PackedWeight)
    np.testing.assert_array_equal(unpack_weight(runner.weights["cpu"].layers[1].w_down),
                                  model.params.layers[1].w_down)
    runner.set_params(runner.layout_params(model.params))  # already laid out: kept as given
    with pytest.raises(ValueError, match="laid-out weights for \\['xla'\\], the plan uses \\['cpu'\\]"):
        runner.set_params({"xla": model.params})
    wrong = model.params.replace(layers=(model.params.layers[0].replace(w_down=model.params.layers[0].w_down[:-1]),
                                         *model.params.layers[1:]))
    with pytest.raises(ValueError, match=r"weights: .* is \w+\[[\d, ]*\], the engine's \w+\["):
        runner.set_params(wrong)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == before


def test_vector_lanes_match_the_build():
    """The library reports the vector width it was built for: the ISA level
    $JAXLLM_CPU_MARCH names, else the host's (tests/kernels/test_kernel_builds.py runs this under
    the other x86-64 builds); and whether it has integer dot products for int8 / int16
    activations (AVX2 and up: what activation_quantization "auto" asks)."""
    import os
    import platform

    import jaxllm.cpu_kernels

    march = os.environ.get("JAXLLM_CPU_MARCH", "native")
    if march == "x86-64-v3":
        want, integer_dot = 8, True
    elif march == "x86-64":
        want, integer_dot = 4, False
    elif platform.machine() in ("x86_64", "AMD64"):
        flags = open("/proc/cpuinfo").read()
        want = 16 if " avx512f" in flags else 8 if " avx" in flags else 4
        integer_dot = " avx2" in flags
    else:
        pytest.skip("native width of a non-x86 CPU")
    assert jaxllm.cpu_kernels.vector_lanes() == want
    assert jaxllm.cpu_kernels.has_integer_dot() == integer_dot


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_kernel_matches_ragged_dot(dtype):
    """A mixture of experts' projection with packed experts (the dense kernel over each
    expert's rows) against jax.lax.ragged_dot on the plain weights: empty groups, one
    group taking most rows, and rows past the groups' sum (zeros, as ragged_dot)."""
    from jaxllm.models.linear import grouped_linear

    rng = np.random.default_rng(4)
    e, k, n = 5, 72, 70
    w = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), dtype)
    packed = pack_weight(w)
    assert packed.experts == e and packed.panels.shape[:2] == (e, 3) and packed.out_features == n
    np.testing.assert_array_equal(np.asarray(unpack_weight(packed))[:, :k], np.asarray(w))
    x = jnp.asarray(rng.standard_normal((40, k)), jnp.float32)
    for sizes in ([8, 0, 25, 7, 0], [0, 0, 0, 0, 40], [3, 4, 0, 5, 6]):  # the last sums to 18 of 40 rows
        sizes = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(jax.jit(grouped_linear)(x, packed, sizes))
        want = np.asarray(jax.lax.ragged_dot(x.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        np.testing.assert_array_equal(got[int(sizes.sum()):], 0)


@pytest.mark.parametrize("weights", ["int8", "q8_0", "q4_0", "q4_1", "int4", "int8_g64"])
def test_grouped_kernel_over_quantized_experts(weights):
    """Quantized experts (each expert's [K, N] quantized as a projection, stacked): the
    grouped kernel gives, for the block formats, the very sums of the grouped float
    kernel over the dequantized experts (and in a bfloat16 model those of the bfloat16
    kernel over them rounded), for int8 those within rounding; XLA's path (the experts
    dequantized, ragged_dot) agrees; rows past the groups stay zeros."""
    from jaxllm.models.linear import grouped_linear
    from jaxllm.models.params import stack_experts

    rng = np.random.default_rng(5)
    e, k, n = 4, 128, 70
    q = stack_experts([quantize_weight(rng.standard_normal((k, n)).astype(np.float32), weights) for _ in range(e)])
    assert q.shape == (e, k, n) and q.scale.shape[0] == e
    floats = dequantize(q)
    packed = pack_weight(q)
    assert packed.experts == e and packed.panels.shape[:2] == (e, 3)
    np.testing.assert_array_equal(np.asarray(unpack_weight(packed)), np.asarray(floats))
    x = jnp.asarray(rng.standard_normal((30, k)), jnp.float32)
    grouped = jax.jit(grouped_linear)
    for sizes in ([8, 0, 15, 7], [3, 4, 0, 5]):  # the last sums to 12 of 30 rows
        sizes = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(grouped(x, packed, sizes))
        want = np.asarray(jax.lax.ragged_dot(x, floats, sizes, preferred_element_type=jnp.float32))
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-6 * np.abs(want).max())
        np.testing.assert_allclose(np.asarray(grouped(x, q, sizes)), want, rtol=0, atol=4e-6 * np.abs(want).max())
        np.testing.assert_array_equal(got[int(sizes.sum()):], 0)
        if q.group:
            np.testing.assert_array_equal(got, np.asarray(grouped(x, pack_weight(floats), sizes)))
            in_bf16 = pack_weight(q.replace(float_dtype="bfloat16"))
            np.testing.assert_array_equal(np.asarray(grouped(x, in_bf16, sizes)),
                                          np.asarray(grouped(x, pack_weight(floats.astype(jnp.bfloat16)), sizes)))


def test_each_stored_layout_has_one_format():
    """jaxllm.models.formats: every layout a projection is held in (plain, int8 per
    column, int4 / int8 by groups and GGUF's blocks, marked for Pallas, packed panels,
    a mixture's stacked experts) is held by exactly one format class, the one linear()
    dispatches to; and linear() multiplies each as its dequantized matrix would (int8
    per column to float rounding: its scales multiply the output)."""
    from jaxllm.models import formats

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    int8, q4_1 = quantize_weight(w, "int8"), quantize_blocks(w, QUANT_FORMATS["q4_1"])
    cases = {formats.Dense: [w, jnp.stack([w, w])], formats.ChannelInt8: [int8],
             formats.Blocks: [q4_1, quantize_weight(w, "int4_g32")], formats.PallasTiles: [q4_1.replace(kernel="pallas")],
             formats.Panels: [pack_weight(w), pack_weight(q4_1)]}
    for fmt, weights in cases.items():
        for weight in weights:
            assert [f for f in formats.FORMATS if f.holds(weight)] == [fmt], (fmt, weight)
    np.testing.assert_allclose(linear(x, q4_1), x @ dequantize(q4_1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(linear(x, pack_weight(q4_1)), x @ dequantize(q4_1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(linear(x, int8), x @ dequantize(int8), rtol=1e-5, atol=1e-5)
