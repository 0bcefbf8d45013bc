"""Tensor parallelism over simulated CPU devices (each check in a subprocess with
`--xla_force_host_platform_device_count`: tests/support/multidevice.py) against one device, and
the constraints a tensor-parallel size must meet."""

import argparse
import dataclasses

import pytest

from jaxllm.attention.kv_cache import KV_CACHE_FORMATS
from jaxllm.engine.config import add_cli_args, from_cli_args
from jaxllm.loaders import load_model
from jaxllm.models.parallel import cache_kv_heads, check_tensor_parallel, possible_sizes, shard_config
from tests.support import multidevice


@pytest.mark.parametrize("name,size,attention,kv_cache_dtype", [
    pytest.param("llama", 2, "xla", "auto", marks=pytest.mark.slow),  # XLA's attention compiles slowly (22 s)
    pytest.param("mistral", 2, "cpu", "auto", marks=pytest.mark.slow),
    # scaled KV caches (their scales sharded by KV head) in the slow run: the default run's budget
    pytest.param("qwen2", 2, "cpu", "int8", marks=pytest.mark.slow),
    pytest.param("qwen2", 2, "cpu", "fp8-scaled", marks=pytest.mark.slow),
    pytest.param("qwen2", 2, "cpu", "auto", marks=pytest.mark.slow),
    pytest.param("mistral", 2, "cpu", "bfloat16", marks=pytest.mark.slow),
    pytest.param("llama", 2, "pallas", "auto", marks=pytest.mark.slow),  # (the Pallas kernel in interpret mode: 19 s)
    pytest.param("llama", 4, "cpu", "auto", marks=pytest.mark.slow),
    # more shards than KV heads (qwen3's 1, llama's 2 on 4): KV heads replicated (by default: gemma2's one head below)
    pytest.param("qwen3", 2, "cpu", "auto", marks=pytest.mark.slow),
    # Gemma: its output norms after the all-reduce, sliding and full layers, one KV head replicated
    # (gemma2's in the slow run: the default run's budget; a KV head replicated by default: the pipelined
    # engine's test of 2 shards of Qwen3)
    pytest.param("gemma3", 2, "cpu", "auto", marks=pytest.mark.slow),
    pytest.param("gemma2", 2, "cpu", "auto", marks=pytest.mark.slow),
    # Mixtures of experts: each shard a slice of every expert; Qwen2-MoE's shared expert and dense layer
    ("qwen2_moe", 2, "cpu", "auto"), pytest.param("qwen3_moe", 2, "cpu", "auto", marks=pytest.mark.slow),
])
def test_tensor_parallel_logits_equal_one_device(test_models_dir, name, size, attention, kv_cache_dtype):
    """Prefill, chunked prefill, token by token and a mixed step (the test models have 2
    KV heads, qwen3's 1); an int8 KV cache (its scales sharded with their heads)."""
    multidevice.run("tp_logits_match", str(test_models_dir / name), str(size), attention, "", kv_cache_dtype,
                    devices=size)


@pytest.mark.slow  # by default, test_pipeline_parallel's engine test runs TP 2 (KV heads replicated) in its stages
@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_engine_equals_one_device(test_models_dir, size):
    """Through LLM: greedy tokens and logprobs, prefix caching, chunked prefill and
    preemption, no compilation after warm-up; the weights sharded (at 4, over the
    llama test model's 2 KV heads, replicated)."""
    multidevice.run("tp_engine_matches", str(test_models_dir / "llama"), str(size), devices=size)


