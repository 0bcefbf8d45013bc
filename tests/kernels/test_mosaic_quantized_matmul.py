"""The Mosaic GPU weight-only quantized matmul (pallas_kernels.quantized_matmul_mgpu) in
Mosaic GPU's interpreter on the CPU, against an oracle of what it computes: per column,
the integer values times x summed in float32, then scaled; grouped, each weight's value
dequantized in float32 and rounded to x's 16-bit type, times x, summed in float32 (the
Triton kernel's arithmetic); every format jaxllm holds (int8 per column, grouped int8
and int4, GGUF's Q8_0 / Q4_0 / Q4_1), one token and several blocks of tokens, K over
more steps than the ring's slots, split-K; race detection on for a reduced set; and
lowered for CUDA at Llama-3.1-8B's decode and prefill shapes."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.models.quant import quantize_weight
from pallas_kernels.cuda_lowering import lower_for_cuda
from pallas_kernels.quantized_matmul_mgpu import quantized_matmul_mgpu, unsupported

NATIVE = os.environ.get("JAXLLM_PALLAS_INTERPRET", "1") == "0"  # scripts/gpu_check.py on a Hopper
K, N = 256, 128


def interpret(races: bool = False):
    return False if NATIVE else plgpu.InterpretGPUParams(detect_races=races)


def quantized(fmt: str, k: int = K, n: int = N, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    return jax.tree.map(jnp.asarray, quantize_weight(w, fmt))


def oracle(x, qw):
    """float32 sums of x's exact values against the weights the kernel multiplies."""
    x32, q = x.astype(jnp.float32), qw.q.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    if not qw.group:
        return jnp.matmul(x32, q, precision=hi) * qw.scale.astype(jnp.float32)
    w = q * jnp.repeat(qw.scale.astype(jnp.float32), qw.group, axis=0)
    if qw.mins is not None:
        w = w + jnp.repeat(qw.mins.astype(jnp.float32), qw.group, axis=0)
    return jnp.matmul(x32, w.astype(x.dtype).astype(jnp.float32), precision=hi)


def run(fmt, m, dtype=jnp.bfloat16, races=False, **kw):
    qw = quantized(fmt)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, K)), dtype)
    got = quantized_matmul_mgpu(x, qw.q.T, qw.scale, qw.mins, group=qw.group, interpret=interpret(races), **kw)
    assert got.shape == (m, N) and got.dtype == x.dtype
    want = oracle(x, qw)
    # the sums agree to float32 rounding; the output is rounded once to x's type
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -7, atol=1e-3 * float(jnp.abs(want).max()))
    return got


# per column, groups of 128 (int4: GPTQ's), GGUF's three; the slow run the rest
FORMATS = ["int8", pytest.param("int8_g32", marks=pytest.mark.slow), pytest.param("int4_g32", marks=pytest.mark.slow),
           "int4", pytest.param("q8_0", marks=pytest.mark.slow), "q4_0", "q4_1"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_against_the_oracle(fmt):
    """One token (a decode: 15 padding rows) or 37 (one block of 48), by format."""
    run(fmt, 1 if fmt in ("int8", "int4", "int8_g32") else 37)


@pytest.mark.parametrize("fmt", [pytest.param("q4_0", marks=pytest.mark.slow), "q4_1", "int4_g32",
                                 pytest.param("int4", marks=pytest.mark.slow)])
def test_4_bit_values_are_held_two_to_a_byte(fmt):
    """The engine's Mosaic layout of a 4-bit format (jaxllm.models.linear.mosaic_weight):
    int4 values, q - 8 where the format stores q with mins (which take the 8 scales),
    groups of 32 two to a step (a 32-byte tile row); the products those of the weight
    as loaded, within the 16-bit rounding of each dequantized value."""
    from jaxllm.models.linear import linear, mosaic_weight

    qw = quantized(fmt)
    held = mosaic_weight(qw.replace(kernel="pallas"), jnp.bfloat16)
    assert held.kernel == "mosaic" and held.q.dtype == jnp.int4 and held.q.shape == (N, K)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((7, K)), jnp.bfloat16)
    got = linear(x, held, preferred_element_type=jnp.float32)
    want = oracle(x, qw)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2 ** -7, atol=2e-3 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("fmt,m,kw", [("int8", 130, {"stages": 2}), ("q4_1", 20, {"split_k": 4}),
                                      ("int8", 3, {"split_k": 2, "block_m": 32})],
                         ids=["3-blocks-of-tokens", "split-k-4", "split-k-2-float16"])
