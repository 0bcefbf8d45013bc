"""The Pallas LoRA kernels (pallas_kernels.lora): in interpret mode against the jnp
oracle and the engine's XLA path (jaxllm.models.lora), and lowered for CUDA at the
shapes the engine would run."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.lora import LoRAProjection, lora_delta
from pallas_kernels.cuda_lowering import has_triton_call, lower_for_cuda
from pallas_kernels.lora import lora_expand, lora_reference, lora_shrink

# Interpret mode (CPU), unless JAXLLM_PALLAS_INTERPRET=0 (a GPU run).
INTERPRET = os.environ.get("JAXLLM_PALLAS_INTERPRET", "1") != "0"


def case(m: int, k: int, widths: tuple[int, ...], num_slots: int = 3, rank: int = 16, seed: int = 0,
         dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    a = jnp.asarray(rng.standard_normal((k, num_slots, len(widths), rank)) / np.sqrt(k), dtype)
    bs = tuple(jnp.asarray(rng.standard_normal((num_slots, rank, n)) / np.sqrt(rank), dtype) for n in widths)
    slots = jnp.asarray(rng.integers(0, num_slots + 1, m), jnp.int32)  # slot 0: no adapter
    return x, a, bs, slots


def pallas_lora(x, a, bs, slots, **kw):
    shrunk = lora_shrink(x, a, slots, interpret=INTERPRET, **kw)
    return jnp.concatenate([lora_expand(shrunk[:, p].astype(x.dtype), b, slots, interpret=INTERPRET)
                            for p, b in enumerate(bs)], axis=-1)


@pytest.mark.parametrize("m", [1, 37])
def test_float32_equals_the_oracle_and_the_xla_path(m):
    """Rows of every slot and of none, a fused projection of three parts of unequal
    widths (q | k | v), M and N not multiples of the tiles, K over several steps."""
    x, a, bs, slots = case(m, 96, (80, 48, 48))
    slots = slots.at[0].set(2)  # the single row of m = 1 has an adapter
    want = lora_reference(x, a, bs, slots)
    np.testing.assert_allclose(pallas_lora(x, a, bs, slots, block_k=32), want, rtol=1e-5, atol=1e-5)
    onehot = (slots[:, None] == jnp.arange(1, 4)).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):  # XLA's float32 dot on a GPU is TF32 by default
        xla = lora_delta(x, LoRAProjection(a, bs), onehot)
    np.testing.assert_allclose(xla, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want)[np.asarray(slots) > 0]).max() > 0.1
    assert not np.asarray(want)[np.asarray(slots) == 0].any() and (m == 1 or (np.asarray(slots) == 0).any())


def test_bfloat16():
    x, a, bs, slots = case(20, 64, (64,), num_slots=2, dtype=jnp.bfloat16)
    want = lora_reference(x, a, bs, slots).astype(jnp.float32)
    got = pallas_lora(x, a, bs, slots).astype(jnp.float32)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


def test_refusals():
    x, a, bs, slots = case(4, 32, (32,), rank=8)
    with pytest.raises(ValueError, match=r"rank of the slots \(8\) must be a power of two >= 16"):
        lora_shrink(x, a, slots, interpret=True)
    x, a, bs, slots = case(4, 32, (32,))
    with pytest.raises(ValueError, match="block_k=48 must be a power of two"):
        lora_shrink(x, a, slots, block_k=48, interpret=True)


# SmolLM2's projections (q | k | v, o, gate | up, down) and Llama-3.2-1B's, at decode and
# prefill row counts; 4 slots of rank 16, and 8 of rank 64.
LOWERING = [(16, 576, (576, 192, 192), 4, 16), (512, 576, (1536, 1536), 4, 16), (64, 1536, (576,), 4, 16),
            (256, 2048, (2048, 512, 512), 8, 64), (32, 8192, (2048,), 8, 64)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lowers_for_cuda(dtype):
    dtype = jnp.dtype(dtype)
    for m, k, widths, num_slots, rank in LOWERING:
        x = jax.ShapeDtypeStruct((m, k), dtype)
        a = jax.ShapeDtypeStruct((k, num_slots, len(widths), rank), dtype)
        slots = jax.ShapeDtypeStruct((m,), jnp.int32)
        lowered = lower_for_cuda(lora_shrink, x, a, slots)
        assert has_triton_call(lowered.as_text()), ("shrink", m, k, widths)
        for n in widths:
            s = jax.ShapeDtypeStruct((m, rank), dtype)
            b = jax.ShapeDtypeStruct((num_slots, rank, n), dtype)
            lowered = lower_for_cuda(lora_expand, s, b, slots)
            assert has_triton_call(lowered.as_text()), ("expand", m, n)