def test_sizes_that_do_not_divide_the_model_are_refused(test_models_dir):
    cfg = load_model(test_models_dir / "llama", dtype="float32").config  # 4 heads, 2 KV heads
    assert possible_sizes(cfg) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's num_attention_heads \(4\); "
                                         r"possible sizes: 1, 2, 4"):
        check_tensor_parallel(cfg, 3, num_devices=8)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: only 1 devices are visible"):
        check_tensor_parallel(cfg, 2, num_devices=1)
    wide = dataclasses.replace(cfg, num_heads=12, num_kv_heads=4, intermediate_size=384, vocab_size=768)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(4\) or be a multiple of it"):
        check_tensor_parallel(wide, 6, num_devices=8)
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (
        2, 1, cfg.intermediate_size // 2, cfg.vocab_size // 2)
    assert shard_config(cfg, 4).num_kv_heads == 1 and cache_kv_heads(cfg, 4) == 4 and cache_kv_heads(cfg, 2) == 2


def test_a_mixture_of_experts_shards_each_expert(test_models_dir):
    """Each shard holds a slice of every expert (and of the shared expert); a size that
    would split a quantized block of inputs between shards is refused, naming it."""
    from jaxllm.models.quant import quantized_config

    cfg = load_model(test_models_dir / "qwen2_moe", dtype="float32").config
    local = shard_config(cfg, 2)
    assert (local.num_experts, local.moe_intermediate_size, local.shared_expert_intermediate_size) == (
        cfg.num_experts, cfg.moe_intermediate_size // 2, cfg.shared_expert_intermediate_size // 2)
    check_tensor_parallel(quantized_config(cfg, "int8"), 2, num_devices=2)
    moe = load_model(test_models_dir / "qwen3_moe", dtype="float32").config  # experts of 32
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 would split model\.layers\.0\.mlp\.experts\.\*\."
                                         r"down_proj\.weight's blocks of 32 inputs \(32 inputs, 16 a shard; q4_1\)"):
        check_tensor_parallel(quantized_config(moe, "q4_1"), 2, num_devices=2)


def test_an_engine_refuses_more_devices_than_it_has(test_models_dir):
    from tests.support.llm import make_llm

    with pytest.raises(ValueError, match="only 1 devices are visible"):
        make_llm(test_models_dir, tensor_parallel_size=2)


def test_the_cli_takes_vllm_s_flags():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert from_cli_args(parser.parse_args(["-tp", "4"])).tensor_parallel_size == 4
    assert from_cli_args(parser.parse_args(["--tensor-parallel-size", "2"])).tensor_parallel_size == 2


@pytest.mark.slow
def test_smollm2_at_three_shards(tmp_path):
    """The embedded SmolLM2 (9 query / 3 KV heads) at TP=3: greedy tokens and logprobs
    equal one device's."""
    from jaxllm.loaders.default_model import default_model_path

    multidevice.run("tp_engine_matches", str(default_model_path()), "3", devices=3, timeout=1200)


@pytest.mark.parametrize("quantization", [None, "int8", "q8_0"])
def test_the_sharded_forward_lowers_for_an_8_gpu_mesh_without_gpus(quantization):
    """Over an AbstractMesh of 8 (no devices needed), the tensor-parallel forward with
    the Pallas kernel lowers for CUDA: the module calls the Triton kernel, all-reduces
    after each row-parallel projection and the embedding, and all-gathers the logits;
    quantized projections reach the GPU program as int8, sharded with their scales."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec, use_abstract_mesh

    import pallas_kernels
    from jaxllm.attention.kv_cache import KVCache
    from jaxllm.attention.metadata import AttentionMetadata
    from jaxllm.config import ModelConfig
    from jaxllm.models.parallel import TP_AXIS, ShardedModel, kv_cache_specs, partition_specs
    from jaxllm.models.params import abstract_params
    from jaxllm.models.rope import rope_table
    from pallas_kernels.cuda_lowering import cuda_mesh, has_triton_call

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                      num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=2048)
    cfg = dataclasses.replace(cfg, quantization=quantization)

    def attention(*args, common_prefix_blocks=None, cache_dtype="", **kwargs):
        assert not cache_dtype  # bfloat16 caches as such (their bits only on the CPU platform)
        return pallas_kernels.ragged_paged_attention(*args, interpret=False, **kwargs)

    mesh = cuda_mesh(8, TP_AXIS)  # eight abstract H100s: the Triton lowering asks their kind

    def sharded(a, spec=None):  # jax 0.11's shard_map checks its inputs' shardings
        spec = PartitionSpec() if spec is None else spec
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    model = ShardedModel(cfg, mesh, attention)
    t, s, blocks = 64, 8, 16
    cache = sharded(jax.ShapeDtypeStruct((128, 16, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16),
                    kv_cache_specs(KV_CACHE_FORMATS["bfloat16"]).k)
    i32 = lambda *shape: sharded(jax.ShapeDtypeStruct(shape, jnp.int32))
    md = AttentionMetadata(i32(t), i32(s, blocks), i32(s), i32(s + 1), i32(), i32())
    rope = jax.tree.map(sharded, rope_table(cfg.rope, cfg.head_dim, 2048))
    params = jax.tree.map(sharded, abstract_params(cfg, jnp.bfloat16), partition_specs(cfg))

    def step(params, rope, caches, ids, positions, md):
        hidden, caches = model.forward_hidden(params, rope, caches, ids, positions, md)
        return model.compute_logits(params, hidden[:s]), caches

    with use_abstract_mesh(mesh):
        text = jax.jit(step).trace(params, rope, (KVCache(cache, cache),) * cfg.num_layers,
                                   i32(t), i32(t), md).lower(lowering_platforms=("cuda",)).as_text()
    assert has_triton_call(text)
    assert text.count("all_reduce") == 2 * cfg.num_layers + 1 and "all_gather" in text
    assert ("xi8>" in text) == (quantization is not None)


@pytest.mark.slow  # 30 s (two engines in a subprocess); test_update_weights covers the update by default
def test_update_weights_takes_a_trainers_sharded_arrays(test_models_dir):
    """Issue 64: a TP=2 engine's update_weights with arrays already sharded as the engine
    shards them keeps them as they are (the fused ones relaid out on the devices), adds
    no second copy of the weights, and gives one device's tokens."""
    multidevice.run("tp_update_weights", str(test_models_dir / "llama"), "2", devices=2)
