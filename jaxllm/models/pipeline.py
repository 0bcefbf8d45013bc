"""Pipeline parallelism: the layers split into contiguous stages over a (stage, model)
mesh, tensor parallelism inside each stage, micro-batches so the stages overlap.

One SPMD program, as the rest of the engine is: the mesh has a `STAGE_AXIS` of
`pipeline_parallel_size` rows, each of `tensor_parallel_size` devices (jaxllm.models.
parallel's axis), and the step is still one executable, so one host or several hosts
under `jax.distributed` run it the same way. Where the layers live:

- Stage `s` holds the contiguous layers `StagePlan.bounds[s]` (the first stages take one
  more where the count does not divide). The per-layer parameters are stacked by stage:
  `ModelParams.layers[j]` holds every stage's j-th layer along a leading axis sharded
  over `STAGE_AXIS` (`stack_stages`; a stage with fewer layers holds zeros there and
  skips them), each layer's own split (jaxllm.models.params' declarations) after it.
- The KV cache of a layer lives with its stage: each stage keeps the cache slots its
  layers use (`CacheSlots`), its blocks a stage's share of each slot array (sharded by
  stage along the blocks axis), so a device holds 1/pp of the model's KV (its heads'
  share under tensor parallelism).
- The embedding and the output projection are split by vocabulary over every device of
  the mesh (stage and model axes together): the lookup and the logits are
  vocabulary-parallel across all of them, and nothing but the norms is held twice
  (where pp x tp does not divide the vocabulary, over each stage's tensor-parallel
  shards: `vocab_axes`).

The step's flat batch of T tokens is cut into M micro-batches of T / M consecutive
tokens (`microbatch_metadata`: a sequence cut between two micro-batches is a chunk of
it, as chunked prefill makes them; its first part's K/V is in the cache when the second
part attends). At tick t stage s runs micro-batch t - s, so after the first pp - 1 ticks
every stage is busy; the activations go to the next stage with `ppermute`, and the last
stage's hidden states are all-reduced to every device, where the logits and the sampler
run as on one device. A stage idle at a tick (the pipeline filling or draining) skips
its projections and MLPs (a per-device `cond`); where the stages' layers at one position
differ (Gemma's sliding and full layers), the RoPE and the attention are the stage's,
selected by the stage index (`_Position`: the caches stay out of every conditional).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from jaxllm.attention.backends import AttentionFn
from jaxllm.attention.kv_cache import KVCache, KVCacheFormat, copy_blocks, write_kv_cache
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.models.llama import (
    HiddenRows,
    OutputRows,
    attend,
    compute_logits,
    embed_input,
    finish_layer,
    qkv_heads,
    rope_rows,
)
from jaxllm.models.lora import LayerLoRA, LoRAInputs, LoRAWeights, lora_partition_specs
from jaxllm.models.parallel import TP_AXIS, check_tensor_parallel, partition_specs, shard_config
from jaxllm.models.parallel import model_functions as tensor_parallel_functions
from jaxllm.models.params import TENSOR_PARALLEL_RULES, ModelParams, ParamDecl, declare, shard_major

STAGE_AXIS = "stage"
BOTH = (STAGE_AXIS, TP_AXIS)  # the mesh's axes: the vocabulary's split where it divides it


def vocab_axes(cfg: ModelConfig, stages: int, shards: int) -> tuple[str, ...]:
    """The mesh axes the embedding and output projection are split over by vocabulary:
    every device where the vocabulary divides by their count, else the stage's tensor-
    parallel shards (each stage then holds the whole table's shards)."""
    return BOTH if cfg.vocab_size % (stages * shards) == 0 else (TP_AXIS,)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """`num_layers` layers over `num_stages` contiguous stages."""

    num_layers: int
    num_stages: int

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """Each stage's [first, end) layers; the first `num_layers % num_stages` stages
        take one more."""
        base, extra = divmod(self.num_layers, self.num_stages)
        ends = np.cumsum([base + (s < extra) for s in range(self.num_stages)])
        return tuple((int(e - base - (s < extra)), int(e)) for s, e in enumerate(ends))

    @property
    def depth(self) -> int:
        """Layer positions per stage (the most layers of any stage)."""
        return -(-self.num_layers // self.num_stages)

    def layer(self, stage: int, j: int) -> int | None:
        """The model layer at stage `stage`'s position `j` (None: the stage is shorter)."""
        first, end = self.bounds[stage]
        return first + j if first + j < end else None


@dataclasses.dataclass(frozen=True)
class CacheSlots:
    """Which cache slot (jaxllm.kv_cache_groups) each layer writes, per stage: stage s
    keeps the slots its layers use, `used[s]`, as its local slots 0.. (the rest of the
    model's slots are other stages'); every stage holds `count` local slots."""

    used: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return max(map(len, self.used))

    def local(self, stage: int, global_slot: int) -> int:
        return self.used[stage].index(global_slot)


def cache_slots(plan: StagePlan, groups: KVCacheGroups) -> CacheSlots:
    return CacheSlots(tuple(tuple(sorted({groups.slot_of(i) for i in range(a, b)})) for a, b in plan.bounds))


def check_pipeline_parallel(cfg: ModelConfig, size: int, tensor_parallel_size: int = 1,
                            num_devices: int | None = None) -> StagePlan:
    """The stages of `cfg` at pipeline_parallel_size `size`; ValueError naming what the
    split breaks."""
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1 (got {size})")
    available = len(jax.devices()) if num_devices is None else num_devices
    if size * tensor_parallel_size > available:
        raise ValueError(f"pipeline_parallel_size={size} x tensor_parallel_size={tensor_parallel_size}: "
                         f"only {available} devices are visible")
    check_tensor_parallel(cfg, tensor_parallel_size, available)
    if size > cfg.num_layers:
        raise ValueError(f"pipeline_parallel_size={size} exceeds the model's {cfg.num_layers} layers")
    plan = StagePlan(cfg.num_layers, size)
    decls = declare(cfg).layers
    for j in range(plan.depth):
        layers = [i for s in range(size) if (i := plan.layer(s, j)) is not None]
        named = ", ".join(map(str, layers))
        if len({_shapes(decls[i]) for i in layers}) > 1:
            raise ValueError(f"pipeline_parallel_size={size}: layers {named} would share a stage position but differ "
                             "in their parameters' shapes (a model mixing dense and expert layers); choose another "
                             "size")
        if len({_formats(decls[i]) for i in layers}) > 1:
            raise ValueError(f"pipeline_parallel_size={size}: layers {named} would share a stage position but hold "
                             "their weights in different formats (a GGUF of mixed block types); quantization none "
                             "dequantizes them, or choose another size")
    return plan


def _is_decl(x) -> bool:
    return isinstance(x, ParamDecl)


def _shapes(layer_decls) -> tuple:
    """What a layer's parameters must share with the layers stacked with it: shapes."""
    leaves = tuple(d.shape for d in jax.tree.leaves(layer_decls, is_leaf=_is_decl))
    return leaves, jax.tree.structure(layer_decls, is_leaf=_is_decl)


def _formats(layer_decls) -> tuple:
    """And formats (a quantized weight's blocks)."""
    return tuple(d.quant for d in jax.tree.leaves(layer_decls, is_leaf=_is_decl))


def make_mesh(pipeline: int, tensor: int) -> Mesh:
    """A (stage, model) mesh of the first pipeline x tensor devices: stage s on
    devices s * tensor .. (each host's devices together, where a stage is a host)."""
    return jax.make_mesh((pipeline, tensor), BOTH, devices=jax.devices()[:pipeline * tensor])


def stages_of(mesh: Mesh | AbstractMesh | None) -> int:
    """The pipeline stages of `mesh` (1: none, or a tensor-parallel mesh)."""
    return 1 if mesh is None or STAGE_AXIS not in mesh.axis_names else mesh.shape[STAGE_AXIS]


def stack_stages(params, plan: StagePlan):
    """Per layer position j, every stage's j-th layer stacked along a new leading axis (a
    shorter stage's: zeros); abstract params (jax.ShapeDtypeStruct) get the shapes. Any
    per-layer tree with `.layers` (ModelParams, LoRAWeights)."""
    def stack(*leaves):
        first = leaves[0]
        if isinstance(first, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((len(leaves),) + first.shape, first.dtype)
        return (np if isinstance(first, np.ndarray) else jnp).stack(leaves)

    def zeros(a):
        return a if isinstance(a, jax.ShapeDtypeStruct) else (np if isinstance(a, np.ndarray) else jnp).zeros_like(a)

    layers = []
    for j in range(plan.depth):
        held = [plan.layer(s, j) for s in range(plan.num_stages)]
        template = params.layers[held[0]]
        stage_layers = [jax.tree.map(zeros, template) if i is None else params.layers[i] for i in held]
        layers.append(jax.tree.map(stack, *stage_layers))
    return params.replace(layers=tuple(layers))


def _staged_specs(specs, plan: StagePlan):
    """Per-layer PartitionSpecs (ModelParams' or LoRAWeights') for the layers stacked by
    stage (`stack_stages`): each position's by stage, then its layer's own split."""
    staged = lambda spec: P(STAGE_AXIS, *spec)
    layers = tuple(jax.tree.map(staged, specs.layers[plan.layer(0, j)], is_leaf=lambda x: isinstance(x, P))
                   for j in range(plan.depth))
    return specs.replace(layers=layers)


def pipeline_specs(cfg: ModelConfig, plan: StagePlan, shards: int) -> ModelParams:
    """A PartitionSpec per stacked parameter: the layers' by stage, then as their format
    splits them for tensor parallelism; the vocabulary over both axes."""
    return _staged_specs(partition_specs(cfg, {**TENSOR_PARALLEL_RULES,
                                                "vocab": vocab_axes(cfg, plan.num_stages, shards)}), plan)


def lora_specs(cfg: ModelConfig, mesh: Mesh | AbstractMesh) -> LoRAWeights:
    """The adapters' slots' PartitionSpecs over a tensor-parallel or (stage, model) mesh:
    split as their projections inside a stage (lora.lora_partition_specs), stacked by
    stage as the layers are (`stage_layers`)."""
    specs = lora_partition_specs(cfg, mesh.shape[TP_AXIS])
    stages = stages_of(mesh)
    return specs if stages == 1 else _staged_specs(specs, StagePlan(cfg.num_layers, stages))


def stage_layers(tree, cfg: ModelConfig, mesh: Mesh | AbstractMesh | None):
    """Per-layer weights (ModelParams, LoRAWeights; abstract or not) stacked by stage
    where `mesh` has pipeline stages; as they are otherwise."""
    stages = stages_of(mesh)
    return tree if stages == 1 else stack_stages(tree, StagePlan(cfg.num_layers, stages))


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> ModelParams:
    plan = StagePlan(cfg.num_layers, stages_of(mesh))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), pipeline_specs(cfg, plan, mesh.shape[TP_AXIS]),
                        is_leaf=lambda x: isinstance(x, P))


def place_params(cfg: ModelConfig, params: ModelParams, mesh: Mesh) -> ModelParams:
    """Params as loaded, laid out shard-major for the stages' tensor parallelism, stacked
    by stage and sharded over `mesh`: each device receives its stage's layers (its
    shard of them) and its share of the vocabulary; abstract ones get the shardings."""
    shardings = param_shardings(cfg, mesh)
    stacked = stage_layers(shard_major(cfg, params, mesh.shape[TP_AXIS]), cfg, mesh)
    if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), stacked, shardings)
    return jax.device_put(stacked, shardings)


