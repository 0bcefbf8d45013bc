"""The Pallas weight-only quantized matmul (pallas_kernels/quantized_matmul.py): in
interpret mode against the jnp oracle and against jaxllm's own XLA path for the same
QuantizedWeight (`linear`), for every format jaxllm holds (int8 per column, GGUF's
Q8_0 / Q4_0 / Q4_1 blocks), float32 and bfloat16 activations, shapes that are not
multiples of the tiles; and lowered for CUDA without a GPU."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.linear import linear
from jaxllm.models.params import QUANT_FORMATS
from jaxllm.models.quant import quantize_weight
from pallas_kernels.cuda_lowering import has_triton_call, lower_for_cuda
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference

FORMATS = ["int8", "int4_g32", "int8_g32", "q8_0", "q4_0", "q4_1"]
# Interpret mode (CPU), unless JAXLLM_PALLAS_INTERPRET=0: scripts/gpu_check.py runs these
# natively on a GPU.
INTERPRET = os.environ.get("JAXLLM_PALLAS_INTERPRET", "1") != "0"
K, N = 96, 80  # N not a multiple of the column tile: masked columns


def quantized(fmt: str, k: int = K, n: int = N, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    return quantize_weight(w, fmt)


def kernel(x, qw, **kw):
    return quantized_matmul(x, jnp.asarray(qw.q), jnp.asarray(qw.scale),
                            None if qw.mins is None else jnp.asarray(qw.mins), group=qw.group, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 37])
def test_float32_equals_the_oracle_and_the_xla_path(fmt, m):
    qw = quantized(fmt)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, K)), jnp.float32)
    got = kernel(x, qw, interpret=INTERPRET)
    ref = quantized_matmul_reference(x, jnp.asarray(qw.q), jnp.asarray(qw.scale),
                                     None if qw.mins is None else jnp.asarray(qw.mins), group=qw.group)
    assert got.shape == (m, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    with jax.default_matmul_precision("highest"):  # XLA's float32 dot on a GPU is TF32 by default
        xla = linear(x, jax.tree.map(jnp.asarray, qw))
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_bfloat16_activations(fmt):
    """bfloat16 x: the dequantized tile is rounded to bfloat16 for the MMA, the sums kept
    in float32; within bfloat16's precision of the float32 oracle."""
    qw = quantized(fmt)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((20, K)), jnp.bfloat16)
    got = kernel(x, qw, interpret=INTERPRET)
    ref = quantized_matmul_reference(x.astype(jnp.float32), jnp.asarray(qw.q), jnp.asarray(qw.scale),
                                     None if qw.mins is None else jnp.asarray(qw.mins), group=qw.group)
    assert got.dtype == jnp.bfloat16
    err = np.abs(np.asarray(got, np.float32) - np.asarray(ref))
    assert err.max() < 0.02 * np.abs(np.asarray(ref)).max()


