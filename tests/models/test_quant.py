"""Weight-only int8 (jaxllm.models.quant): the arithmetic, what the declaration
quantizes, and the engine on it against the float engine on the same (fake-quantized)
weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import CHECKPOINT_METHODS, QUANTIZATIONS
from jaxllm.engine.config import EngineConfig
from jaxllm.loaders import load_model, peek_model_config
from jaxllm.loaders.hf import save_hf_folder
from jaxllm.models.linear import linear, pack_weight
from jaxllm.models.params import QUANT_FORMATS, QuantizedWeight, abstract_params, declare, map_declared
from jaxllm.models.quant import (
    GGUF_INT8_TYPES,
    MIXED_GGUF_FORMATS,
    dequantize,
    gguf_container_parts,
    mixed_gguf_format,
    param_bytes,
    quantize_blocks,
    quantize_grouped,
    quantize_int8,
    quantize_params,
    quantized_config,
)
from tests.support import multidevice
from tests.support.llm import SMALL, engine_numbers
from tests.support.models import ARCHITECTURES, MOE


def test_int8_rounds_each_column_to_its_own_scale():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 24)).astype(np.float32) * rng.uniform(0.01, 3, 24).astype(np.float32)
    w[:, 5] = 0.0
    qw = quantize_int8(w)
    assert qw.q.dtype == np.int8 and qw.scale.dtype == np.float32 and qw.scale.shape == (24,)
    assert qw.scale[5] == 1.0 and not qw.q[:, 5].any()
    np.testing.assert_array_equal(np.abs(qw.q).max(axis=0)[np.arange(24) != 5], 127)
    err = np.abs(np.asarray(dequantize(qw)) - w)
    assert (err <= qw.scale / 2 * (1 + 1e-6)).all()
    on_device = quantize_int8(jnp.asarray(w))  # the same numbers from jnp (weights on a device)
    np.testing.assert_array_equal(np.asarray(on_device.q), qw.q)
    np.testing.assert_array_equal(np.asarray(on_device.scale), qw.scale)


@pytest.mark.parametrize("name", ["int4", "int4_g32", "int8_g64"])
def test_int4_rounds_each_group_to_its_own_scale_and_min(name):
    """Asymmetric 4-bit (8-bit) per group of inputs: each group's min is exact (its q is
    0; 8-bit: -128 and the min shifted by 128 steps, so within rounding), every weight
    within half its group's step, a constant group exact; numpy and jnp give the same
    numbers (XLA may divide by 15 as a multiplication: the scales to an ulp)."""
    fmt = QUANT_FORMATS[name]
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 24)).astype(np.float32) * rng.uniform(0.01, 3, 24).astype(np.float32)
    w[: fmt.group, 5] = 0.25  # a constant group
    qw = quantize_grouped(w, fmt)
    assert qw.q.dtype == np.int8 and qw.bits == fmt.bits and qw.group == fmt.group and qw.group_axis == 0
    low, high = (0, 15) if fmt.bits == 4 else (-128, 127)
    assert qw.scale.shape == qw.mins.shape == (256 // fmt.group, 24) and low <= qw.q.min() and qw.q.max() == high
    deq = np.asarray(dequantize(qw))
    steps = np.repeat(qw.scale, fmt.group, axis=0)
    assert (np.abs(deq - w) <= steps / 2 * (1 + 1e-5) + 1e-6 * np.abs(w)).all()
    group_min = lambda a: a.reshape(-1, fmt.group, 24).min(axis=1)
    np.testing.assert_allclose(group_min(deq), group_min(w), rtol=0 if fmt.bits == 4 else 1e-6, atol=0)
    np.testing.assert_array_equal(deq[: fmt.group, 5], 0.25)
    on_device = quantize_grouped(jnp.asarray(w), fmt)
    np.testing.assert_array_equal(np.asarray(on_device.q), qw.q)
    # 8-bit: the min moved by 128 scales, whose ulp moves it by 128 of its own
    np.testing.assert_allclose(np.asarray(on_device.mins), qw.mins, rtol=0,
                               atol=0 if fmt.bits == 4 else 256 * np.finfo(np.float32).eps * np.abs(qw.mins).max())
    np.testing.assert_allclose(np.asarray(on_device.scale), qw.scale, rtol=1e-6, atol=0)


def test_int4_of_a_model_whose_inputs_the_group_does_not_divide_is_refused(test_models_dir):
    with pytest.raises(ValueError, match="quantization 'int4': model.layers.0.self_attn.q_proj.weight has 96 "
                                         "inputs, not a multiple of 128 \\(its group\\) \\('int4_g32' groups 32\\)"):
        load_model(test_models_dir / "qwen3", "float32", quantization="int4")


def test_quantized_linear_is_the_matmul_of_the_dequantized_weight():
    rng = np.random.default_rng(1)
    qw = quantize_int8(jnp.asarray(rng.standard_normal((96, 40)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((7, 96)), jnp.float32)
    want = np.asarray(jnp.matmul(x, dequantize(qw), precision="highest"))
    got = np.asarray(jax.jit(linear)(x, qw))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_declaration_says_what_is_quantized(test_models_dir, name):
    """The projections (an untied output projection too; a mixture's experts, not its
    router), never the embedding or the norms; loading gives exactly the abstract
    params' shapes and dtypes."""
    model = load_model(test_models_dir / name, "float32", quantization="int8")
    cfg = model.config
    assert cfg.quantization == "int8"
    quantized = map_declared(lambda decl: decl.quant == "int8", declare(cfg))
    layer = quantized.layers[0]
    assert layer.wqkv and layer.wo and layer.w_gate_up and layer.w_down
    assert not (quantized.embed or layer.attn_norm or layer.mlp_norm or quantized.final_norm or layer.router)
    assert quantized.lm_head is None if cfg.tie_word_embeddings else quantized.lm_head
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype).name), tree)
    assert shapes(model.params) == shapes(abstract_params(cfg, jnp.float32))
    assert isinstance(model.params.layers[0].wqkv, QuantizedWeight)
    full = load_model(test_models_dir / name, "float32")
    assert param_bytes(model.params) < 0.6 * param_bytes(full.params)


