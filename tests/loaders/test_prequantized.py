"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints (jaxllm.loaders.prequantized): their 4-bit groups kept as
jaxllm's int4 formats, int8 per channel as its int8, the weights exactly the checkpoint's; FP8 and the other 8-bit
schemes dequantized on request."""

from __future__ import annotations

import json

import jax
import make_test_model
import numpy as np
import pytest

from jaxllm.loaders import load_model, peek_model_config
from jaxllm.loaders.prequantized import (
    AWQ_ORDER,
    CheckpointQuantization,
    PrequantizedError,
    stored_projection,
    unpack_int4,
)
from jaxllm.loaders.scaled import read_scaled
from jaxllm.models.linear import pack_weight
from jaxllm.models.params import QuantizedWeight
from jaxllm.models.quant import dequantize
from tests.support.llm import engine_numbers

# (method, group, symmetric, checkpoint_format, bits): GPTQ's original format stores zero - 1
# the default run's budget: AWQ's layout is checked by its known answers there, its engine in the slow run
CASES = [("gptq", 64, False, "gptq", 4), pytest.param("awq", 32, False, "gptq", 4, marks=pytest.mark.slow),
         ("compressed-tensors", 64, True, "", 4),
         pytest.param("gptq", 128, True, "gptq_v2", 4, marks=pytest.mark.slow),
         pytest.param("compressed-tensors", 32, False, "", 4, marks=pytest.mark.slow),
         # Qwen's GPTQ-Int8 layout (its loading is checked in the default run below)
         pytest.param("gptq", 128, True, "gptq", 8, marks=pytest.mark.slow),
         pytest.param("compressed-tensors", 64, False, "", 8, marks=pytest.mark.slow)]


def _word(nibbles) -> np.int32:
    return np.array([sum(int(v) << (4 * j) for j, v in enumerate(nibbles))], np.uint32).view(np.int32)[0]


def test_the_packed_layouts_unpack_as_gptq_and_awq_define_them():
    """Known answers, from the formats' definitions (AutoGPTQ's pack along the inputs,
    AutoAWQ's along the outputs in the order 0 2 4 6 1 3 5 7): one word each."""
    column = np.array([[_word(range(8))]])  # GPTQ qweight [in / 8, out]: inputs 0..7 of column 0 are 0..7
    assert unpack_int4(column, 0)[:, 0].tolist() == list(range(8))
    stored = {"m.qweight": np.array([[_word(AWQ_ORDER)]]), "m.qzeros": np.array([[_word([1] * 8)]]),
              "m.scales": np.ones((1, 8), np.float16)}  # AWQ [in, out / 8]: nibble j holds column AWQ_ORDER[j]
    awq = CheckpointQuantization("awq", 1, 0)
    assert stored_projection(awq, stored.get, "m").q[0].tolist() == list(range(8))
    gptq = CheckpointQuantization("gptq", 8, 1)  # zeros stored less one
    stored = {"m.qweight": np.full((1, 8), _word([15] * 8)), "m.qzeros": np.array([[_word(range(8))]]),
              "m.scales": np.full((1, 8), 0.5, np.float16)}
    one = stored_projection(gptq, stored.get, "m")
    assert one.zeros[0].tolist() == list(range(1, 9))
    np.testing.assert_array_equal(one.weight()[:, 3], 0.5 * (15 - 4))
    # compressed-tensors [out, in / 8], signed values stored plus 8 (compressed_tensors.pack_to_int32): one row
    # of inputs -8..-1, symmetric (zero 0); asymmetric zero points packed along the outputs
    ct = CheckpointQuantization("compressed-tensors", 8, 0, symmetric=True)
    stored = {"m.weight_packed": np.array([[_word(range(8))]] * 8), "m.weight_scale": np.ones((8, 1), np.float32)}
    np.testing.assert_array_equal(stored_projection(ct, stored.get, "m").weight()[:, 0], np.arange(-8, 0))
    stored["m.weight_zero_point"] = np.array([[_word(range(8))]])  # outputs 0..7: zero points -8..-1
    asym = stored_projection(CheckpointQuantization("compressed-tensors", 8, 0), stored.get, "m")
    np.testing.assert_array_equal(asym.weight()[0], -8 - np.arange(-8, 0))
    # 8 bits (GPTQ-Int8): four values to a word along the inputs, zero points four to a word along the outputs
    gptq8 = CheckpointQuantization("gptq", 4, 1, bits=8)
    byte_word = lambda values: np.array([sum(int(v) << (8 * j) for j, v in enumerate(values))],
                                        np.uint32).view(np.int32)[0]
    stored = {"m.qweight": np.full((1, 4), byte_word([0, 1, 2, 255])), "m.qzeros": np.array([[byte_word([127] * 4)]]),
              "m.scales": np.full((1, 4), 0.5, np.float16)}
    one = stored_projection(gptq8, stored.get, "m")
    np.testing.assert_array_equal(one.weight()[:, 0], 0.5 * (np.array([0, 1, 2, 255]) - 128))
    held = one.held(4, "m")  # as int8: values less 128, the min moved to match
    assert held.bits == 8 and held.q[0].tolist() == [-128, -127, -126, 127] and held.mins[0, 0] == 0