def test_blocks_of_tokens_and_split_k(fmt, m, kw):
    run(fmt, m, dtype=jnp.float16 if "block_m" in kw else jnp.bfloat16, **kw)


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_no_races_and_no_reads_out_of_bounds(fmt):
    if NATIVE:
        pytest.skip("the interpreter's checks")
    run(fmt, 5, races=True, split_k=2)


def test_unsupported_shapes_say_why():
    assert unsupported(jnp.bfloat16, n=4096, k=4096, group=32) is None
    assert "float32" in unsupported(jnp.float32, n=4096, k=4096, group=0)
    assert "80 output columns" in unsupported(jnp.bfloat16, n=80, k=4096, group=0)
    assert "groups of 24" in unsupported(jnp.bfloat16, n=128, k=4800, group=24)
    qw = quantized("int8")
    with pytest.raises(ValueError, match="split_k=3 must divide"):
        quantized_matmul_mgpu(jnp.ones((1, K), jnp.bfloat16), qw.q.T, qw.scale, split_k=3)


@pytest.mark.parametrize("fmt,group,m,k,n,split", [("int8", 0, 1, 4096, 14336, 1), ("q4_1", 32, 1, 14336, 4096, 4),
                                                   ("int4", 128, 512, 4096, 6144, 1)],
                         ids=["gate-up-decode", "down-decode-split-4-int4", "qkv-prefill-int4"])
def test_lowers_for_cuda(fmt, group, m, k, n, split):
    sd = jax.ShapeDtypeStruct
    scale = sd((k // group, n) if group else (n,), jnp.float32)
    mins = [scale] if fmt != "int8" else []
    values = sd((n, k), jnp.int8 if fmt == "int8" else jnp.int4)  # 4-bit: two a byte
    lowered = lower_for_cuda(lambda *a: quantized_matmul_mgpu(*a, group=group, split_k=split),
                             sd((m, k), jnp.bfloat16), values, scale, *mins)
    assert "mosaic_gpu" in lowered.as_text()


def test_the_pallas_layout_holds_weights_for_it_on_a_hopper_only(monkeypatch):
    """`pallas_params` with 16-bit activations, compiled for a Hopper: the layers' and
    the output projection's quantized weights it serves are transposed and marked
    "mosaic" (formats.MosaicTiles), and `linear` on them computes the Triton-marked
    weight's product (interpreted here); off a Hopper, for float32 activations and for
    a shape it refuses (N not a multiple of 64), they stay the Triton kernel's."""
    import jaxllm.platform
    from jaxllm.models.formats import MosaicTiles, PallasTiles, format_of
    from jaxllm.models.linear import linear, pallas_params
    from jaxllm.models.params import ModelParams
    from pallas_kernels.cuda_lowering import cuda_target

    qw, odd = quantized("q4_1"), quantized("q4_1", n=96)
    params = ModelParams(embed=jnp.ones((8, K)), layers=[{"wo": qw, "odd": odd}], final_norm=jnp.ones(K), lm_head=qw)
    with cuda_target("NVIDIA A100-SXM4-80GB"):
        assert not jaxllm.platform.targets_hopper()
    with cuda_target("NVIDIA H100 80GB HBM3"):
        assert jaxllm.platform.targets_hopper()
    # concrete arrays, so no abstract mesh: the target is set here (the test also runs on a Hopper)
    monkeypatch.setattr(jaxllm.platform, "targets_hopper", lambda: False)
    off_hopper = pallas_params(params, jnp.bfloat16)
    monkeypatch.setattr(jaxllm.platform, "targets_hopper", lambda: True)
    held = pallas_params(params, jnp.bfloat16)
    as_float32 = pallas_params(params, jnp.float32)
    assert format_of(held.layers[0]["wo"]) is MosaicTiles and format_of(held.lm_head) is MosaicTiles
    assert held.layers[0]["wo"].q.shape == (N, K) and held.layers[0]["wo"].q.dtype == jnp.int4  # two a byte
    assert held.layers[0]["wo"].scale.shape == qw.scale.shape
    assert held.layers[0]["wo"].scale.dtype == held.layers[0]["wo"].mins.dtype == jnp.float32  # converted once, at load
    assert format_of(held.layers[0]["odd"]) is PallasTiles
    for other in (as_float32, off_hopper):
        assert {format_of(w) for w in (other.layers[0]["wo"], other.lm_head)} == {PallasTiles}
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 3, K)), jnp.bfloat16)
    got = linear(x, held.layers[0]["wo"], preferred_element_type=jnp.float32)
    want = linear(x, off_hopper.layers[0]["wo"], preferred_element_type=jnp.float32)
    assert got.shape == (2, 3, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,mosaic", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA A100-SXM4-80GB", False)])
