"""The row-wise kernels (jaxllm/cpu_kernels/row_ops.cc: RMSNorm, the gated activation)
against a float64 oracle and the jnp forms the model runs elsewhere (llama.rms_norm,
moe.gated): float32 within the error of XLA's own result, bfloat16 rounding alike, a
row's norm the same bits alone or in any batch, widths off the vector size, the model
taking them where its projections are packed, and bad input refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import llama
from jaxllm.models.linear import pack_weight
from jaxllm.models.moe import gated
from jaxllm.models.row_ops import add_rms_norm_cpu, gated_cpu, rms_norm_cpu


def _rows(rng, m, d):
    """Rows of very different scales (the mean square spans ~6 decades)."""
    return (rng.standard_normal((m, d)) * rng.uniform(0.01, 30, (m, 1))).astype(np.float32)


def _norm64(x, w, eps, offset):
    x64 = x.astype(np.float64)
    return (w.astype(np.float64) + offset) * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("d", [576, 64, 100, 7])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_float32(d, offset):
    rng = np.random.default_rng(d)
    x, w = _rows(rng, 67, d), rng.standard_normal(d).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: rms_norm_cpu(a, jnp.asarray(w), 1e-5, offset))(x))
    xla = np.asarray(jax.jit(lambda a: llama.rms_norm(a, jnp.asarray(w), 1e-5, offset))(x))
    want = _norm64(x, w, 1e-5, offset)
    scale = np.abs(want).max(-1, keepdims=True)
    # no further from the exact norm than 4 float32 ulps of the row's largest value, as XLA's
    assert np.abs(got - want).max() <= 4 * 2 ** -23 * scale.max()
    np.testing.assert_allclose(got, xla, rtol=1e-6, atol=float(1e-6 * scale.max()))
    assert np.abs(xla - want).max() <= 4 * 2 ** -23 * scale.max()


@pytest.mark.parametrize("d", [576, 100, 7])
def test_rms_norm_is_its_definition_bit_for_bit(d):
    """The definition in float32, in numpy: squares summed in llama.row_sums' order
    (slices of 16 into 16 running sums, then halved), the mean plus eps, 1 / sqrt (each
    correctly rounded), x * r, times weight + offset. Every build (the vector width
    changes, the order does not: tests/kernels/test_kernel_builds.py)."""
    rng = np.random.default_rng(d + 1)
    x, w = _rows(rng, 40, d), rng.standard_normal(d).astype(np.float32)
    parts = np.pad(x * x, [(0, 0), (0, -d % 16)]).reshape(40, -1, 16)
    acc = parts[:, 0]
    for i in range(1, parts.shape[1]):
        acc = acc + parts[:, i]
    while acc.shape[1] > 1:
        acc = acc[:, : acc.shape[1] // 2] + acc[:, acc.shape[1] // 2:]
    r = np.float32(1) / np.sqrt(acc / np.float32(d) + np.float32(1e-5))
    want = (w + np.float32(1)) * (x * r)
    got = np.asarray(jax.jit(lambda a: rms_norm_cpu(a, jnp.asarray(w), 1e-5, 1.0))(x))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_residual_add_and_norm_in_one_pass(dtype):
    """add_rms_norm: the sum as XLA adds (bit for bit; bfloat16 rounded), and the norm of
    that sum as rms_norm_cpu's of it (bit for bit)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(_rows(rng, 45, 576)).astype(dtype)
    y = jnp.asarray(_rows(rng, 45, 576)).astype(dtype)
    w = jnp.asarray(rng.standard_normal(576).astype(np.float32))
    s, n = jax.jit(lambda a, b: add_rms_norm_cpu(a, b, w, 1e-5, 1.0))(x, y)
    want_s = jax.jit(lambda a, b: a + b)(x, y)
    assert s.dtype == n.dtype == dtype
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(want_s, np.float32))
    np.testing.assert_array_equal(np.asarray(n, np.float32),
                                  np.asarray(jax.jit(lambda a: rms_norm_cpu(a, w, 1e-5, 1.0))(want_s), np.float32))