@pytest.mark.parametrize("method,group,sym,fmt,bits", CASES)
def test_a_gptq_or_awq_checkpoint_is_kept_packed_and_bit_identical(test_models_dir, tmp_path, method, group, sym,
                                                                   fmt, bits):
    """The checkpoint's groups held as int4 or int8_g* (scale, and min -scale * zero, per group):
    the engine's tokens and logprobs are those of the float32 checkpoint of the very
    weights it stands for, scale * (q - zero), bit for bit through the kernel (and XLA,
    slow); the
    kernel's panels bits / 32 of the float ones; `quantization="none"` dequantizes them."""
    lm_head = fmt == "gptq_v2"  # GPTQModel's lm_head=True: the head quantized too
    qc, exact = make_test_model.write_prequantized(test_models_dir / "qwen2", tmp_path, method, group, sym, fmt,
                                                   lm_head, bits=bits)
    model = load_model(qc, "float32")
    held = {32: "int4_g32", 64: "int4_g64", 128: "int4"}[group] if bits == 4 else f"int8_g{group}"
    assert model.config.quantization == held and peek_model_config(qc).quantization == held
    w = model.params.layers[1].wqkv
    assert isinstance(w, QuantizedWeight) and w.group == group and w.bits == bits
    float_model = load_model(exact, "float32")
    np.testing.assert_array_equal(dequantize(w), float_model.params.layers[1].wqkv)
    assert isinstance(model.params.lm_head, QuantizedWeight) == lm_head  # else left in float, as stored
    layers = lambda m: sum(a.nbytes for a in jax.tree.leaves(m.params.layers))
    assert layers(model) < layers(float_model) / 3  # int8 values until packed: the kernel's panels hold 4 bits
    assert pack_weight(w).panels.nbytes * 32 // bits == pack_weight(float_model.params.layers[1].wqkv).panels.nbytes
    dequantized = load_model(qc, "float32", quantization="none")
    assert dequantized.config.quantization is None
    np.testing.assert_array_equal(dequantized.params.layers[0].w_down, float_model.params.layers[0].w_down)
    for backend in ("cpu", "xla") if lm_head else ("cpu",):  # XLA's dot of the dequantized groups: the slow case
        np.testing.assert_array_equal(engine_numbers(qc, None, backend), engine_numbers(exact, None, backend),
                                      err_msg=backend)