def _fake_quantized_folder(src, dst, quantization="int8"):
    """An HF folder whose projections are their `quantization` round trip (float32
    values that format holds exactly, up to the scale's rounding)."""
    model = load_model(src, "float32")
    cfg = quantized_config(model.config, quantization)
    dequantized = jax.tree.map(lambda w: np.asarray(dequantize(w)) if isinstance(w, QuantizedWeight) else w,
                               quantize_params(cfg, model.params), is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return save_hf_folder(dst, model.config, dequantized, model.tokenizer)


# int8's engine also runs in the default tensor-parallel logits test; int4's kernel path
# in tests/models/test_linear.py (the 4-bit panels with 128-input groups) and its rounding above
@pytest.mark.parametrize("quant", [pytest.param(q, marks=pytest.mark.slow) for q in ("int8", "int4", "int4_g32")])
def test_the_quantized_engine_equals_the_float_engine_on_fake_quantized_weights(test_models_dir, tmp_path, quant):
    """The oracle: the float engine on weights already rounded to the format (int8 x
    scale; int4's scale x q + min). Greedy tokens identical, logprobs within 1e-4; and
    the format from the original checkpoint is the same model (quantizing is
    idempotent)."""
    folder = _fake_quantized_folder(test_models_dir / "llama", tmp_path / "fq", quant)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, n)]} for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for key, path, quantization in (("float", folder, None), (quant, folder, quant),
                                    (f"{quant}-original", test_models_dir / "llama", quant)):
        llm = LLM(str(path), quantization=quantization, **SMALL)
        runs[key] = llm.generate(prompts, params, use_tqdm=False)
        if quantization:
            assert "weights" in llm.llm_engine.core.describe() and f"({quant} " in llm.llm_engine.core.describe()
    for other in (quant, f"{quant}-original"):
        for a, b in zip(runs["float"], runs[other]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, other
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                for t in set(x) & set(y):
                    assert abs(x[t].logprob - y[t].logprob) < 1e-4, (other, t)


@pytest.mark.parametrize("name,quantization", [pytest.param("qwen2", "int8", marks=pytest.mark.slow),
                                               pytest.param("qwen2", "q8_0", marks=pytest.mark.slow),
                                               pytest.param("qwen2", "q4_1", marks=pytest.mark.slow),  # 16 s
                                               pytest.param("qwen3_moe", "int8", marks=pytest.mark.slow)])
def test_quantized_weights_shard_for_tensor_parallelism(test_models_dir, name, quantization):
    """Values split like the float weight, scales (and Q4_1's mins) with their output
    columns (and the block formats' with their input groups too; a mixture's experts
    each so): TP=2 logits equal one device's."""
    multidevice.run("tp_logits_match", str(test_models_dir / name), "2", "cpu", quantization, devices=2)


@pytest.mark.slow  # 12 s; the q4_1 case above shards the same formats quantized at load
def test_a_kept_gguf_with_its_embedding_shards_for_tensor_parallelism(test_models_dir, tmp_path):
    """Kept Q4_1 blocks, the embedding's too (vocabulary-parallel rows and scales, the
    tied output projection from them): TP=2 logits equal one device's."""
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "l.gguf", "Q4_1")
    multidevice.run("tp_logits_match", str(path), "2", "cpu", "q4_1", devices=2)


