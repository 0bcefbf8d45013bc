"""Pipeline parallelism (jaxllm.models.pipeline) over simulated CPU devices against one
device (each multi-device check in a subprocess: tests/support/multidevice.py), the
stage split and what it refuses, and the pipelined forward's CUDA lowering."""

import argparse
import dataclasses

import pytest

from jaxllm.attention.kv_cache import KV_CACHE_FORMATS
from jaxllm.engine.config import add_cli_args, from_cli_args
from jaxllm.loaders import load_model
from jaxllm.models import pipeline
from jaxllm.models.parallel import TP_AXIS
from tests.support import multidevice


@pytest.fixture(scope="module")
def seven_layers(tmp_path_factory):
    """The llama and gemma3 test models with 7 layers: stages of 4 and 3 (or 2, 2, 2, 1),
    Gemma 3's sliding and full layers at different positions on each stage."""
    import make_test_model

    out = tmp_path_factory.mktemp("seven_layers")
    return {name: make_test_model.write_model(out, name, layers=7) for name in ("llama", "gemma3")}


@pytest.mark.parametrize("name,stages,shards,attention", [
    # uneven (2, 2, 2, 1), a stage's layer kind selected by stage, the last position empty (23 s: in the
    # slow run; the engine over 2 stages below by default)
    pytest.param("gemma3", 4, 1, "cpu", marks=pytest.mark.slow),
    pytest.param("llama", 2, 2, "xla", marks=pytest.mark.slow),
    pytest.param("gemma3", 2, 2, "pallas", marks=pytest.mark.slow),  # the Pallas kernel in interpret mode
])
def test_pipelined_logits_equal_one_device(seven_layers, name, stages, shards, attention):
    """Prefill, chunked prefill and token by token: every micro-batch cut of a sequence
    attends to its earlier part through the cache."""
    multidevice.run("pp_logits_match", str(seven_layers[name]), str(stages), str(shards), attention,
                    devices=stages * shards)


@pytest.mark.parametrize("name,stages,shards,async_scheduling", [
    ("qwen3", 2, 2, "1"),  # TP inside the stages, its one KV head replicated on both shards
    pytest.param("llama", 2, 1, "0", marks=pytest.mark.slow),
    pytest.param("gemma3", 2, 2, "1", marks=pytest.mark.slow),  # the hybrid KV cache: each stage its slots
])
def test_pipelined_engine_equals_one_device(test_models_dir, seven_layers, name, stages, shards, async_scheduling):
    """Through LLM: greedy tokens and logprobs with prefix caching, chunked prefill and
    preemptions; nothing compiles after warm-up; the bytes of weights and KV cache each
    device holds (its stage's alone)."""
    folder = seven_layers[name] if name == "gemma3" else test_models_dir / name
    multidevice.run("pp_engine_matches", str(folder), str(stages), str(shards), "cpu", async_scheduling,
                    devices=stages * shards)


@pytest.mark.slow  # two engines with adapters in a subprocess; the layout is checked below by default
@pytest.mark.parametrize("stages,shards", [(2, 1), (2, 2)])
def test_adapters_in_stages_equal_one_device(seven_layers, tmp_path, stages, shards):
    """LoRA through LLM over stages (4 and 3 layers: the shorter stage's slots zeros):
    two adapters and the base model in one batch give one device's tokens and
    logprobs; each stage holds its layers' slots."""
    multidevice.run("lora_matches", str(seven_layers["llama"]), str(tmp_path), str(shards), str(stages),
                    devices=stages * shards)