def test_several_tiles_each_way():
    """M, N and K over several tiles, explicit small blocks: every (i, j) program and
    every K step lands where it should."""
    qw = quantized("q8_0", k=128, n=150, seed=3)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((70, 128)), jnp.float32)
    got = kernel(x, qw, block_m=16, block_n=32, interpret=INTERPRET)
    with jax.default_matmul_precision("highest"):  # XLA's float32 dot on a GPU is TF32 by default
        xla = linear(x, jax.tree.map(jnp.asarray, qw))
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_k_equals_the_oracle_and_lowers_for_cuda(fmt, dtype):
    """K split over 2 and 3 programs per output tile (their float32 partial sums added
    after): the oracle's values for a per-column and a grouped format, both dtypes, rows
    and columns past the tiles; a split that does not divide K's steps is refused; and
    the split kernel lowers for CUDA at the down projection's decode shape."""
    qw = quantized(fmt)  # K 96: three steps of 32
    x = jnp.asarray(np.random.default_rng(5).standard_normal((21, K)), jnp.dtype(dtype))
    want = quantized_matmul_reference(x.astype(jnp.float32), jnp.asarray(qw.q), jnp.asarray(qw.scale),
                                      None if qw.mins is None else jnp.asarray(qw.mins), group=qw.group)
    for split in (3,) if qw.group else (3, 1):
        got = kernel(x, qw, block_k=32, split_k=split, interpret=INTERPRET)
        assert got.dtype == x.dtype
        tol = 1e-5 if dtype == "float32" else 2e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="split_k=2 must divide the 3 steps"):
        kernel(x, qw, block_k=32, split_k=2, interpret=INTERPRET)
    spec = QUANT_FORMATS[fmt]
    m, k, n = 1, 14336, 4096
    scale = (k // spec.group, n) if spec.group else (n,)
    args = [jax.ShapeDtypeStruct((m, k), jnp.dtype(dtype)), jax.ShapeDtypeStruct((k, n), jnp.int8),
            jax.ShapeDtypeStruct(scale, jnp.float32)] + ([jax.ShapeDtypeStruct(scale, jnp.float32)] if spec.mins else [])
    lowered = lower_for_cuda(lambda *a: quantized_matmul(*a, group=spec.group, split_k=8, num_stages=4), *args)
    assert has_triton_call(lowered.as_text())


def test_bad_shapes_and_blocks_are_refused():
    qw = quantized("q8_0")
    x = jnp.zeros((4, K), jnp.float32)
    with pytest.raises(ValueError, match=r"scales \(and mins\) must be \(3, 80\)"):
        quantized_matmul(x, jnp.asarray(qw.q), jnp.zeros((80,)), group=32)
    with pytest.raises(ValueError, match="block_k == group"):
        kernel(x, qw, block_k=64, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
        kernel(x, qw, block_n=48, interpret=INTERPRET)
    with pytest.raises(ValueError, match="K=100 is not a multiple of the group"):
        quantized_matmul(jnp.zeros((4, 100)), jnp.zeros((100, N), jnp.int8), jnp.ones((3, N)), group=32)


# SmolLM2's projections (K 576 / 1536, N up to 3072 and the 49,152-row vocabulary) and
# Llama-3.2-1B's (K 2048 / 8192), at decode and prefill row counts.
LOWERING_SHAPES = [(16, 576, 1728), (512, 576, 3072), (64, 1536, 576), (16, 576, 49152), (256, 2048, 8192),
                   (32, 8192, 2048)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lowers_for_cuda(fmt, dtype):
    spec = QUANT_FORMATS[fmt]
    for m, k, n in LOWERING_SHAPES:
        scale = (k // spec.group, n) if spec.group else (n,)
        args = [jax.ShapeDtypeStruct((m, k), jnp.dtype(dtype)), jax.ShapeDtypeStruct((k, n), jnp.int8),
                jax.ShapeDtypeStruct(scale, jnp.float32)]
        if spec.mins:
            args.append(jax.ShapeDtypeStruct(scale, jnp.float32))
        lowered = lower_for_cuda(lambda *a: quantized_matmul(*a, group=spec.group), *args)
        assert has_triton_call(lowered.as_text()), (fmt, dtype, m, k, n)


@pytest.mark.parametrize("fmt", ["int4", "int4_g64"])  # int4_g64: a GPTQ / AWQ checkpoint's groups of 64
def test_int4_with_128_or_64_input_groups_runs_and_lowers_for_cuda(fmt):
    """int4's groups of 128 (64) inputs: one group per K step, against the reference,
    and the CUDA lowering."""
    group = QUANT_FORMATS[fmt].group
    qw = quantized(fmt, k=256, n=96)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((20, 256)), jnp.float32)
    want = quantized_matmul_reference(x, jnp.asarray(qw.q), jnp.asarray(qw.scale), jnp.asarray(qw.mins), group=group)
    np.testing.assert_allclose(kernel(x, qw, interpret=INTERPRET), want, rtol=1e-5, atol=1e-5)
    m, k, n = 16, 2048, 8192
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.int8),
            jax.ShapeDtypeStruct((k // group, n), jnp.float32), jax.ShapeDtypeStruct((k // group, n), jnp.float32)]
    lowered = lower_for_cuda(lambda *a: quantized_matmul(*a, group=group), *args)
    assert has_triton_call(lowered.as_text())


def test_linear_dispatches_marked_weights_to_the_kernel():
    """`pallas_params` marks quantized projections; `linear` then runs the kernel (a
    3-D activation, float32 logits out of bfloat16 activations as compute_logits asks)."""
    from jaxllm.models.linear import pallas_params

    qw = jax.tree.map(jnp.asarray, quantized("q4_1"))
    marked = pallas_params({"w": qw, "norm": jnp.ones(3)})
    assert marked["w"].kernel == "pallas" and marked["norm"].shape == (3,)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, K)), jnp.bfloat16)
    got = linear(x, marked["w"], preferred_element_type=jnp.float32)
    assert got.shape == (2, 3, N) and got.dtype == jnp.float32
    want = linear(x.astype(jnp.float32), qw)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 0.02 * np.abs(np.asarray(want)).max()


@pytest.mark.slow  # 45 s: every projection of every step in interpret mode
def test_the_pallas_linear_backend_through_the_engine(test_models_dir):
    """linear_backend="pallas" (the kernel in interpret mode on CPU) with int8 and Q4_1
    weights: every projection through the kernel, the step's tokens and prompt
    logprobs those of the xla backend on the same weights."""
    from jaxllm import LLM, SamplingParams
    from tests.support.llm import KV_BYTES_PER_BLOCK, assert_no_leaks

    prompts = ["The quick brown fox", "Hello world! How are you today?", "One, two, three, four, five, six"]
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0)
    for quantization in ("int8", "q4_1"):  # float32: auto would be bfloat16 on a GPU
        results = {}
        for backend in ("xla", "pallas"):
            llm = LLM(str(test_models_dir / "llama"), quantization=quantization, linear_backend=backend,
                      attention_backend="xla", dtype="float32", max_model_len=128, max_num_seqs=4,
                      max_num_batched_tokens=32, kv_cache_memory=16 * KV_BYTES_PER_BLOCK, progress=False)
            assert llm.llm_engine.core.runner.plan.backends("linear") == [backend]
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[backend] = [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
                                for o in outs]
            assert_no_leaks(llm)
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(results["pallas"], results["xla"], strict=True):
            assert tokens == want_tokens
            np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
