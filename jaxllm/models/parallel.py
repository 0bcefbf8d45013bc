"""Tensor parallelism: the model's forward over a device mesh, Megatron's way.

The mesh has one axis, `TP_AXIS`, of `tensor_parallel_size` devices. Parameters are
sharded as their declaration's logical axes say (partition_specs, by each parameter's format:
q/k/v and gate/up by output column, whole heads per shard; the attention output and down
projections by input row; embedding and output projection by vocabulary), the KV cache
by KV head, everything else (step inputs, metadata, rope table) replicated. Where the
shards outnumber the KV heads, each KV head is replicated on the shards whose query
heads read it, in the weights and in the cache (as vLLM does). The forward
runs shard-locally inside `jax.shard_map`: each device runs jaxllm.models.llama on its
shard with the shard's config (`shard_config`), so every attention backend (the Pallas
kernel, the XLA path, the CPU custom call) sees only its own heads; two all-reduces per
layer and one all-gather of the logits are the only communication.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.attention.backends import AttentionFn
from jaxllm.attention.kv_cache import KVCache, KVCacheFormat
from jaxllm.config import ModelConfig
from jaxllm.models.formats import declared_format
from jaxllm.models.llama import OutputRows, compute_logits, forward_hidden, forward_rows
from jaxllm.models.lora import LoRAInputs, lora_partition_specs
from jaxllm.models.params import (
    QUANT_FORMATS,
    TENSOR_PARALLEL_RULES,
    ModelParams,
    ShardingRules,
    declarations,
    declare,
    kv_replicas,
    map_declared,
    shard_major,
)

TP_AXIS = "model"
KV_CACHE_SPEC = P(None, None, TP_AXIS, None)  # [blocks, block_size, Hkv, hd]: by KV head
KV_SCALE_SPEC = P(None, None, TP_AXIS)  # an int8 cache's scales [blocks, block_size, Hkv]
KV_LAYER_SCALE_SPEC = P(TP_AXIS)  # an fp8 cache's scales per KV head [Hkv]


def check_tensor_parallel(cfg: ModelConfig, size: int, num_devices: int | None = None) -> None:
    """ValueError naming the constraint `size` breaks, if any."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1 (got {size})")
    available = len(jax.devices()) if num_devices is None else num_devices
    if size > available:
        raise ValueError(f"tensor_parallel_size={size}: only {available} devices are visible")
    reason = _unfit(cfg, size)
    if reason:
        raise ValueError(f"tensor_parallel_size={size} {reason}; possible sizes: "
                         f"{', '.join(map(str, possible_sizes(cfg)))}")


def _unfit(cfg: ModelConfig, size: int) -> str | None:
    """Why the model's shapes do not split into `size` shards, or None."""
    for what, n in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                    ("vocab_size", cfg.vocab_size), ("moe_intermediate_size", cfg.moe_intermediate_size),
                    ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if n % size:
            return f"must divide the model's {what} ({n})"
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        return (f"must divide the model's num_key_value_heads ({cfg.num_kv_heads}) or be a multiple of it "
                "(KV heads are then replicated)")
    return _unfit_groups(cfg, size)


def _unfit_groups(cfg: ModelConfig, size: int) -> str | None:
    """Why a row-parallel projection held in blocks (a scale per `group` inputs) would
    split a block between shards, or None."""
    for decl in declarations(cfg):
        group = QUANT_FORMATS[decl.quant].group if decl.quant and decl.transposed else 0
        if group and TENSOR_PARALLEL_RULES.get(decl.axes[-2]) and (decl.shape[-2] // size) % group:
            name = decl.hf[0][0].replace("{e}", "*")
            return (f"would split {name}'s blocks of {group} inputs ({decl.shape[-2]} inputs, "
                    f"{decl.shape[-2] // size} a shard; {decl.quant})")
    return None


def possible_sizes(cfg: ModelConfig) -> list[int]:
    """Tensor-parallel sizes this model's shapes allow."""
    return [n for n in range(1, cfg.num_heads + 1) if _unfit(cfg, n) is None]


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one shard's forward sees: its heads (one KV head where the shards
    outnumber them) and its share of the MLP (every expert's too: experts are sharded
    as the dense MLP is, each shard holding a slice of every expert) and the vocabulary."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
                               intermediate_size=cfg.intermediate_size // size, vocab_size=cfg.vocab_size // size,
                               moe_intermediate_size=cfg.moe_intermediate_size // size,
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size)


def cache_kv_heads(cfg: ModelConfig, size: int) -> int:
    """KV heads the sharded KV cache holds over the mesh: the model's, times their
    replicas when the shards outnumber them."""
    return cfg.num_kv_heads * kv_replicas(cfg, size)


def partition_specs(cfg: ModelConfig, rules: ShardingRules = TENSOR_PARALLEL_RULES) -> ModelParams:
    """A PartitionSpec per parameter, as its declared format shards it (jaxllm.models.
    formats: each logical axis mapped to a mesh axis by `rules`, unnamed ones replicated;
    a quantized weight's scales split with the axis they run along)."""
    return map_declared(lambda d: declared_format(d).partition_spec(d, rules), declare(cfg))


