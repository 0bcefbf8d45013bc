"""The Mosaic GPU KV cache write (pallas_kernels.kv_cache_write_mgpu) in Mosaic GPU's
interpreter against the reference scatter: every token's row lands in its slot and
nothing else changes, T not a multiple of the token block, padding tokens in the null
block; race detection on; refused for a cache of another dtype; lowered for CUDA at
Llama-3.1-8B's shapes with the caches aliased in place."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import write_kv_cache_reference
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.kv_cache_write_mgpu import write_kv_cache_mgpu

NATIVE = os.environ.get("JAXLLM_PALLAS_INTERPRET", "1") == "0"  # scripts/gpu_check.py on a Hopper


@pytest.mark.parametrize("dtype,t,block_t", [(jnp.bfloat16, 13, 8), (jnp.float32, 5, 4)])
def test_rows_land_in_their_slots(dtype, t, block_t):
    rng = np.random.default_rng(t)
    nb, bs, hkv, d = 6, 16, 2, 64
    slots = rng.permutation(np.arange(bs, nb * bs))[:t].astype(np.int32)  # block 0 is the null block
    slots[-2:] = [0, 1]  # two padding tokens, written into the null block
    k, v = (jnp.asarray(rng.standard_normal((t, hkv, d)), dtype) for _ in range(2))
    kc, vc = (jnp.asarray(rng.standard_normal((nb, bs, hkv, d)), dtype) for _ in range(2))
    interpret = False if NATIVE else plgpu.InterpretGPUParams(detect_races=True)
    got = write_kv_cache_mgpu(k, v, kc, vc, jnp.asarray(slots), interpret=interpret, block_t=block_t)
    want = write_kv_cache_reference(k, v, kc, vc, jnp.asarray(slots))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_another_dtype_is_refused():
    k = jnp.zeros((4, 2, 64), jnp.float32)
    cache = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="a copy only"):
        write_kv_cache_mgpu(k, k, cache, cache, jnp.arange(4, dtype=jnp.int32))


def test_lowers_for_cuda_in_place():
    sd = jax.ShapeDtypeStruct
    new, cache = sd((512, 8, 128), jnp.bfloat16), sd((1024, 16, 8, 128), jnp.bfloat16)
    text = lower_for_cuda(write_kv_cache_mgpu, new, new, cache, cache, sd((512,), jnp.int32)).as_text()
    assert "mosaic_gpu" in text and "output_operand_alias" in text
