"""The parameters' one declaration (jaxllm.models.params.declare) against checkpoints
written independently of it (scripts/make_test_model.py), and what is derived from it:
abstract shapes, HF names and shapes, loading and exporting (shard-major fusing for
tensor parallelism), packing, PartitionSpecs."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from jaxllm.loaders import load_model
from jaxllm.loaders.weights import build_params, hf_tensor_shapes, params_to_hf_tensors
from jaxllm.models.formats import Blocks, ChannelInt8, Dense, declared_format
from jaxllm.models.linear import pack_params
from jaxllm.models.parallel import partition_specs
from jaxllm.models.params import (
    QUANT_FORMATS,
    PackedWeight,
    ParamDecl,
    abstract_params,
    declarations,
    declare,
    fuse,
    shard_major,
    unfuse,
)
from tests.support.models import ARCHITECTURES


def checkpoint_tensors(folder) -> dict[str, np.ndarray]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(f))
    return tensors


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_declaration_names_every_checkpoint_tensor_with_its_shape(test_models_dir, name):
    folder = test_models_dir / name
    model = load_model(folder, dtype="float32")
    cfg = model.config
    tensors = checkpoint_tensors(folder)
    assert hf_tensor_shapes(cfg) == {n: t.shape for n, t in tensors.items()}
    abstract = abstract_params(cfg, np.float32)
    assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(lambda a: a.shape, model.params)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_load_and_export_round_trip(test_models_dir, name):
    folder = test_models_dir / name
    cfg = load_model(folder, dtype="float32").config
    tensors = checkpoint_tensors(folder)
    back = params_to_hf_tensors(cfg, build_params(cfg, tensors.get, np.float32, "test"))
    assert set(back) == set(tensors)
    for n, t in tensors.items():
        np.testing.assert_array_equal(back[n], t, err_msg=n)


@pytest.mark.parametrize("on_host", [False, True])
def test_fused_projections_are_laid_out_shard_major(test_models_dir, on_host):
    """Cut into two, each half of w_qkv is [q | k | v] of that shard's heads, and each
    half of w_gate_up is [gate | up] of its columns; the rest as loaded (device or host
    arrays alike)."""
    folder = test_models_dir / "llama"
    cfg = load_model(folder, dtype="float32").config
    t = checkpoint_tensors(folder)
    one = build_params(cfg, t.get, np.float32, "test", on_host=on_host)
    params = shard_major(cfg, one, 2)
    assert isinstance(params.layers[1].wqkv, np.ndarray) == on_host
    wqkv, w_gate_up = np.asarray(params.layers[1].wqkv), np.asarray(params.layers[1].w_gate_up)
    p = "model.layers.1."
    q, k, v = (t[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
    gate, up = (t[p + f"mlp.{n}_proj.weight"].T for n in ("gate", "up"))
    for s in range(2):
        half = lambda a, s=s: np.split(a, 2, axis=-1)[s]
        np.testing.assert_array_equal(half(wqkv), np.concatenate([half(q), half(k), half(v)], axis=-1))
        np.testing.assert_array_equal(half(w_gate_up), np.concatenate([half(gate), half(up)], axis=-1))
    np.testing.assert_array_equal(one.layers[1].wqkv, np.concatenate([q, k, v], axis=-1))
    np.testing.assert_array_equal(params.layers[1].wo, one.layers[1].wo)
    assert shard_major(cfg, one, 1) is one


def test_fuse_and_unfuse():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((3, n)) for n in (12, 6, 6)]
    for shards in (1, 2, 3, 6):
        fused = fuse(parts, shards)
        assert fused.shape == (3, 24)
        for got, want in zip(unfuse(fused, [12, 6, 6], shards), parts):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="do not split into 4 shards"):
        fuse(parts, 4)
    # k and v (6 columns: 2 heads of 3) over 4 shards: each head on 2 shards
    fused = fuse(parts, 4, repeats=[1, 2, 2])
    assert fused.shape == (3, 12 + 2 * 6 + 2 * 6)
    q, k, v = parts
    shard1 = np.split(fused, 4, axis=-1)[1]  # q's 2nd quarter, k's and v's first head
    np.testing.assert_array_equal(shard1, np.concatenate([q[:, 3:6], k[:, :3], v[:, :3]], axis=-1))
    for got, want in zip(unfuse(fused, [12, 6, 6], 4, [1, 2, 2]), parts):
        np.testing.assert_array_equal(got, want)


def test_partition_specs_follow_megatron(test_models_dir):
    cfg = load_model(test_models_dir / "qwen2", dtype="float32").config  # qkv bias, untied head
    specs = partition_specs(cfg)
    layer = specs.layers[0]
    assert layer.wqkv == P(None, "model") and layer.bqkv == P("model")
    assert layer.wo == P("model", None) and layer.w_down == P("model", None)
    assert layer.w_gate_up == P(None, "model")
    assert layer.attn_norm == P(None) and layer.mlp_norm == P(None) and specs.final_norm == P(None)
    assert specs.embed == P("model", None) and specs.lm_head == P(None, "model")
    assert len(specs.layers) == cfg.num_layers


@pytest.mark.parametrize("quantization", ["int8", "q4_1"])
def test_a_quantized_projection_is_sharded_and_described_by_its_format(test_models_dir, quantization):
    """formats.declared_format: per column, the int8 scales split with the columns
    (replicated on a row-parallel projection); in blocks, scales and mins with the values."""
    cfg = dataclasses.replace(load_model(test_models_dir / "qwen2", dtype="float32").config,
                              quantization=quantization)
    layer = declare(cfg).layers[0]
    specs = partition_specs(cfg).layers[0]
    if quantization == "int8":
        assert declared_format(layer.wo) is ChannelInt8 and declared_format(layer.wo).describe(layer.wo) == "int8 per column"
        assert specs.wqkv.scale == P("model") and specs.wo.scale == P(None) and specs.wo.mins is None
    else:
        assert declared_format(layer.wo) is Blocks and declared_format(layer.wo).describe(layer.wo) == "q4_1 in blocks of 32"
        assert specs.wqkv.scale == specs.wqkv.mins == P(None, "model") and specs.wo.scale == P("model", None)
    assert specs.wo.q == P("model", None) and specs.wo.group == QUANT_FORMATS[quantization].group
    assert declared_format(layer.attn_norm) is Dense and specs.attn_norm == P(None)


def test_packing_packs_every_projection_and_nothing_else(test_models_dir):
    model = load_model(test_models_dir / "qwen3", dtype="float32")  # q/k norms: vectors stay
    packed = pack_params(model.params)
    layer = packed.layers[0]
    assert all(isinstance(getattr(layer, n), PackedWeight) for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert not isinstance(layer.q_norm, PackedWeight) and not isinstance(layer.attn_norm, PackedWeight)
    n_matrices = sum(len(d.shape) == 2 for d in declarations(model.config)) - 1  # the embedding stays plain
    assert sum(isinstance(x, PackedWeight) for x in jax.tree.leaves(
        packed, is_leaf=lambda x: isinstance(x, PackedWeight))) == n_matrices


def test_an_inconsistent_declaration_is_refused():
    with pytest.raises(ValueError, match="inconsistent"):
        ParamDecl((4, 6), ("embed", "qkv"), (("a", 2), ("b", 2)), transposed=True)
    with pytest.raises(ValueError, match="inconsistent"):
        ParamDecl((4, 6), ("embed",), (("a", 6),))


@pytest.mark.parametrize("kind", ["hf", "gguf", "converted"])
def test_weights_can_stay_in_host_memory(test_models_dir, tmp_path, kind):
    """on_host: numpy leaves equal to what load_model places on the device (for an
    engine that then places each device's shard only)."""
    import make_test_model

    path = test_models_dir / "llama"
    if kind != "hf":
        path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf")
    cache = tmp_path / "cache" if kind == "converted" else None
    if cache is not None:
        load_model(path, dtype="float32", conversion_cache_dir=cache)  # converts, for the next load
    on_device = load_model(path, dtype="float32", conversion_cache_dir=cache)
    host = load_model(path, dtype="float32", conversion_cache_dir=cache, on_host=True)
    leaves = jax.tree.leaves(host.params)
    assert all(isinstance(a, np.ndarray) for a in leaves)
    for a, b in zip(leaves, jax.tree.leaves(on_device.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