def kv_cache_specs(fmt: KVCacheFormat, dtype: str | None = None) -> KVCache:
    """A local slot's specs, [stages x blocks, block_size, Hkv, hd]: each stage its own
    `blocks` (its layers' K/V of every block id), by KV head inside it; `dtype` as
    parallel.kv_cache_specs'. (fp8 scales per layer are not staged: the engine refuses
    them with pipeline stages.)"""
    if fmt.layer_scaled:
        raise ValueError("calculate_kv_scales: fp8 KV cache scales are not supported with pipeline parallelism")
    rows, scale = P(STAGE_AXIS, None, TP_AXIS, None), P(STAGE_AXIS, None, TP_AXIS)
    return KVCache(rows, rows, *((scale, scale) if fmt.scaled else (None, None)),
                   dtype=fmt.bits_of() if dtype is None else dtype)


def kv_cache_sharding(mesh: Mesh, fmt: KVCacheFormat) -> KVCache:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), kv_cache_specs(fmt))


def staged_cache_shapes(abstract: tuple[KVCache, ...], stages: int, sharding: KVCache) -> tuple[KVCache, ...]:
    """`cache_shapes`' caches (one per local slot) for every stage, the stages' blocks
    one after the other along the blocks axis, sharded by stage. (Not a leading stage
    axis: reshaping it away inside the step let XLA:CPU give a 1-KV-head cache another
    layout and copy the whole pool back at every step.)"""
    def staged(a, s):
        return None if a is None else jax.ShapeDtypeStruct((stages * a.shape[0],) + a.shape[1:], a.dtype, sharding=s)

    return tuple(KVCache(*(staged(getattr(c, f), getattr(sharding, f)) for f in ("k", "v", "k_scale", "v_scale")),
                         dtype=c.dtype) for c in abstract)