def test_an_unknown_quantization_is_refused_naming_the_choices(test_models_dir):
    with pytest.raises(ValueError, match="quantization: unknown 'int3'.*int8"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization: unknown 'int3'"):
        load_model(test_models_dir / "llama", "float32", quantization="int3")


def test_auto_runs_int8_weights_on_the_kernel_alone():
    """XLA's dot converts a whole int8 matrix per call: `auto` does not measure it
    against the kernel for quantized weights (an explicit xla still runs it)."""
    from jaxllm.models.linear import linear_candidates

    assert linear_candidates("auto", jnp.float32, quantized=True) == ["cpu"]
    assert linear_candidates("xla", jnp.float32, quantized=True) == ["xla"]
    assert linear_candidates("auto", jnp.float32) == ["cpu", "xla"]


def test_the_formats_are_the_config_s_choices():
    assert set(QUANT_FORMATS) == set(QUANTIZATIONS) - {None, "none", *CHECKPOINT_METHODS}


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_the_block_formats_are_gguf_s_own_quantizer(name):
    """quantize_blocks' blocks dequantize, by gguf's own code, to what dequantize gives:
    Q4_1's d * q + m rounded twice, as numpy does, never fused."""
    import gguf

    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    fmt = QUANT_FORMATS[name]
    qw = quantize_blocks(w, fmt)
    assert qw.group == 32 and qw.q.shape == (64, 48) and qw.scale.shape == (2, 48) and qw.bits == fmt.bits
    assert (qw.mins is not None) == fmt.mins and qw.q.min() >= (0 if fmt.mins else -(2 ** (fmt.bits - 1)))
    assert qw.q.max() < (2 ** fmt.bits if fmt.mins else 2 ** (fmt.bits - 1))
    kind = gguf.GGMLQuantizationType[name.upper()]
    theirs = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(w.T), kind), kind).T
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), theirs)
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(qw.map_arrays(jnp.asarray))), theirs)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight has 40 inputs, not a multiple of 32"):
        quantize_blocks(w[:40], fmt, "model.layers.0.mlp.down_proj.weight")


# Q8_0's blocks also run in the default mixed-types test (its v projection and embedding)
@pytest.mark.parametrize("name,tensor_type", [pytest.param("llama", "Q8_0", marks=pytest.mark.slow), ("llama", "Q4_1"),
                                              pytest.param("llama", "Q4_0", marks=pytest.mark.slow),
                                              pytest.param("qwen2", "Q8_0", marks=pytest.mark.slow)])