def test_adapter_slots_are_stacked_by_stage_and_split_by_projection(seven_layers):
    """The adapters' slots as the pipeline holds them (no devices: an abstract mesh):
    per stage position, each stage's layer's A and B stacked along a leading stage axis
    (the shorter stage's zeros), split inside a stage as the projections are; a
    micro-batch's tokens keep their own slots."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from jaxllm.models.lora import LoRAInputs, abstract_lora, set_slot, zeros_like_abstract

    cfg = load_model(seven_layers["llama"], dtype="float32").config  # 7 layers: stages of 4 and 3
    mesh = AbstractMesh((2, 2), pipeline.BOTH)
    specs = pipeline.lora_specs(cfg, mesh)
    assert len(specs.layers) == 4
    assert specs.layers[0]["wo"].a == P(pipeline.STAGE_AXIS, TP_AXIS, None, None, None)
    assert specs.layers[0]["wqkv"].b == (P(pipeline.STAGE_AXIS, None, None, TP_AXIS),) * 3
    flat = abstract_lora(cfg, 2, 8, jnp.float32)
    stacked = pipeline.stage_layers(flat, cfg, mesh)
    assert stacked.layers[3]["wo"].a.shape == (2,) + flat.layers[0]["wo"].a.shape and stacked.num_slots == 2
    # an adapter set into slot 1: stage 1's position j holds layer 4 + j's arrays, position 3 of stage 1 zeros
    rng = np.random.default_rng(0)  # one slot's arrays: each a [D, P, R], each b [R, N]
    adapter = jax.tree.map(lambda s: rng.standard_normal(s.shape[:1] + s.shape[2:] if len(s.shape) == 4
                                                         else s.shape[1:]).astype(np.float32), flat)
    weights = set_slot(zeros_like_abstract(stacked), jnp.int32(1), pipeline.stage_layers(adapter, cfg, mesh))
    for j in range(4):
        for s, layer in enumerate((j, 4 + j if j < 3 else None)):
            got = np.asarray(weights.layers[j]["wo"].a[s, :, 1])
            want = np.zeros_like(got) if layer is None else adapter.layers[layer]["wo"].a
            np.testing.assert_array_equal(got, want)
            assert not np.asarray(weights.layers[j]["wo"].a[s, :, 0]).any()  # slot 0 untouched
    slots = jnp.array([0, 1, 2, 1, 0, 2])
    part = LoRAInputs.make(weights, slots, jnp.float32).tokens(jnp.int32(3), 3)
    assert part.slots.tolist() == [1, 0, 2] and part.onehot.tolist() == [[1, 0], [0, 0], [0, 1]]
    assert bool(part.active) and not bool(LoRAInputs.make(weights, slots, jnp.float32).tokens(jnp.int32(4), 1).active)


@pytest.mark.slow
def test_smollm2_in_two_stages():
    """The embedded SmolLM2 (30 layers, 15 a stage; its kept Q4_1 blocks) at PP=2:
    greedy tokens and logprobs equal one device's."""
    from jaxllm.loaders.default_model import default_model_path

    multidevice.run("pp_engine_matches", str(default_model_path()), "2", "1", "cpu", "1", devices=2, timeout=1200)


def test_stages_split_the_layers_and_their_cache_slots(test_models_dir):
    from jaxllm.kv_cache_groups import kv_cache_groups

    plan = pipeline.StagePlan(7, 3)
    assert plan.bounds == ((0, 3), (3, 5), (5, 7)) and plan.depth == 3
    assert [plan.layer(s, 2) for s in range(3)] == [2, None, None]
    flat = pipeline.cache_slots(plan, kv_cache_groups([None] * 7))
    assert flat.used == ((0, 1, 2), (3, 4), (5, 6)) and flat.count == 3 and flat.local(1, 4) == 1
    # Gemma 3's pattern (5 sliding, 1 full) over 12 layers: groups of 2 layers share 2 slots
    windows = [None if i % 6 == 5 else 512 for i in range(12)]
    hybrid = pipeline.cache_slots(pipeline.StagePlan(12, 2), kv_cache_groups(windows))
    assert hybrid.count == 2