def staged_copy_blocks(mesh: Mesh, caches: tuple[KVCache, ...]):
    """kv_cache.copy_blocks on each stage's own blocks (block ids are a stage's local
    ones), for caches like `caches` (abstract or not) over `mesh`."""
    specs = tuple(kv_cache_specs(c.format, c.dtype) for c in caches)
    return jax.shard_map(copy_blocks, mesh=mesh, in_specs=(specs, P(), P()), out_specs=specs, check_vma=False)


def microbatch_metadata(md: AttentionMetadata, m: Int[Array, ""], size: int) -> AttentionMetadata:
    """The metadata of tokens [m * size, (m + 1) * size) of the step's flat batch: each
    sequence keeps the part of its tokens that lies there (none: q_len 0 and seq_len 0,
    as padding sequences have), its seq_len counting its tokens up to the part's end."""
    start = m * size
    qsl = jnp.clip(md.query_start_loc, start, start + size)
    q_lens = qsl[1:] - qsl[:-1]
    after = md.query_start_loc[1:] - qsl[1:]  # the sequence's tokens in later micro-batches
    seq_lens = jnp.where(q_lens > 0, md.seq_lens - after, 0)
    slots = jax.lax.dynamic_slice(md.slot_mapping, (start,), (size,))
    return AttentionMetadata(slots, md.block_tables, seq_lens.astype(md.seq_lens.dtype), qsl - start, md.num_seqs,
                             jnp.zeros_like(md.common_prefix_blocks))