# llama: tied embeddings and RoPE row order; qwen2: an untied head, biases. Both backends by default on the
# Q4_1 file (the embedded SmolLM2's format): this is the default run's one check of XLA's dot over kept blocks
# in a whole model (test_smollm2's greedy test runs the embedded model on the kernels, as the engine does)
@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_a_block_quantized_gguf_is_kept_packed_and_bit_identical(test_models_dir, tmp_path, name, tensor_type,
                                                                  backend):
    """A GGUF whose projections are Q8_0 (Q4_0, Q4_1) keeps those blocks (integer
    values, float32 scales and mins per 32 inputs) and gives the very logprobs of the
    same file dequantized at load (quantization="none"), through the kernel and (slow)
    through XLA's dot; the weights take well under half the bytes (the kernel's 4-bit
    panels a quarter of the float ones)."""
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / name, tmp_path / f"{name}.gguf", tensor_type)
    kept, dequantized = load_model(path, "float32"), load_model(path, "float32", quantization="none")
    fmt = QUANT_FORMATS[tensor_type.lower()]
    assert kept.config.quantization == fmt.name and dequantized.config.quantization is None
    w_down = kept.params.layers[0].w_down
    assert isinstance(w_down, QuantizedWeight) and w_down.group == 32 and w_down.bits == fmt.bits
    assert param_bytes(kept.params) < 0.5 * param_bytes(dequantized.params)
    packed, floats = pack_weight(w_down), pack_weight(dequantized.params.layers[0].w_down)
    assert packed.panels.nbytes == floats.panels.nbytes * fmt.bits // 32
    np.testing.assert_array_equal(engine_numbers(path, None, backend), engine_numbers(path, "none", backend))


@pytest.mark.slow  # 27 s: the bfloat16 engine twice; float32 kept GGUFs are checked bit-identical by default
def test_a_kept_gguf_in_bfloat16_is_the_file_dequantized_to_bfloat16(test_models_dir, tmp_path):
    """`dtype="bfloat16"` over kept Q4_1 blocks (the default SmolLM2's format) computes
    what the same file dequantized to bfloat16 at load computes, bit for bit through the
    kernel (x and the weights rounded to bfloat16, float32 sums: vdpbf16ps where the CPU
    has it), and not what float32 computes; XLA's dot (its converts may keep excess
    precision) comes within bfloat16's rounding of it."""
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf", "Q4_1")
    kept = engine_numbers(path, None, "cpu", dtype="bfloat16")
    np.testing.assert_array_equal(kept, engine_numbers(path, "none", "cpu", dtype="bfloat16"))
    assert not np.array_equal(kept, engine_numbers(path, None, "cpu"))
    np.testing.assert_allclose(engine_numbers(path, None, "xla", dtype="bfloat16"), kept, rtol=0, atol=0.05)


# Experts quantized at load: all in the slow run (the 15-minute budget); by default qwen3_moe's GGUF keeps its
# blocks through the same grouped kernel (below), and the grouped int8 kernel has its own test
@pytest.mark.parametrize("name,quantization", [pytest.param("qwen3_moe", "q4_1", marks=pytest.mark.slow),
                                               pytest.param("qwen2_moe", "int8", marks=pytest.mark.slow),
                                               pytest.param("mixtral", "q8_0", marks=pytest.mark.slow)])
def test_a_mixture_of_experts_is_quantized_at_load(test_models_dir, name, quantization):
    """`quantization` on a Mixture-of-Experts checkpoint quantizes every expert (each its
    own projection, stacked) and Qwen2-MoE's shared expert at load, the router kept as
    it is; the grouped kernel over the quantized experts and XLA's path (the experts
    dequantized, ragged_dot) give the same tokens and logprobs within float rounding."""
    path = test_models_dir / name
    model, floats = load_model(path, "float32", quantization=quantization), load_model(path, "float32")
    lp = model.params.layers[0]
    assert isinstance(lp.w_gate_up, QuantizedWeight) and lp.w_gate_up.shape[0] == model.config.num_experts
    assert isinstance(lp.w_down, QuantizedWeight) and not isinstance(lp.router, QuantizedWeight)
    if lp.shared_down is not None:
        assert isinstance(lp.shared_down, QuantizedWeight)
    assert param_bytes(model.params) < 0.6 * param_bytes(floats.params)
    np.testing.assert_allclose(engine_numbers(path, quantization, "cpu"), engine_numbers(path, quantization, "xla"),
                               rtol=0, atol=2e-4)