def test_a_quantized_model_step_lowers_for_cuda(kind, mosaic):
    """A bfloat16 Llama with Q4_1 projections in the pallas layout, its forward and
    logits lowered for CUDA: on a Hopper, with attention_backend="mosaic", every projection
    and attention call is a Mosaic GPU kernel and nothing is Triton; on an A100
    everything is Triton. (The step's
    activations are bfloat16 under a GPU target: jaxllm.platform.activation_dtype.)"""
    import dataclasses

    from jaxllm.attention.backends import get_attention_fn
    from jaxllm.attention.kv_cache import KVCache
    from jaxllm.attention.metadata import AttentionMetadata
    from jaxllm.config import ModelConfig
    from jaxllm.models.linear import pallas_params
    from jaxllm.models.llama import compute_logits, forward_hidden
    from jaxllm.models.params import abstract_params
    from jaxllm.models.rope import rope_table
    from pallas_kernels.cuda_lowering import cuda_target, has_triton_call

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=512, intermediate_size=1024,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    cfg = dataclasses.replace(cfg, quantization="q4_1")
    sd, t, s = jax.ShapeDtypeStruct, 16, 4
    i32 = lambda *shape: sd(shape, jnp.int32)
    cache = sd((64, 16, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    md = AttentionMetadata(i32(t), i32(s, 8), i32(s), i32(s + 1), i32(), i32())

    def step(params, rope, caches, ids, positions, md):
        hidden, caches = forward_hidden(params, rope, caches, ids, positions, md, cfg=cfg,
                                        attention_fn=get_attention_fn("mosaic" if mosaic else "pallas"))
        return compute_logits(params, hidden[:s], cfg), caches

    rope = jax.tree.map(lambda a: sd(a.shape, a.dtype), rope_table(cfg.rope, cfg.head_dim, 2048))
    with cuda_target(kind):
        params = pallas_params(abstract_params(cfg, jnp.bfloat16), jnp.bfloat16)
        text = jax.jit(step).trace(params, rope,
                                   (KVCache(cache, cache),) * cfg.num_layers, i32(t), i32(t), md
                                   ).lower(lowering_platforms=("cuda",)).as_text()
    kernels = text.count('custom_call @mosaic_gpu_v2') + text.count('call_target_name = "mosaic_gpu_v2"')
    # one per distinct kernel (the layers' calls of one shape share a function): attention,
    # q/k/v, o, gate/up, down and the output projection
    assert kernels == (6 if mosaic else 0), kernels
    assert has_triton_call(text) != mosaic