def num_microbatches(num_tokens: int, stages: int) -> int:
    """Micro-batches a step of `num_tokens` (its bucket) is cut into: as many as stages
    (vLLM keeps that many batches in flight), or the most up to that which divide it."""
    return max(m for m in range(1, stages + 1) if num_tokens % m == 0)


@dataclasses.dataclass(frozen=True)
class PipelinedModel:
    """forward_rows and compute_logits over a (stage, model) mesh, with llama's
    signatures (the arguments whole; the results replicated)."""

    cfg: ModelConfig
    mesh: Mesh | AbstractMesh  # abstract: lowered for devices this machine lacks
    attention_fn: AttentionFn

    @property
    def plan(self) -> StagePlan:
        return StagePlan(self.cfg.num_layers, self.mesh.shape[STAGE_AXIS])

    @property
    def vocab_axes(self) -> tuple[str, ...]:
        return vocab_axes(self.cfg, self.mesh.shape[STAGE_AXIS], self.mesh.shape[TP_AXIS])

    @property
    def specs(self) -> ModelParams:
        return pipeline_specs(self.cfg, self.plan, self.mesh.shape[TP_AXIS])

    @property
    def local_cfg(self) -> ModelConfig:
        """A device's config: its stage's heads as tensor parallelism splits them, its
        share of the vocabulary."""
        held = math.prod(self.mesh.shape[a] for a in self.vocab_axes)
        return dataclasses.replace(shard_config(self.cfg, self.mesh.shape[TP_AXIS]),
                                   vocab_size=self.cfg.vocab_size // held)

    def forward_rows(self, params, rope, kv_caches, input_ids, positions, md, out: OutputRows,
                     lora: LoRAInputs | None = None):
        """`lora`: the adapters' slots stacked by stage (`lora_specs`), the tokens' slots
        replicated."""
        groups = self.cfg.kv_cache_groups(hybrid=isinstance(md, tuple))
        body = functools.partial(_pipeline, cfg=self.local_cfg, plan=self.plan, slots=cache_slots(self.plan, groups),
                                 groups=groups, attention_fn=self.attention_fn, vocab=self.vocab_axes)
        caches = tuple(kv_cache_specs(c.format, c.dtype) for c in kv_caches)
        specs = (self.specs, P(), caches, P(), P(), P(), P())
        lora_spec = None if lora is None else LoRAInputs(lora_specs(self.cfg, self.mesh), P(), P(), P(), lora.kernel)
        return jax.shard_map(body, mesh=self.mesh, in_specs=specs + (lora_spec,), out_specs=(P(), caches),
                             check_vma=False)(params, rope, kv_caches, input_ids, positions, md, out, lora)

    def compute_logits(self, params, hidden, cfg=None, rows=None):
        """llama.compute_logits' signature (`cfg` and `rows` ignored): vocabulary-parallel
        over every device, gathered."""
        del cfg, rows
        return jax.shard_map(lambda p, h: compute_logits(p, h, self.local_cfg, axis=self.vocab_axes), mesh=self.mesh,
                             in_specs=(self.specs, P()), out_specs=P(), check_vma=False,
                             )(params, hidden)


def _pipeline(params, rope, kv_caches, input_ids, positions, md, out: OutputRows, lora: LoRAInputs | None, *,
              cfg: ModelConfig, plan: StagePlan, slots: CacheSlots, groups: KVCacheGroups, attention_fn: AttentionFn,
              vocab: tuple[str, ...]):
    """One device's pipeline (inside shard_map): embed (the vocabulary split over
    `vocab`), the ticks, the last stage's hidden states to every device, the rows `out`
    names. `lora`: the stage's adapter slots, each micro-batch's tokens' slots."""
    stages, stage = plan.num_stages, jax.lax.axis_index(STAGE_AXIS)
    x = embed_input(params, input_ids, cfg, vocab)
    t_total = x.shape[0]
    m_count = num_microbatches(t_total, stages)
    size = t_total // m_count
    mds = md if isinstance(md, tuple) else (md,)
    caches = kv_caches  # this stage's blocks
    layers = tuple(jax.tree.map(lambda a: a[0], lp) for lp in params.layers)
    if lora is not None:
        lora = lora.replace(weights=jax.tree.map(lambda a: a[0], lora.weights))  # this stage's
    positions_of = [_Position.make(j, cfg, plan, slots, groups) for j in range(plan.depth)]
    received = jnp.zeros((size, x.shape[1]), x.dtype)
    hidden = jnp.zeros_like(x)
    last = stage == stages - 1
    for tick in range(m_count + stages - 1):
        m = tick - stage
        active = (m >= 0) & (m < m_count)
        mc = jnp.clip(m, 0, m_count - 1)
        first_in = jax.lax.dynamic_slice_in_dim(x, min(tick, m_count - 1) * size, size)
        y = jnp.where(stage == 0, first_in, received)
        ropes = rope_rows(rope, jax.lax.dynamic_slice_in_dim(positions, mc * size, size))
        mb_mds = tuple(microbatch_metadata(g, mc, size) for g in mds)
        mb_lora = None if lora is None else lora.tokens(mc * size, size)
        for position, lp in zip(positions_of, layers):
            with jax.named_scope(f"position{position.j}"):
                y, caches = position.run(lp, y, caches, ropes, mb_mds, active, stage,
                                         None if mb_lora is None else mb_lora.layer(position.j), cfg=cfg,
                                         attention_fn=attention_fn)
        hidden = jnp.where(last & active, jax.lax.dynamic_update_slice_in_dim(hidden, y, mc * size, 0), hidden)
        if tick < m_count + stages - 2:
            received = jax.lax.ppermute(y, STAGE_AXIS, [(s, s + 1) for s in range(stages - 1)])
    hidden = jax.lax.psum(jnp.where(last, hidden, 0), STAGE_AXIS)
    rows = HiddenRows(hidden[out.indices], jnp.where(out.every, hidden, 0))
    return rows, caches


class _Kind(typing.NamedTuple):
    """A layer as the pipeline's attention sees it (window 0: full)."""

    sliding: bool
    window: int
    moe: bool
    group: int  # its KV cache group
    slot: int  # its stage's local cache slot

    @property
    def attention(self) -> tuple[int, int]:
        return self.window, self.slot


@dataclasses.dataclass(frozen=True)
class _Position:
    """Layer position `j` of every stage: each stage's model layer there (None: none)
    and its kind (RoPE, window, experts, KV cache group, local slot). The caches are
    never an operand of a `cond` or `switch`: XLA:CPU copied the cache arrays it passed
    to a conditional, even read-only, at every tick (a step's time grew with the KV
    pool: docs/bench-log/2026-11-29-pipeline-ray.md). So the K/V of an idle tick, or of a
    stage whose layer writes another slot, go to the null block, and the attention runs
    outside any conditional, once per distinct (window, slot) at the position, each
    through the metadata of the stage's layer's KV cache group (Gemma's sliding layers
    of different groups share one attention)."""

    j: int
    layers: tuple[int | None, ...]
    kinds: tuple[_Kind | None, ...]

    @classmethod
    def make(cls, j: int, cfg: ModelConfig, plan: StagePlan, slots: CacheSlots, groups: KVCacheGroups) -> _Position:
        layers = tuple(plan.layer(s, j) for s in range(plan.num_stages))
        kinds = tuple(None if i is None else _Kind(cfg.is_sliding(i), cfg.layer_window(i) or 0, cfg.is_moe(i),
                                                   groups.group_of(i), slots.local(s, groups.slot_of(i)))
                      for s, i in enumerate(layers))
        return cls(j, layers, kinds)

    def _of_stage(self, values, stage):
        """values[stage] (a static value where every stage has the same)."""
        return values[0] if len(set(values)) == 1 else jnp.asarray(values)[stage]

    def _stage_metadata(self, mds, stage) -> AttentionMetadata:
        """The attention metadata of the stage's layer's KV cache group here (the groups'
        block tables, lengths and slots selected by stage where the stages' differ)."""
        group = self._of_stage([kind.group if kind is not None else 0 for kind in self.kinds], stage)
        if isinstance(group, int):
            return mds[group]
        return jax.tree.map(lambda *xs: jnp.stack(xs)[group], *mds)

    def run(self, lp, x, caches, ropes, mds, active, stage, lora: LayerLoRA | None, *, cfg: ModelConfig,
            attention_fn: AttentionFn):
        """This position's layer on the stage's micro-batch `x` where `active`: the
        projections and MLP under a `cond` (skipped on an idle tick), the K/V writes and
        the attention outside it (an idle tick writes into the null block and attends
        for nothing); where the stages' layers differ in kind, each kind's attention,
        the stage's selected."""
        here = active & self._of_stage([i is not None for i in self.layers], stage)
        sliding = self._of_stage([bool(k and k.sliding) for k in self.kinds], stage)
        cos, sin = ropes[sliding] if isinstance(sliding, bool) else (
            jnp.where(sliding, a, b) for a, b in zip(ropes[1], ropes[0]))
        rows = mds[0].num_tokens
        q, k, v = jax.lax.cond(here, lambda x: qkv_heads(lp, x, cos, sin, cfg, lora, rows),
                               lambda x: _no_heads(x, cfg), x)
        caches = list(caches)
        null = jnp.arange(x.shape[0], dtype=jnp.int32) % caches[0].k.shape[1]  # offsets in block 0
        md = self._stage_metadata(mds, stage)
        for slot in sorted({kind.slot for kind in self.kinds if kind is not None}):
            mine = self._of_stage([kind is not None and kind.slot == slot for kind in self.kinds], stage)
            caches[slot] = write_kv_cache(caches[slot], k, v, jnp.where(here & mine, md.slot_mapping, null))
        # one attention per (window, slot) the stages use here, each through the stage's group's tables
        distinct = sorted({kind.attention for kind in self.kinds if kind is not None})
        outs = [attend(q, caches[slot], md, cfg, attention_fn, window or None) for window, slot in distinct]
        which = self._of_stage([distinct.index(kind.attention) if kind is not None else 0 for kind in self.kinds],
                               stage)
        o = outs[0] if len(outs) == 1 else jnp.stack(outs)[which]
        moe = next(kind.moe for kind in self.kinds if kind is not None)  # every stage's: their parameters stack
        x = jax.lax.cond(here, lambda x, o: finish_layer(lp, x, o, rows, lora, cfg=cfg, axis=TP_AXIS, moe=moe),
                         lambda x, o: x, x, o)
        return x, tuple(caches)


def _no_heads(x, cfg: ModelConfig):
    t = x.shape[0]
    zeros = lambda heads: jnp.zeros((t, heads, cfg.head_dim), x.dtype)
    return zeros(cfg.num_heads), zeros(cfg.num_kv_heads), zeros(cfg.num_kv_heads)


def model_functions(cfg: ModelConfig, attention_fn: AttentionFn, mesh: Mesh | None = None):
    """(forward_rows, compute_logits) for one device, a tensor-parallel mesh or a
    (stage, model) mesh."""
    if stages_of(mesh) > 1:
        model = PipelinedModel(cfg, mesh, attention_fn)
        return model.forward_rows, model.compute_logits
    return tensor_parallel_functions(cfg, attention_fn, mesh)