def test_what_a_checkpoint_cannot_be_held_as_is_refused_by_name(test_models_dir, tmp_path):
    qc, _ = make_test_model.write_prequantized(test_models_dir / "llama", tmp_path, "gptq", 64)
    with pytest.raises(ValueError, match="re-quantize"):
        load_model(qc, "float32", quantization="int8")
    # vLLM's method names: as stored, once the checkpoint is found stored so
    assert load_model(qc, "float32", quantization="gptq").config.quantization == "int4_g64"
    for method, path in (("awq", qc), ("gptq", test_models_dir / "llama")):
        with pytest.raises(ValueError, match=f"quantization '{method}': .* is stored as"):
            load_model(path, "float32", quantization=method)
    config = json.loads((qc / "config.json").read_text())
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    w4a8 = {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"},
                                    "input_activations": {"num_bits": 8, "dynamic": True}}}}
    for change, message in (({"quant_method": "bitsandbytes"}, "bitsandbytes"), ({"bits": 3}, "3-bit"),
                            ({"group_size": 48}, "group_size 48"), ({"checkpoint_format": "marlin"}, "marlin"),
                            (ct | {"format": "marlin-24"}, "marlin-24"), (ct, "0 config groups"),
                            (ct | w4a8, "W4A8"), ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2")):
        (qc / "config.json").write_text(json.dumps(config | {"quantization_config": config["quantization_config"]
                                                             | change}))
        with pytest.raises(PrequantizedError, match=message):
            load_model(qc, "float32")
    (qc / "config.json").write_text(json.dumps(config))
    # activation order: q alone in another order than k and v (jaxllm fuses them) is refused kept, and
    # dequantized with "none"
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(qc / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = np.random.default_rng(0).permutation(tensors[name])
    save_file(tensors, str(qc / "model.safetensors"))
    with pytest.raises(PrequantizedError, match="different activation orders"):
        load_model(qc, "float32")
    assert load_model(qc, "float32", quantization="none").config.quantization is None


def test_the_8bit_layouts_read_as_compressed_tensors_and_hf_fp8_define_them():
    """Known answers: compressed-tensors' pack_to_int32 with 8 bits (four values plus 128
    to a word along the inputs, the first in the low byte), and FP8 scaled by 2-D blocks
    (HF's fine-grained FP8: weight * weight_scale_inv, the last block cut)."""
    import ml_dtypes

    word = np.array([[0 | 129 << 8 | 255 << 16 | 127 << 24]], np.uint32).view(np.int32)  # -128, 1, 127, -1
    stored = {"m.weight_packed": word, "m.weight_scale": np.full((1, 1), 0.5, np.float32)}
    suffixes = ("weight_packed", "weight_zero_point", "weight_scale", None)
    one = read_scaled(stored.get, "m", suffixes, True, (1, 0))
    assert one.values.tolist() == [[-128, 1, 127, -1]] and one.per_channel
    np.testing.assert_array_equal(one.weight(), [[-64, 0.5, 63.5, -0.5]])
    assert one.held().scale.tolist() == [0.5] and one.held().group == 0
    stored = {"m.weight": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.float8_e4m3fn),
              "m.weight_scale_inv": np.array([[1, 2], [4, 8]], np.float32)}
    fp8 = read_scaled(stored.get, "m", ("weight", None, "weight_scale_inv", None), False, (2, 2))
    np.testing.assert_array_equal(fp8.weight(), np.arange(12).reshape(3, 4) * np.array([[1, 1, 2, 2]] * 2
                                                                                      + [[4, 4, 8, 8]]))
    assert not fp8.per_channel
    # zero points packed along the outputs, the last word padded: 6 outputs in two words
    w = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    parts, exact = make_test_model._scaled_8bit(w, "w8a16-asym", (1, 0))
    assert parts["weight_zero_point"].shape == (2, 1)
    asym = read_scaled({f"m.{k}": v for k, v in parts.items()}.get, "m", suffixes, True, (1, 0))
    np.testing.assert_array_equal(asym.weight(), exact)
    with pytest.raises(ValueError, match="do not cover a 3 x 4 matrix"):
        read_scaled(stored.get, "m", ("weight", None, "weight_scale_inv", None), False, (1, 2))


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
def test_an_int8_per_channel_checkpoint_is_kept_as_int8(test_models_dir, tmp_path, scheme):
    """compressed-tensors W8A16 (packed) and W8A8 (int8 `weight`; its activations stay
    float) held as jaxllm's int8: the weights exactly the checkpoint's, the unquantized
    lm_head as stored; `none` dequantizes them to the same."""
    qc, exact = make_test_model.write_scaled(test_models_dir / "qwen2", tmp_path, scheme)
    model = load_model(qc, "float32")
    assert model.config.quantization == "int8" == peek_model_config(qc).quantization
    float_model = load_model(exact, "float32")
    for field in ("wqkv", "wo", "w_gate_up", "w_down"):
        w = getattr(model.params.layers[1], field)
        assert isinstance(w, QuantizedWeight) and w.group == 0 and w.bits == 8 and w.q.dtype == np.int8, field
        np.testing.assert_array_equal(dequantize(w), getattr(float_model.params.layers[1], field), err_msg=field)
    assert not isinstance(model.params.lm_head, QuantizedWeight)
    none = load_model(qc, "float32", quantization="none")
    np.testing.assert_array_equal(none.params.layers[0].wqkv, float_model.params.layers[0].wqkv)


def test_a_gptq_int8_checkpoint_is_kept_as_int8_groups(test_models_dir, tmp_path):
    """GPTQ-Int8 (four values to a word, zeros stored less one, groups of 128): held as
    int8_g128, each weight exactly the checkpoint's (the engine's bit-identity: the slow
    case of the test above; the grouped int8 kernel: tests/models/test_linear.py)."""
    qc, exact = make_test_model.write_prequantized(test_models_dir / "qwen2", tmp_path, "gptq", 128, True, bits=8)
    model, float_model = load_model(qc, "float32"), load_model(exact, "float32")
    assert model.config.quantization == "int8_g128" == peek_model_config(qc).quantization
    for field in ("wqkv", "w_down"):
        w = getattr(model.params.layers[0], field)
        assert isinstance(w, QuantizedWeight) and (w.bits, w.group) == (8, 128) and w.mins is not None, field
        np.testing.assert_array_equal(dequantize(w), getattr(float_model.params.layers[0], field), err_msg=field)


@pytest.mark.slow  # 25 s: the int8 kernel's engine is checked against fake-quantized weights in tests/models/test_quant.py
def test_a_w8a16_checkpoint_runs_kept_and_matches_its_weights_in_float(test_models_dir, tmp_path):
    """The int8 kernel on the kept W8A16 checkpoint against the float32 checkpoint of
    its weights: equal tokens, logprobs within 1e-4 (the scale multiplies the dot's
    sum, not each weight); an FP8 checkpoint dequantized through LLM: bit for bit."""
    qc, exact = make_test_model.write_scaled(test_models_dir / "qwen2", tmp_path, "w8a16")
    kept, float_run = engine_numbers(qc, None, "cpu"), engine_numbers(exact, None, "cpu")
    np.testing.assert_allclose(kept, float_run, atol=1e-4, rtol=0)
    qc, exact = make_test_model.write_scaled(test_models_dir / "qwen2", tmp_path, "fp8-block")
    np.testing.assert_array_equal(engine_numbers(qc, "none", "cpu"), engine_numbers(exact, None, "cpu"))


@pytest.mark.parametrize("scheme", ["w8a16-asym", "fp8-channel", "fp8-block"])
def test_an_fp8_or_asymmetric_int8_checkpoint_loads_dequantized_on_request(test_models_dir, tmp_path, scheme):
    """What jaxllm holds no format for (FP8 values, int8 per channel with zero points): refused as stored,
    naming the remedy; `quantization="none"` gives exactly the float32 weights it stands
    for (FP8 values read from the safetensors bytes: its numpy reader has no FP8)."""
    qc, exact = make_test_model.write_scaled(test_models_dir / "llama", tmp_path, scheme)
    asked = "fp8" if scheme == "fp8-block" else "compressed-tensors"  # vLLM's name of the method: as stored
    for load, quantization in ((load_model, None), (peek_model_config, None), (load_model, asked)):
        with pytest.raises(PrequantizedError, match="quantization='none' dequantizes"):
            load(qc, "float32", quantization=quantization)
    model, float_model = load_model(qc, "float32", quantization="none"), load_model(exact, "float32")
    assert model.config.quantization is None
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(float_model.params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # 15 s; the int4 formats quantized at load shard in tests/models/test_quant.py
def test_a_kept_gptq_checkpoint_shards_for_tensor_parallelism(test_models_dir, tmp_path):
    """A GPTQ checkpoint's groups (values, scales and mins) split with their columns,
    the unquantized lm_head by vocabulary: TP=2 logits equal one device's."""
    from tests.support import multidevice

    qc, _ = make_test_model.write_prequantized(test_models_dir / "qwen2", tmp_path, "gptq", 64)
    multidevice.run("tp_logits_match", str(qc), "2", "cpu", "", devices=2)


def test_none_dequantizes_a_converted_checkpoint_that_holds_quantized_weights(test_models_dir, tmp_path):
    """A converted (orbax) checkpoint of kept groups restores them kept; `quantization=
    "none"` gives the float weights they stand for, and the config peeked says so too
    (it used to keep them quantized)."""
    from jaxllm.loaders.checkpoint import save_checkpoint

    qc, exact = make_test_model.write_prequantized(test_models_dir / "llama", tmp_path, "awq", 64)
    model = load_model(qc, "float32")
    save_checkpoint(tmp_path / "converted", model.config, model.params, model.tokenizer, source=str(qc))
    assert load_model(tmp_path / "converted", "float32").config.quantization == "int4_g64"
    plain = load_model(tmp_path / "converted", "float32", quantization="none")
    assert plain.config.quantization is None and peek_model_config(tmp_path / "converted", quantization="none"
                                                                   ).quantization is None
    for got, want in zip(jax.tree.leaves(plain.params), jax.tree.leaves(load_model(exact, "float32").params)):
        np.testing.assert_array_equal(got, want)


# (16 s: the default run's budget) GPTQ kept packed by default above
@pytest.mark.slow
@pytest.mark.parametrize("method,backend", [("gptq", "cpu"), ("gptq", "xla"), ("compressed-tensors", "cpu")])
def test_a_checkpoint_in_activation_order_is_kept_with_its_inputs_order(test_models_dir, tmp_path, method, backend):
    """GPTQ's desc_act: each projection's groups formed in another order of its inputs
    (g_idx). Kept as int4 with its rows sorted by group and that order (`perm`), x's
    inputs taken in it: the same products as the float32 checkpoint of its weights,
    summed in another order (logprobs to float32 rounding, greedy tokens equal), through the
    kernel (and XLA, slow). Refused for tensor parallelism (the order crosses any split)."""
    from jaxllm.models.parallel import partition_specs

    qc, exact = make_test_model.write_prequantized(test_models_dir / "qwen2", tmp_path, method, 64, act_order=True)
    model = load_model(qc, "float32")
    assert {f for _, f in model.config.tensor_quantization} == {"int4_g64+act_order", "none"}
    w = model.params.layers[0].wqkv
    assert w.perm is not None and sorted(np.asarray(w.perm).tolist()) == list(range(w.shape[0]))
    np.testing.assert_array_equal(np.asarray(dequantize(w))[np.argsort(np.asarray(w.perm))],
                                  load_model(exact, "float32").params.layers[0].wqkv)
    got, want = engine_numbers(qc, None, backend), engine_numbers(exact, None, backend)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)  # tokens: exact
    with pytest.raises(ValueError, match="activation order"):
        partition_specs(model.config)