def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type (no Python quantizer for the K-quants), with sane
    float16 headers (small scales of either sign, small mins)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    halves = lambda k: rng.uniform(-0.05, 0.05, (len(blocks), k)).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":  # d last
        blocks[:, -2:] = halves(1)
    else:  # d (and a min or d_min) first
        header = 2 if type_name in ("Q8_0", "Q4_0", "Q5_0") else 4
        blocks[:, :header] = halves(header // 2)
    return blocks


@pytest.mark.parametrize("type_name", GGUF_INT8_TYPES)
def test_the_gguf_int8_container_holds_every_weight_exactly(type_name):
    """Each type a GGUF of mixed types keeps in the gguf_int8 container (int8 values, a
    scale and min per 16 inputs) dequantizes to gguf's own floats, bit for bit, and the
    kernel's sums over it are those over the same floats packed as float32 (one tile:
    converted in registers; several: the panel converted once)."""
    import gguf

    rows, cols = 70, 512  # [out, in] as the file holds it
    blocks = _random_blocks(type_name, rows, cols)
    theirs = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
    qw = gguf_container_parts(blocks, type_name, rows, cols, "gguf_int8")
    assert qw.q.dtype == np.int8 and qw.group == 16 and qw.scale.shape == qw.mins.shape == (rows, cols // 16)
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), theirs)
    w = qw.transposed()  # [in, out], grouped along the inputs, as a projection is held
    packed, floats = pack_weight(w), pack_weight(jnp.asarray(theirs.T))
    rng = np.random.default_rng(1)
    for m in (1, 30):
        x = jnp.asarray(rng.standard_normal((m, cols)), jnp.float32)
        np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x, packed)), np.asarray(jax.jit(linear)(x, floats)))


@pytest.mark.parametrize("type_name,fmt", [(t, fmt) for allowed, fmt in MIXED_GGUF_FORMATS for t in sorted(allowed)])
def test_a_tighter_container_holds_its_types_exactly(type_name, fmt):
    """Each type a mixed GGUF's projection may hold in a container tighter than gguf_int8
    (Q4_K as int4_g32's 4-bit values and float32 scale and min per 32, Q5_0 as q8_0's
    int8 values and float16 scale...) dequantizes to gguf's own floats, bit for bit, in
    the container's bytes, and the kernel's sums over it are those over the floats."""
    import gguf

    rows, cols = 70, 512
    blocks = _random_blocks(type_name, rows, cols)
    theirs = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
    qw = gguf_container_parts(blocks, type_name, rows, cols, fmt)
    form = QUANT_FORMATS[fmt]
    assert (qw.group, qw.bits, qw.mins is not None, qw.scale.dtype.name) == (
        form.group, form.bits, form.mins, form.scale_dtype)
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), theirs)
    packed, floats = pack_weight(qw.transposed()), pack_weight(jnp.asarray(theirs.T))
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    assert nbytes(packed) < (0.2 if form.bits == 4 else 0.3) * nbytes(floats)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, cols)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x, packed)), np.asarray(jax.jit(linear)(x, floats)))