def test_what_a_split_cannot_serve_is_refused(test_models_dir):
    cfg = load_model(test_models_dir / "llama", dtype="float32").config  # 2 layers
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's 2 layers"):
        pipeline.check_pipeline_parallel(cfg, 4, num_devices=8)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 x tensor_parallel_size=2: only 2 devices"):
        pipeline.check_pipeline_parallel(cfg, 2, 2, num_devices=2)
    moe = load_model(test_models_dir / "qwen2_moe", dtype="float32").config  # a dense layer, then experts
    with pytest.raises(ValueError, match="layers 0, 1 would share a stage position but differ"):
        pipeline.check_pipeline_parallel(moe, 2, num_devices=2)
    odd = dataclasses.replace(cfg, vocab_size=510)  # 2 x 3 x 5 x 17: 4 shards over 2 stages do not divide it
    assert pipeline.vocab_axes(odd, 2, 2) == (TP_AXIS,)
    assert pipeline.vocab_axes(cfg, 2, 2) == pipeline.BOTH


def test_the_cli_takes_vllm_s_flag():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = from_cli_args(parser.parse_args(["-pp", "2", "-tp", "4"]))
    assert config.pipeline_parallel_size == 2 and config.devices_per_engine == 8
    assert from_cli_args(parser.parse_args(["--pipeline-parallel-size", "3"])).pipeline_parallel_size == 3


def test_the_pipelined_forward_lowers_for_2_stages_of_4_gpus():
    """Over an abstract (stage 2, model 4) mesh of GPUs, the pipelined forward with the
    Pallas kernel lowers for CUDA: the stages' activations pass by collective-permute,
    the Triton kernel runs in each stage's layers, the logits are gathered."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec, use_abstract_mesh

    import pallas_kernels
    from jaxllm.attention.kv_cache import KVCache
    from jaxllm.attention.metadata import AttentionMetadata
    from jaxllm.config import ModelConfig
    from jaxllm.models.llama import OutputRows
    from jaxllm.models.params import abstract_params
    from jaxllm.models.rope import rope_table
    from pallas_kernels.cuda_lowering import CUDA_TARGET, has_triton_call

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                      num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=2048)

    def attention(*args, common_prefix_blocks=None, cache_dtype="", **kwargs):
        return pallas_kernels.ragged_paged_attention(*args, interpret=False, **kwargs)

    mesh = AbstractMesh((2, 4), pipeline.BOTH,
                        abstract_device=AbstractDevice(device_kind=CUDA_TARGET, num_cores=None, platform="gpu"))

    def sharded(a, spec=None):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec or PartitionSpec()))

    model = pipeline.PipelinedModel(cfg, mesh, attention)
    t, s, blocks = 64, 8, 16
    rows = pipeline.kv_cache_specs(KV_CACHE_FORMATS["bfloat16"]).k
    cache = sharded(jax.ShapeDtypeStruct((2 * 128, 16, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16), rows)
    i32 = lambda *shape: sharded(jax.ShapeDtypeStruct(shape, jnp.int32))
    md = AttentionMetadata(i32(t), i32(s, blocks), i32(s), i32(s + 1), i32(), i32())
    rope = jax.tree.map(sharded, rope_table(cfg.rope, cfg.head_dim, 2048))
    plan = pipeline.StagePlan(cfg.num_layers, 2)
    params = jax.tree.map(sharded, pipeline.stack_stages(abstract_params(cfg, jnp.bfloat16), plan), model.specs)
    out = OutputRows(i32(s), i32(), sharded(jax.ShapeDtypeStruct((), jnp.bool_)))

    def step(params, rope, caches, ids, positions, md, out):
        hidden, caches = model.forward_rows(params, rope, caches, ids, positions, md, out)
        return model.compute_logits(params, hidden.rows), caches

    with use_abstract_mesh(mesh):
        text = jax.jit(step).trace(params, rope, (KVCache(cache, cache),) * plan.depth, i32(t), i32(t), md,
                                   out).lower(lowering_platforms=("cuda",)).as_text()
    assert has_triton_call(text)
    assert "collective_permute" in text and "all_gather" in text
