"""int8 and int16 activations (EngineConfig.activation_quantization="int8" / "int16", and
"auto", the default: int16 on the cpu kernel): the inputs of block-quantized projections
quantized per 32 to int8 (int16) and multiplied in integers. The jnp reference
(jaxllm.models.quant.quantized_activation_matmul) against the float64 product of the quantized inputs and the dequantized weights; the `cpu`
kernel's integer dot products (jaxllm/cpu_kernels/dense.cc, *_x8 and *_x16;
tests/kernels/test_kernel_builds.py runs them under the AVX2 and SSE2 builds too) against that
reference; the engine through either backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.config import EngineConfig
from jaxllm.loaders import load_model
from jaxllm.models.linear import grouped_linear, linear, pack_weight, quantized_activations, unpack_weight
from jaxllm.models.params import QUANT_FORMATS, QuantizedWeight, stack_experts
from jaxllm.models.quant import (
    activation_quantization_ready,
    dequantize,
    quantize_activations,
    quantize_grouped,
    quantize_int8,
    quantize_weight,
    quantized_activation_matmul,
)
from jaxllm.worker import autotune
from tests.support.llm import LAZY

FORMATS = ["q8_0", "q4_0", "q4_1", "int4", "int4_g64", "int4_g32"]
ACTIVATIONS = ["int8", "int16"]
LARGEST = {"int8": 127, "int16": 32767}
SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, attention_backend="cpu", progress=False,
             **LAZY)
REFERENCE = dict(num_scheduler_steps=1)  # an oracle engine decodes by single steps: no decode loops to compile


def _quantized(fmt: str, k: int, n: int, seed: int = 0, activations: str = "int8") -> QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    return quantize_weight(w, fmt).map_arrays(jnp.asarray).replace(activations=activations)


@pytest.mark.parametrize("dtype", ACTIVATIONS)
def test_activations_are_rounded_to_their_block_s_scale(dtype):
    """Each block of 32 inputs: scale max|x| / 127 (int16: / 32767), the largest value at
    +-127 (+-32767), every value within half a step of x / scale, the sum of the values;
    a block of zeros gets scale 0 and zeros."""
    top = LARGEST[dtype]
    scales = np.array([1, 1e-3, 50], np.float32)[:, None]
    x = np.random.default_rng(1).standard_normal((3, 96)).astype(np.float32) * scales
    x[1, 32:64] = 0
    q, d, s = (np.asarray(a) for a in quantize_activations(jnp.asarray(x), dtype))
    assert q.dtype == np.dtype(dtype)
    blocks = x.reshape(3, 3, 32)
    np.testing.assert_array_equal(d, np.abs(blocks).max(-1) * (np.float32(1) / np.float32(top)))
    assert d[1, 1] == 0 and not q[1, 1].any()
    assert (np.abs(q).max(-1)[d > 0] == top).all()
    assert (np.abs(q * d[..., None] - blocks) <= d[..., None] * 0.5001).all()
    np.testing.assert_array_equal(s, q.astype(np.int32).sum(-1))


@pytest.mark.parametrize("dtype", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_reference_is_the_product_of_the_quantized_inputs(fmt, dtype):
    """quantized_activation_matmul = (q_x * d_x) @ dequantize(w) in float64, to float32
    rounding: integer sums exact, then the block's scales (and Q4_1's mins times the
    block's sum); and within the inputs' rounding of the float product: 2% of the
    largest output for int8, 0.01% for int16 (its steps 258 times finer)."""
    w = _quantized(fmt, 256, 80, activations=dtype)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 256)).astype(np.float32))
    q, d, _ = quantize_activations(x, dtype)
    xq = (np.asarray(q, np.float64) * np.asarray(d, np.float64)[..., None]).reshape(5, 256)
    exact = xq @ np.asarray(dequantize(w), np.float64)
    got = np.asarray(jax.jit(quantized_activation_matmul)(x, w))
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * np.abs(exact).max())
    floats = np.asarray(x, np.float64) @ np.asarray(dequantize(w), np.float64)
    tolerance = {"int8": 0.02, "int16": 1e-4}[dtype]
    np.testing.assert_allclose(got, floats, rtol=0, atol=tolerance * np.abs(floats).max())


# K a multiple of every format's group (int4's 128)
@pytest.mark.parametrize("m,k,n", [(1, 128, 32), (5, 256, 40), (13, 640, 960), (97, 1536, 576), (200, 128, 33)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ACTIVATIONS)
def test_kernel_matches_the_reference(m, k, n, fmt, dtype):
    """The dot layout (4-bit: [N/32, K/8, 32, 4] uint8; int8: [N/32, K/4, 32, 4]) holds
    the weight (unpacked, it is the same matrix), and the kernel's integer dot products
    give the reference's sums over row counts around its tiles and blocks and widths
    that are not whole panels (only the order of the float additions differs)."""
    fmt_ = QUANT_FORMATS[fmt]
    w = _quantized(fmt, k, n, seed=m, activations=dtype)
    packed = pack_weight(w)
    per_row = 8 if fmt_.bits == 4 else 4
    assert packed.panels.shape == (-(-n // 32), k // per_row, 32, 4) and packed.in_features == k
    assert packed.panels.dtype == (jnp.uint8 if fmt_.bits == 4 else jnp.int8)
    np.testing.assert_array_equal(np.asarray(unpack_weight(packed)), np.asarray(dequantize(w)))
    x = jnp.asarray(np.random.default_rng(m + k).standard_normal((m, k)).astype(np.float32))
    ref = np.asarray(jax.jit(quantized_activation_matmul)(x, w))
    got = np.asarray(jax.jit(linear)(x, packed))
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, w)), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_0"])
def test_grouped_kernel_matches_the_reference(fmt, dtype):
    """A mixture of experts' projection with int8 (int16) activations: each expert's rows
    (x sorted by expert, an expert with none, rows past the groups zero) through the
    grouped kernel give the reference's, which is each expert's
    quantized_activation_matmul of its own rows."""
    experts = stack_experts([_quantized(fmt, 128, 40, seed=e, activations=dtype) for e in range(4)])
    x = jnp.asarray(np.random.default_rng(3).standard_normal((26, 128)).astype(np.float32))
    sizes = jnp.asarray([3, 0, 13, 7], jnp.int32)
    ref = np.asarray(jax.jit(grouped_linear)(x, experts, sizes))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for e in range(4):
        rows = slice(int(starts[e]), int(starts[e + 1]))
        np.testing.assert_allclose(ref[rows], np.asarray(quantized_activation_matmul(x[rows], experts.expert(e))),
                                   rtol=0, atol=1e-6 * np.abs(ref).max())
    assert not ref[23:].any()
    got = np.asarray(jax.jit(grouped_linear)(x, pack_weight(experts), sizes))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


BF16_FORMATS = ["q4_0", "q4_1", "int4", "int4_g32", "q8_0"]  # the dot layout's formats


def _tiles_here() -> list[str]:
    """The bfloat16 tiles this build holds: vdpbf16ps with AVX512_BF16, the float ones always."""
    from jaxllm import cpu_kernels

    return ["dot", "float"] if cpu_kernels.has_bf16_dot() else ["float"]


@pytest.mark.parametrize("m,k,n", [(1, 128, 32), (13, 256, 40), (97, 640, 96), (200, 128, 33)])
@pytest.mark.parametrize("fmt", BF16_FORMATS)
def test_bfloat16_from_the_dot_layout_is_the_float_layout_s_bfloat16(m, k, n, fmt):
    """A step's BF16_STEP mark: int16-marked 4-bit blocks multiplied in bfloat16 from their
    dot layout give, bit for bit, what the same blocks in the float layout give
    multiplied in bfloat16 (activation_quantization bfloat16: x and each dequantized
    weight rounded to bfloat16, float32 sums), by either tiles, dense and through the
    grouped kernel (`rows`); and within float32 rounding of the float64 product of the
    rounded values. INT16_STEP leaves the weights as they are."""
    per_row = 4 if fmt == "q8_0" else 8
    from jaxllm.models.linear import bf16_tiles
    from jaxllm.models.params import BF16_STEP, INT16_STEP

    w = _quantized(fmt, k, n, seed=m, activations="int16")
    dot = bf16_tiles(pack_weight(w), BF16_STEP)
    assert dot.activations == "bfloat16" and dot.panels.shape == (-(-n // 32), k // per_row, 32, 4)
    assert bf16_tiles(pack_weight(w), INT16_STEP).activations == "int16"
    flat = pack_weight(w.replace(activations="float", float_dtype="bfloat16"))
    x = jnp.asarray(np.random.default_rng(m + k).standard_normal((m, k)).astype(np.float32))
    rows = jnp.asarray(m - m // 3, jnp.int32)
    bf = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    exact = bf(x) @ bf(dequantize(w))
    for tiles in _tiles_here():
        want = np.asarray(jax.jit(linear)(x, flat.replace(bf16_tiles=tiles)))
        got = np.asarray(jax.jit(linear)(x, dot.replace(bf16_tiles=tiles)))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * np.abs(exact).max())
        want_rows = np.asarray(jax.jit(lambda a, b, r: linear(a, b, rows=r))(x, flat.replace(bf16_tiles=tiles), rows))
        got_rows = np.asarray(jax.jit(lambda a, b, r: linear(a, b, rows=r))(x, dot.replace(bf16_tiles=tiles), rows))
        np.testing.assert_array_equal(got_rows, want_rows)
        assert not got_rows[int(rows):].any()


def test_the_bfloat16_step_mark_leaves_other_weights_as_they_are():
    """BF16_STEP marks only int16-marked blocks (4-bit and Q8_0's int8 dot layout):
    int8-marked and float-layout blocks and plain panels keep their activations."""
    from jaxllm.models.linear import bf16_tiles
    from jaxllm.models.params import BF16_STEP

    weights = {"q4_1": pack_weight(_quantized("q4_1", 64, 32, activations="int16")),
               "q8_0": pack_weight(_quantized("q8_0", 64, 32, activations="int16")),
               "int8": pack_weight(_quantized("q4_1", 64, 32, activations="int8")),
               "float_blocks": pack_weight(_quantized("q4_1", 64, 32, activations="float")),
               "plain": pack_weight(jnp.ones((64, 32), jnp.float32))}
    marked = bf16_tiles(weights, BF16_STEP)
    assert {name: w.activations for name, w in marked.items()} == {
        "q4_1": "bfloat16", "q8_0": "bfloat16", "int8": "int8", "float_blocks": "float", "plain": "float"}


def test_which_weights_take_int8_activations():
    """Blocks of 32 inputs or a multiple (Q8_0, Q4_0, Q4_1, int4), experts too; not int8
    with scales per column, nor the gguf_int8 container (16 inputs)."""
    w = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    assert all(activation_quantization_ready(_quantized(f, 128, 64)) for f in FORMATS)
    assert not activation_quantization_ready(quantize_int8(w))
    container = quantize_grouped(w, QUANT_FORMATS["int4_g32"]).replace(group=16, bits=8)
    assert not activation_quantization_ready(container)
    experts = _quantized("q4_1", 128, 64).map_arrays(lambda a: jnp.stack([a, a]))
    assert activation_quantization_ready(experts)
    with pytest.raises(ValueError, match="int8/int16 activations: a .K, N. weight kept in blocks"):
        quantized_activation_matmul(jnp.ones((1, 128)), quantize_int8(w))


def test_marking_a_model_s_projections(test_models_dir):
    """quantized_activations marks each projection of a q4_1 model and the tied head's
    embedding (its lookups unchanged), abstract params too, and packs them so."""
    from jaxllm.models.linear import pack_params

    model = load_model(test_models_dir / "llama", "float32", quantization="q4_1")
    marked, count = quantized_activations(model.params)
    projections = sum(isinstance(w, QuantizedWeight) for lp in model.params.layers
                      for w in jax.tree.leaves(lp, is_leaf=lambda x: isinstance(x, QuantizedWeight)))
    assert count == projections and marked.layers[0].w_down.activations == "int8"
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
    _, abstract_count = quantized_activations(abstract)
    assert abstract_count == count
    marked16, count16 = quantized_activations(model.params, "int16")
    assert count16 == count and marked16.layers[0].w_down.activations == "int16"
    with pytest.raises(ValueError, match="'int4' is not one of int8, int16"):
        quantized_activations(model.params, "int4")
    packed = pack_params(marked)
    assert packed.layers[0].wqkv.activations == "int8" and packed.layers[0].wqkv.panels.ndim == 4


def _engine(path, **options):
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, n)]} for n in (5, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    llm = LLM(str(path), **(SMALL | options))
    tokens, logprobs = [], []
    for o in llm.generate(prompts, params, use_tqdm=False):
        tokens += o.outputs[0].token_ids
        logprobs += [lp.logprob for step in o.outputs[0].logprobs + o.prompt_logprobs[1:] for lp in step.values()]
    return llm, tokens, np.array(logprobs)


@pytest.mark.slow  # the kernel tests above check int8 activations by default, the auto test below the engine's path
def test_the_engine_with_int8_activations(test_models_dir, tmp_path):
    """A Q4_1 GGUF (the default SmolLM2's format; its embedding Q8_0, the tied head) with
    int8 activations: the kernel gives the tokens of the jnp reference (the `xla`
    backend) and its logprobs to float rounding; the start-up line says how many
    projections take int8 (that they differ from float activations: the kernel tests). (The two backends' float sums
    differ in their last bits, and now and then that moves an input across a rounding
    boundary of its int8 step: a position's logprobs then differ by ~1e-2 (0.13 once on an
    Intel Xeon, where XLA's sums take another path), so all but a few must agree to 2e-4
    and none may differ by more than 0.25.)"""
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf", "Q4_1")
    llm, tokens, logprobs = _engine(path, activation_quantization="int8", linear_backend="cpu")
    _, ref_tokens, ref_logprobs = _engine(path, activation_quantization="int8", linear_backend="xla")
    assert tokens == ref_tokens
    close = np.abs(logprobs - ref_logprobs) <= 2e-4
    assert close.mean() > 0.95, np.abs(logprobs - ref_logprobs).max()
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=0.25)
    assert "int8 activations into" in llm.llm_engine.core.runner.describe_weights()


def test_auto_is_int16_on_the_cpu_kernel_and_float_elsewhere(test_models_dir, tmp_path, monkeypatch):
    """The default, activation_quantization "auto", on a CPU without AMX (patched so here:
    with AMX it is bfloat16, the test below): a Q4_1 GGUF on the cpu kernel (built
    with AVX2 or AVX512_VNNI here) multiplies int16 activations and says so at start-up;
    it gives the tokens of float activations (the kernel multiplying in float32), its
    logprobs within 2e-3 of them and not equal (float activations are 1e-3 away on this
    random model, int8 ones 0.28; the kernel against the jnp reference of int16
    activations: test_kernel_matches_the_reference). Under XLA's dot, for a bfloat16
    model, and for a float model (nothing kept in blocks) "auto" is float (the choice
    itself: auto_activation_quantization). Both keep a float32 KV cache (with int16
    activations it is bfloat16 by default: test_kv_cache_dtype_auto)."""
    import make_test_model

    from jaxllm import cpu_kernels
    from jaxllm.models.linear import auto_activation_quantization

    assert cpu_kernels.has_integer_dot()  # x86-64 builds: AVX2 or AVX512_VNNI (the SSE2 build: test_kernel_builds)
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: False)
    # int16 at every step: no bucket in bfloat16 (BF16_STEP, where measured faster: the test below)
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: False)
    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf", "Q4_1")
    llm, tokens, logprobs = _engine(path, kv_cache_dtype="float32")
    _, float_tokens, float_logprobs = _engine(path, activation_quantization="none", **REFERENCE)
    assert tokens == float_tokens
    np.testing.assert_allclose(logprobs, float_logprobs, rtol=0, atol=2e-3)
    assert np.abs(logprobs - float_logprobs).max() > 0  # int16 is not float
    runner = llm.llm_engine.core.runner
    assert runner.activation_quantization == "int16"
    assert "int16 activations into" in runner.describe_weights()
    assert "(auto: this CPU's kernels have integer dot products;" in runner.describe_weights()
    assert runner.weights["cpu"].layers[0].wqkv.activations == "int16"
    model = load_model(path, "float32")
    assert auto_activation_quantization(model.params, ["cpu"], "cpu", jnp.float32) == "int16"
    assert auto_activation_quantization(model.params, ["cpu"], "cpu", jnp.bfloat16) is None
    assert auto_activation_quantization(model.params, ["cpu", "xla"], "cpu", jnp.float32) is None
    assert auto_activation_quantization(model.params, ["cpu"], "xla", jnp.float32) is None
    assert auto_activation_quantization(load_model(test_models_dir / "llama", "float32").params, ["cpu"], "cpu",
                                        jnp.float32) is None
    assert EngineConfig().activation_quantization == "auto"
    assert EngineConfig(activation_quantization=None).activation_quantization == "none"


def test_auto_multiplies_its_int16_blocks_in_bfloat16_at_the_buckets_measured_faster(test_models_dir, tmp_path,
                                                                                      monkeypatch):
    """`auto` on a CPU with vdpbf16ps and no AMX (a Zen 4; patched so here, and on a build
    without AVX512_BF16 the float tiles give the same sums): the plan times the int16
    blocks as they are and in bfloat16 from the same arrays (BF16_STEP), per bucket. A
    plan that takes bfloat16 at the larger buckets marks their steps' weights, and the
    start-up line says where; one that takes it everywhere gives, bit for bit, the tokens
    and logprobs of activation_quantization bfloat16 (the float layout's blocks). An
    untied model: activation_quantization bfloat16 rounds a tied table's lookups to
    bfloat16 too, where BF16_STEP's lookups are float32 at every bucket, as int16's."""
    import make_test_model

    from jaxllm import cpu_kernels
    from jaxllm.models.params import BF16_STEP, INT16_STEP, PackedWeight

    class FakeTimer:  # bfloat16 from `faster_from` rows
        faster_from = 1

        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, kind, backend, t, s):
            return {"cpu/int16": 2.0, "cpu/bfloat16": 1.0 if t >= self.faster_from else 3.0}.get(backend, 1.0)

    monkeypatch.setattr(autotune, "StepTimer", FakeTimer)
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: True)
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: False)
    path = make_test_model.write_gguf(test_models_dir / "mistral", tmp_path / "mistral.gguf", "Q4_1")
    # each engine its own store (plans are stored by what they measure); single decode steps:
    # no decode loops to compile (the steps' weights are what differs)
    options = dict(kv_cache_dtype="float32") | REFERENCE
    llm, tokens, logprobs = _engine(path, compilation_cache_dir=str(tmp_path / "everywhere"), **options)
    runner = llm.llm_engine.core.runner
    assert runner.activation_quantization == "int16"
    assert {c.bf16_tiles for c in runner.plan.choices} == {BF16_STEP}
    _, want_tokens, want_logprobs = _engine(path, compilation_cache_dir=str(tmp_path / "bf16"),
                                            activation_quantization="bfloat16", **options)
    assert tokens == want_tokens
    np.testing.assert_array_equal(logprobs, want_logprobs)

    FakeTimer.faster_from = 32
    llm = LLM(str(path), **(SMALL | options | dict(compilation_cache_dir=str(tmp_path / "larger"))))
    runner = llm.llm_engine.core.runner
    picks = dict(zip(runner.plan.buckets, (c.bf16_tiles for c in runner.plan.choices)))
    assert picks[1] == INT16_STEP and picks[64] == BF16_STEP

    def acts(t):
        return {w.activations for w in jax.tree.leaves(runner.weights_of(runner.plan.for_bucket(t)),
                                                       is_leaf=lambda x: isinstance(x, PackedWeight))
                if isinstance(w, PackedWeight) and w.activations != "float"}

    assert acts(1) == {"int16"} and acts(64) == {"bfloat16"}
    assert "kept blocks' activations int16 at T=1-" in llm.llm_engine.core.describe()
    assert "bfloat16 at T=" in llm.llm_engine.core.describe()


def test_bfloat16_activations_and_auto_where_the_cpu_has_amx(test_models_dir, tmp_path, monkeypatch):
    """activation_quantization "bfloat16": a float32 model's Q4_1 blocks multiply x and
    each dequantized weight rounded to bfloat16, float32 sums (AMX's tiles where the CPU
    has them, else vdpbf16ps or the float tiles): the kernel gives the tokens of the jnp
    reference (the `xla` backend multiplying the same bfloat16 values in XLA's dot) and
    its logprobs to float rounding (a sum's last bits now and then move an input across a
    bfloat16 rounding boundary: all but a few within 2e-4; that bfloat16 sums are not
    float's: the kernel tests). "auto" takes it where the CPU kernel has AMX (`has_amx`, patched so here: every
    machine runs this path, on its own tiles), keeps a bfloat16 KV cache, and the
    start-up line says so."""
    import make_test_model

    from jaxllm import cpu_kernels
    from jaxllm.models.linear import auto_activation_quantization

    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: True)
    # every step in bfloat16, as the reference's: no bucket multiplying the blocks in float32 (NO_BF16,
    # where measured faster: tests/worker/test_autotune.py)
    candidates = autotune.bf16_tile_candidates
    monkeypatch.setattr(autotune, "bf16_tile_candidates", lambda *a, **k: [t for t in candidates(*a, **k) if t != "none"])
    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf", "Q4_1")
    llm, tokens, logprobs = _engine(path)
    runner = llm.llm_engine.core.runner
    assert runner.activation_quantization == "bfloat16" and runner.kv_format.name == "bfloat16"
    assert "bfloat16 activations into" in runner.describe_weights()
    assert "(auto: this CPU has AMX;" in runner.describe_weights()
    assert runner.weights["cpu"].layers[0].wqkv.float_dtype == "bfloat16"
    _, ref_tokens, ref_logprobs = _engine(path, activation_quantization="bfloat16", linear_backend="xla",
                                          kv_cache_dtype="bfloat16", **REFERENCE)
    assert tokens == ref_tokens
    assert (np.abs(logprobs - ref_logprobs) <= 2e-4).mean() > 0.95, np.abs(logprobs - ref_logprobs).max()
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=0.05)
    model = load_model(path, "float32")
    assert auto_activation_quantization(model.params, ["cpu"], "cpu", jnp.float32) == "bfloat16"
    assert auto_activation_quantization(model.params, ["cpu"], "cpu", jnp.bfloat16) is None


@pytest.mark.slow  # the grouped kernel's own test runs by default
def test_a_mixture_of_experts_with_int8_activations(test_models_dir):
    """Qwen3-MoE quantized to q4_1 at load with int8 activations: the experts through the
    grouped kernel give the tokens of the reference (every expert for every row, the
    `xla` backend) and, but for the odd rounding-boundary position, its logprobs."""
    path = test_models_dir / "qwen3_moe"
    llm, tokens, logprobs = _engine(path, quantization="q4_1", activation_quantization="int8", linear_backend="cpu")
    _, ref_tokens, ref_logprobs = _engine(path, quantization="q4_1", activation_quantization="int8",
                                          linear_backend="xla")
    assert tokens == ref_tokens
    assert (np.abs(logprobs - ref_logprobs) <= 2e-4).mean() > 0.95
    layer = llm.llm_engine.core.runner.weights["cpu"].layers[0]
    assert layer.w_gate_up.activations == "int8" and layer.w_gate_up.experts > 0


def test_activation_quantization_is_refused_where_it_cannot_apply(test_models_dir):
    """A float model (no projection kept in blocks), the pallas backend, and an unknown
    name are refused, saying why."""
    for dtype in ACTIVATIONS:
        with pytest.raises(ValueError, match=f"activation_quantization '{dtype}': the model has no projection kept"):
            LLM(str(test_models_dir / "llama"), activation_quantization=dtype, **SMALL)
    with pytest.raises(ValueError, match="not with linear_backend 'pallas'"):
        LLM(str(test_models_dir / "llama"), activation_quantization="int8", quantization="q4_1",
            linear_backend="pallas", **SMALL)
    with pytest.raises(ValueError, match="activation_quantization: unknown 'int4'"):
        EngineConfig(activation_quantization="int4")


def test_kv_cache_dtype_auto(test_models_dir, tmp_path, monkeypatch):
    """kv_cache_dtype "auto" is the model's dtype (as vLLM's), except bfloat16 for a
    float32 model whose projections are kept in blocks of 32 multiplying quantized
    activations: the defaults of a GGUF file on this CPU. Float activations
    (`activation_quantization none`), XLA's dot, a dequantized or float checkpoint, a
    bfloat16 model and an explicit dtype keep what they had; read from abstract params,
    before anything is measured or compiled. The engine sizes its cache and runs its
    runner in the format chosen, and its start-up line says why."""
    import jax.numpy as jnp
    import make_test_model

    from jaxllm import cpu_kernels
    from jaxllm.attention.kv_cache import choose_kv_cache_format
    from jaxllm.engine.config import EngineConfig
    from jaxllm.engine.core import EngineCore
    from jaxllm.loaders import load_model
    from jaxllm.models.linear import rounds_activations
    from jaxllm.models.params import abstract_params

    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: False)  # auto: int16 (bfloat16 on AMX: the same cache)
    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf", "Q4_1")

    def chosen(kv="auto", activations="auto", linear="auto", quantization=None, dtype=jnp.float32):
        params = abstract_params(load_model(str(path), "float32", quantization=quantization).config, dtype)
        fmt, why = choose_kv_cache_format(kv, params.final_norm.dtype, rounds_activations(params, activations, linear))
        return fmt.name, why

    assert chosen() == ("bfloat16", "auto: the projections' blocks and activations round more")
    assert chosen(activations="int8", linear="cpu")[0] == "bfloat16"
    assert chosen(activations="bfloat16", linear="cpu")[0] == "bfloat16"
    assert chosen(activations="none") == ("float32", "auto: the model's dtype")
    assert chosen(activations=None)[0] == "float32"
    assert chosen(linear="xla")[0] == "float32"
    assert chosen(quantization="none")[0] == "float32"  # dequantized: nothing kept in blocks
    assert chosen(dtype=jnp.bfloat16)[0] == "bfloat16"  # the model's dtype anyway
    assert chosen(kv="float32") == ("float32", "as asked")
    assert chosen(kv="int8")[0] == "int8"
    core = EngineCore(EngineConfig(model=str(path), attention_backend="cpu", linear_backend="cpu", max_model_len=256,
                                   kv_cache_memory="8MiB", compilation_cache_dir=str(tmp_path / "xla"), warm_up=False))
    assert core.runner.kv_format.name == "bfloat16" and core.runner.activation_quantization == "int16"
    assert core.cache.num_blocks == (8 << 20) // (16 * 2 * 2 * core.runner.config.num_layers * core.runner.config.num_kv_heads
                                               * core.runner.config.head_dim)
    assert "KV cache (bfloat16, auto: the projections' blocks and activations round more)" in core.describe()
    core.close()