def test_a_mixed_gguf_projection_takes_the_tightest_exact_container():
    assert [mixed_gguf_format(t) for t in ({"Q4_K"}, {"Q4_K", "Q4_1"}, {"Q5_0", "Q8_0"}, {"Q4_0"}, {"Q4_0", "Q8_0"},
                                           {"Q4_1"}, {"Q4_K", "Q6_K"}, {"Q5_1"}, {"Q4_K", "Q5_0"})] == [
        "int4_g32", "int4_g32", "q8_0", "q4_0", "q8_0", "q4_1", "gguf_int8", "gguf_int8", "gguf_int8"]
    with pytest.raises(ValueError, match="GGUF type Q6_K is not held exactly as int4_g32"):
        gguf_container_parts(_random_blocks("Q6_K", 2, 256), "Q6_K", 2, 256, "int4_g32")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_a_gguf_of_mixed_types_is_kept_exactly(test_models_dir, tmp_path, backend):
    """Projections of several block types (Q5_0, Q8_0 v, Q5_1 down, Q4_1 o: the mix of
    a Q4_K_M file) are kept each in the tightest container that holds its parts exactly
    (q | k | v of Q5_0 and Q8_0 as q8_0, o as its Q4_1 blocks, down in gguf_int8), the
    Q8_0 embedding as its own blocks, in the abstract params' shapes (a conversion
    restores them), and give the very logprobs of the file dequantized at load, in well
    under half the bytes."""
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "mixed.gguf", "Q5_0",
                                      {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q5_1", "attn_output.weight": "Q4_1",
                                       "token_embd.weight": "Q8_0"})
    kept, dequantized = load_model(path, "float32"), load_model(path, "float32", quantization="none")
    cfg = kept.config
    assert (cfg.quantization, cfg.embed_quantization) == ("gguf_int8", "q8_0")
    assert dequantized.config.quantization is None
    layer = kept.params.layers[0]
    held = {name: (w.group, w.bits, w.mins is not None, w.scale.dtype.name) for name, w in (
        ("wqkv", layer.wqkv), ("wo", layer.wo), ("gate_up", layer.w_gate_up), ("down", layer.w_down))}
    assert held == {"wqkv": (32, 8, False, "float16"), "gate_up": (32, 8, False, "float16"),
                    "wo": (32, 4, True, "float16"), "down": (16, 8, True, "float32")}
    assert dict(cfg.tensor_quantization)["model.layers.0.self_attn.q_proj.weight"] == "q8_0"
    assert dict(cfg.tensor_quantization)["model.layers.0.self_attn.o_proj.weight"] == "q4_1"
    assert "model.layers.0.mlp.down_proj.weight" not in dict(cfg.tensor_quantization)  # gguf_int8, the default
    assert kept.params.embed.group == 32
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype).name), tree)
    assert shapes(kept.params) == shapes(abstract_params(cfg, jnp.float32))
    assert param_bytes(kept.params) < 0.5 * param_bytes(dequantized.params)
    cache = tmp_path / "converted"
    load_model(path, "float32", conversion_cache_dir=cache)
    again = load_model(path, "float32", conversion_cache_dir=cache)  # restored from the conversion
    for a, b in zip(jax.tree.leaves(kept.params), jax.tree.leaves(again.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(engine_numbers(path, None, backend), engine_numbers(path, "none", backend))


def test_gguf_int8_of_float_weights_is_refused(test_models_dir):
    with pytest.raises(ValueError, match="'gguf_int8' is how a GGUF of mixed block types keeps its blocks"):
        load_model(test_models_dir / "llama", "float32", quantization="gguf_int8")


def test_int8_of_a_q8_0_gguf_is_refused(test_models_dir, tmp_path):
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "q.gguf", "Q8_0")
    with pytest.raises(ValueError, match="holds its projections as Q8_0.*would re-quantize"):
        load_model(path, "float32", quantization="int8")
    assert load_model(path, "float32", quantization="q8_0").config.quantization == "q8_0"


def test_the_conversion_cache_keeps_blocks_as_blocks(test_models_dir, tmp_path):
    """A Q4_1 GGUF's conversion holds its blocks as they are (a warm start neither
    parses the file nor turns them into floats) and restores bit-identical arrays; its
    dequantized load ("none") has a key of its own; asking another quantization of the
    converted blocks is refused as for the file."""
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "q.gguf", "Q4_1")
    cache = tmp_path / "converted"
    first = load_model(path, conversion_cache_dir=cache)
    assert first.config.quantization == "q4_1" and len(list(cache.iterdir())) == 1
    assert peek_model_config(path, conversion_cache_dir=cache).quantization == "q4_1"
    again = load_model(path, conversion_cache_dir=cache)
    assert again.config.quantization == "q4_1" and isinstance(again.params.layers[0].wo, QuantizedWeight)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="holds its projections as Q4_1.*would re-quantize"):
        load_model(path, conversion_cache_dir=cache, quantization="int8")
    assert load_model(path, conversion_cache_dir=cache, quantization="none").config.quantization is None
    assert len(list(cache.iterdir())) == 2