def test_rms_norm_bfloat16_and_leading_axes():
    rng = np.random.default_rng(1)
    x = jnp.asarray(_rows(rng, 60, 64)).astype(jnp.bfloat16).reshape(5, 12, 64)  # [T, H, hd]: q/k norms
    w = jnp.asarray(rng.standard_normal(64).astype(np.float32))
    got = jax.jit(lambda a: rms_norm_cpu(a, w, 1e-6, 0.0))(x)
    want = jax.jit(lambda a: llama.rms_norm(a, w, 1e-6, 0.0))(x)
    assert got.dtype == jnp.bfloat16 and got.shape == x.shape
    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # the same bfloat16 but where the float32 values straddle a rounding boundary: one ulp, rarely
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(r), 1e-30))) - 7)
    assert np.all(np.abs(g - r) <= ulp)
    assert np.mean(g != r) < 0.01


def test_rms_norm_rows_are_batch_invariant():
    rng = np.random.default_rng(2)
    x, w = _rows(rng, 300, 576), jnp.asarray(rng.standard_normal(576).astype(np.float32))
    norm = jax.jit(lambda a: rms_norm_cpu(a, w, 1e-5))
    whole = np.asarray(norm(x))
    for lo, hi in [(5, 6), (0, 7), (100, 228)]:
        np.testing.assert_array_equal(np.asarray(norm(x[lo:hi])), whole[lo:hi])
    np.testing.assert_array_equal(np.asarray(norm(np.zeros((3, 576), np.float32))), 0)  # padding rows stay zeros


def _gated64(x, act):
    g, u = np.split(x.astype(np.float64), 2, axis=-1)
    if act == "silu":
        return g / (1 + np.exp(-g)) * u
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("f", [1536, 24, 5])
def test_gated(act, f):
    rng = np.random.default_rng(f)
    x = (rng.standard_normal((33, 2 * f)) * 4).astype(np.float32)
    x[0, : min(f, 5)] = [-100.0, 100.0, 0.0, -0.0, 1e-30][: min(f, 5)]  # the exp's ends, signed zeros
    got = np.asarray(jax.jit(lambda a: gated_cpu(a, act))(x))
    xla = np.asarray(jax.jit(lambda a: gated(a, act))(x))
    want = _gated64(x, act)
    tol = 4 * 2 ** -23 * np.maximum(np.abs(want), np.abs(x[:, f:]))  # a few ulps of the output, or of up
    assert np.all(np.abs(got - want) <= tol + 1e-37)
    np.testing.assert_allclose(got, xla, rtol=0, atol=float(np.abs(want).max() * 1e-6))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        rms_norm_cpu(jnp.zeros((2, 4), jnp.float16), jnp.ones(4), 1e-6)
    with pytest.raises(ValueError, match="of one shape"):
        add_rms_norm_cpu(jnp.zeros((2, 4)), jnp.zeros((2, 4), jnp.bfloat16), jnp.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"float32 \[T, 2F\]"):
        gated_cpu(jnp.zeros((2, 5), jnp.float32), "silu")
    with pytest.raises(ValueError, match=r"float32 \[T, 2F\]"):
        gated_cpu(jnp.zeros((2, 4), jnp.bfloat16), "silu")


def test_the_model_takes_them_where_the_projection_is_packed():
    w = np.ones((64, 64), np.float32)
    x = jnp.asarray(_rows(np.random.default_rng(3), 8, 64))
    weight = jnp.ones(64)

    def custom_calls(fn):
        return jax.jit(fn).lower(x).as_text().count("jaxllm_rms_norm")

    assert custom_calls(lambda a: llama.norm_before(pack_weight(w), a, weight, 1e-6)) == 1
    assert custom_calls(lambda a: llama.norm_before(jnp.asarray(w), a, weight, 1e-6)) == 0
    assert custom_calls(lambda a: llama.add_norm_before(pack_weight(w), a, a, weight, 1e-6)[1]) == 0  # no norm of its own
    assert jax.jit(lambda a: llama.add_norm_before(pack_weight(w), a, a, weight, 1e-6)[1]).lower(x).as_text().count(
        "jaxllm_add_rms_norm") == 1

    def glu_calls(w):
        return jax.jit(lambda a: llama.gated_before(w, a, "silu")).lower(x).as_text().count("jaxllm_glu")

    assert glu_calls(pack_weight(w)) == 1 and glu_calls(jnp.asarray(w)) == 0