def make_mesh(size: int) -> Mesh:
    """A mesh of the first `size` devices along TP_AXIS."""
    return jax.make_mesh((size,), (TP_AXIS,), devices=jax.devices()[:size])


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> ModelParams:
    """A NamedSharding per parameter."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(cfg),
                        is_leaf=lambda x: isinstance(x, P))


def kv_cache_specs(fmt: KVCacheFormat, dtype: str | None = None) -> KVCache:
    """One layer's KV cache PartitionSpecs (by KV head), scales too where the format
    has them; `dtype`: the caches' KVCache.dtype (default: the format's on this
    platform), so that the specs' tree is theirs."""
    scales = (KV_SCALE_SPEC, KV_SCALE_SPEC) if fmt.scaled else (None, None)
    layer = (KV_LAYER_SCALE_SPEC, KV_LAYER_SCALE_SPEC) if fmt.layer_scaled else (None, None)
    return KVCache(KV_CACHE_SPEC, KV_CACHE_SPEC, *scales, *layer, fmt.bits_of() if dtype is None else dtype)


def kv_cache_sharding(mesh: Mesh, fmt: KVCacheFormat) -> KVCache:
    """The shardings over `mesh` of one layer's KV cache of format `fmt` (as
    kv_cache.cache_shapes makes it; see kv_cache_specs)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), kv_cache_specs(fmt))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place_params(cfg: ModelConfig, params: ModelParams, mesh: Mesh) -> ModelParams:
    """Params as loaded (one shard's layout), laid out shard-major and sharded over
    `mesh`; abstract ones (jax.ShapeDtypeStruct) get the shardings only."""
    shardings = param_shardings(cfg, mesh)
    laid_out = shard_major(cfg, params, mesh.shape[TP_AXIS])
    if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), laid_out, shardings)
    return jax.device_put(laid_out, shardings)


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """forward_hidden and compute_logits over `mesh`, with their signatures (the
    arguments whole, as the step holds them; the results replicated)."""

    cfg: ModelConfig
    mesh: Mesh
    attention_fn: AttentionFn

    @property
    def size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    def forward_hidden(self, params, rope, kv_caches, input_ids, positions, md, lora: LoRAInputs | None = None):
        """`lora`: the adapters' slots, A and B split as their projections (jaxllm.models.
        lora.lora_partition_specs), the tokens' slots replicated."""
        return self._over_mesh(forward_hidden, (params, rope, kv_caches, input_ids, positions, md), lora)

    def forward_rows(self, params, rope, kv_caches, input_ids, positions, md, out: OutputRows,
                     lora: LoRAInputs | None = None):
        """llama.forward_rows over the mesh: forward_hidden's arguments and `out`, replicated."""
        return self._over_mesh(forward_rows, (params, rope, kv_caches, input_ids, positions, md, out), lora)

    def _over_mesh(self, forward, args: tuple, lora: LoRAInputs | None):
        """`forward`(params, rope, kv_caches, *replicated, lora=) of one shard, in shard_map."""
        fn = functools.partial(forward, cfg=shard_config(self.cfg, self.size), attention_fn=self.attention_fn,
                               axis=TP_AXIS)
        caches = tuple(kv_cache_specs(c.format, c.dtype) for c in args[2])
        specs = (partition_specs(self.cfg), P(), caches) + (P(),) * (len(args) - 3)
        if lora is not None:
            args += (lora,)
            specs += (LoRAInputs(lora_partition_specs(self.cfg, self.size), P(), P(), P(), lora.kernel),)
        n = len(specs) - (lora is not None)
        return jax.shard_map(
            lambda *a: fn(*a[:n], lora=a[n] if lora is not None else None), mesh=self.mesh,
            in_specs=specs, out_specs=(P(), caches), check_vma=False,
        )(*args)

    def compute_logits(self, params, hidden, cfg=None, rows=None):
        """`cfg` is ignored (the model's own is used): llama.compute_logits' signature.
        `rows` too: tensor-parallel weights are plain, which compute every row."""
        del rows
        local = shard_config(self.cfg, self.size)
        return jax.shard_map(
            lambda p, h: compute_logits(p, h, local, axis=TP_AXIS), mesh=self.mesh,
            in_specs=(partition_specs(self.cfg), P()), out_specs=P(), check_vma=False,
        )(params, hidden)


def model_functions(cfg: ModelConfig, attention_fn: AttentionFn, mesh: Mesh | None = None):
    """(forward(params, rope, kv_caches, input_ids, positions, md, out), compute_logits(params,
    hidden, cfg)): jaxllm.models.llama's forward_rows on one device, ShardedModel's over a mesh."""
    if mesh is None:
        return functools.partial(forward_rows, cfg=cfg, attention_fn=attention_fn), compute_logits
    model = ShardedModel(cfg, mesh, attention_fn)
    return model.forward_rows, model.compute_logits