def test_a_conversion_of_another_format_is_not_restored(test_models_dir, tmp_path, monkeypatch):
    """A conversion written when jaxllm kept other tensors as blocks (an older version:
    floats where blocks are now kept) is keyed apart, not restored as it was."""
    import make_test_model

    import jaxllm.loaders as loaders

    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "q.gguf", "Q4_1")
    cache = tmp_path / "converted"
    floats = load_model(path, quantization="none")
    monkeypatch.setattr(loaders, "CONVERSION_FORMAT", loaders.CONVERSION_FORMAT - 1)
    old = loaders._converted_path(path, "float32", cache)
    loaders._save_conversion(old, floats.config, floats.params, floats.tokenizer, path)
    assert load_model(path, conversion_cache_dir=cache).config.quantization is None  # as that version restored it
    monkeypatch.undo()
    assert load_model(path, conversion_cache_dir=cache).config.quantization == "q4_1"


@pytest.mark.parametrize("name", MOE)
def test_a_mixture_of_experts_gguf_is_its_hf_checkpoint(test_models_dir, tmp_path, name):
    """A MoE GGUF as llama.cpp's converter writes it (each layer's experts stacked in
    ffn_{gate,up,down}_exps, the router ffn_gate_inp, Qwen2-MoE's shared expert *_shexp
    and its dense layer without experts; Mixtral as arch llama, q/k rows permuted)
    gives the very parameters of the HF folder it was written from."""
    import make_test_model

    path = make_test_model.write_gguf(test_models_dir / name, tmp_path / f"{name}.gguf", "F32")
    got, want = load_model(path, "float32"), load_model(test_models_dir / name, "float32")
    fields = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "shared_expert_intermediate_size", "dense_layers", "qkv_bias", "qk_norm")
    assert [getattr(got.config, f) for f in fields] == [getattr(want.config, f) for f in fields]
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# (22 s each: the default run's budget) a dense GGUF of mixed types by default above
@pytest.mark.slow
@pytest.mark.parametrize("name,tensor_type,kept_as", [
    ("qwen3_moe", "Q4_1", "q4_1"), ("qwen3_moe", "Q4_1+Q8_0", "gguf_int8"), ("mixtral", "Q8_0", "q8_0")])
def test_a_mixture_of_experts_gguf_keeps_its_blocks(test_models_dir, tmp_path, name, tensor_type, kept_as):
    """A MoE GGUF whose projections and experts are all of one kept type holds the
    experts' blocks stacked (QuantizedWeight [E, K, N]); one of mixed types (Q4_1 with
    Q8_0 down experts) holds each projection in the tightest exact container (here each
    in its own type's blocks: the Q4_1 gate | up experts as q4_1, the Q8_0 down ones as
    q8_0); either gives the logprobs of the same file dequantized at load, bit for bit,
    through the grouped kernel."""
    import make_test_model

    main, _, other = tensor_type.partition("+")
    path = make_test_model.write_gguf(test_models_dir / name, tmp_path / f"{name}.gguf", main,
                                      overrides={"ffn_down_exps.weight": other} if other else None)
    kept = load_model(path, "float32")
    experts = kept.params.layers[0].w_gate_up
    assert kept.config.quantization == kept_as
    assert isinstance(experts, QuantizedWeight) and experts.shape[0] == kept.config.num_experts
    if other:
        down = kept.params.layers[0].w_down
        assert (experts.bits, experts.mins is not None, down.bits, down.mins is not None) == (4, True, 8, False)
    np.testing.assert_array_equal(engine_numbers(path, None, "cpu"), engine_numbers(path, "none", "cpu"))
