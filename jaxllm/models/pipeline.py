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
  layers use, stacked the same way (`CacheSlots`), so a device holds 1/pp of the
  model's KV (its heads' share under tensor parallelism).
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
its layers (a per-device `cond`). Layers that differ between stages at one position
(Gemma's sliding and full layers) are chosen with `lax.switch` on the stage index.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from jaxllm.attention.backends import AttentionFn
from jaxllm.attention.kv_cache import KVCache, KVCacheFormat
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.models.llama import HiddenRows, OutputRows, compute_logits, decoder_layer, embed_input, rope_rows
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
        shapes = {_shapes(decls[i]) for i in layers}
        if len(shapes) > 1:
            raise ValueError(f"pipeline_parallel_size={size}: layers {', '.join(map(str, layers))} would share a "
                             "stage position but differ in their parameters' shapes (a model mixing dense and "
                             "expert layers); choose another size")
    return plan


def _shapes(layer_decls) -> tuple:
    return tuple((d.shape, d.quant) for d in jax.tree.leaves(layer_decls, is_leaf=lambda x: isinstance(x, ParamDecl)))


def make_mesh(pipeline: int, tensor: int) -> Mesh:
    """A (stage, model) mesh of the first pipeline x tensor devices: stage s on
    devices s * tensor .. (each host's devices together, where a stage is a host)."""
    return jax.make_mesh((pipeline, tensor), BOTH, devices=jax.devices()[:pipeline * tensor])


def stages_of(mesh: Mesh | None) -> int:
    """The pipeline stages of `mesh` (1: none, or a tensor-parallel mesh)."""
    return 1 if mesh is None or STAGE_AXIS not in mesh.axis_names else mesh.shape[STAGE_AXIS]


def stack_stages(params: ModelParams, plan: StagePlan) -> ModelParams:
    """Per layer position j, every stage's j-th layer stacked along a new leading axis (a
    shorter stage's: zeros); abstract params (jax.ShapeDtypeStruct) get the shapes."""
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


def pipeline_specs(cfg: ModelConfig, plan: StagePlan, shards: int) -> ModelParams:
    """A PartitionSpec per stacked parameter: the layers' by stage, then as their format
    splits them for tensor parallelism; the vocabulary over both axes."""
    specs = partition_specs(cfg, {**TENSOR_PARALLEL_RULES, "vocab": vocab_axes(cfg, plan.num_stages, shards)})
    staged = lambda spec: P(STAGE_AXIS, *spec)
    layers = tuple(jax.tree.map(staged, specs.layers[plan.layer(0, j)], is_leaf=lambda x: isinstance(x, P))
                   for j in range(plan.depth))
    return specs.replace(layers=layers)


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> ModelParams:
    plan = StagePlan(cfg.num_layers, stages_of(mesh))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), pipeline_specs(cfg, plan, mesh.shape[TP_AXIS]),
                        is_leaf=lambda x: isinstance(x, P))


def place_params(cfg: ModelConfig, params: ModelParams, mesh: Mesh) -> ModelParams:
    """Params as loaded, laid out shard-major for the stages' tensor parallelism, stacked
    by stage and sharded over `mesh`: each device receives its stage's layers (its
    shard of them) and its share of the vocabulary; abstract ones get the shardings."""
    plan = StagePlan(cfg.num_layers, stages_of(mesh))
    shardings = param_shardings(cfg, mesh)
    stacked = stack_stages(shard_major(cfg, params, mesh.shape[TP_AXIS]), plan)
    if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), stacked, shardings)
    return jax.device_put(stacked, shardings)


def kv_cache_specs(scaled: bool, dtype: str = "") -> KVCache:
    """A local slot's specs, [stages, blocks, block_size, Hkv, hd]: by stage and KV head."""
    rows, scale = P(STAGE_AXIS, None, None, TP_AXIS, None), P(STAGE_AXIS, None, None, TP_AXIS)
    return KVCache(rows, rows, *((scale, scale) if scaled else (None, None)), dtype)


def kv_cache_sharding(mesh: Mesh, fmt: KVCacheFormat) -> KVCache:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), kv_cache_specs(fmt.scaled, fmt.bits_of()))


def staged_cache_shapes(abstract: tuple[KVCache, ...], stages: int, sharding: KVCache) -> tuple[KVCache, ...]:
    """`cache_shapes`' caches (one per local slot) with a leading stage axis, sharded."""
    def staged(a, s):
        return None if a is None else jax.ShapeDtypeStruct((stages,) + a.shape, a.dtype, sharding=s)

    return tuple(KVCache(*(staged(getattr(c, f), getattr(sharding, f)) for f in ("k", "v", "k_scale", "v_scale")),
                         c.dtype) for c in abstract)


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
    (vLLM keeps that many batches in flight), fewer where they would not divide it."""
    return math.gcd(num_tokens, stages)


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

    def forward_rows(self, params, rope, kv_caches, input_ids, positions, md, out: OutputRows, lora=None):
        if lora is not None:
            raise ValueError("pipeline parallelism does not yet apply LoRA adapters")
        groups = self.cfg.kv_cache_groups(hybrid=isinstance(md, tuple))
        body = functools.partial(_pipeline, cfg=self.local_cfg, plan=self.plan, slots=cache_slots(self.plan, groups),
                                 groups=groups, attention_fn=self.attention_fn, vocab=self.vocab_axes)
        caches = tuple(kv_cache_specs(c.k_scale is not None, c.dtype) for c in kv_caches)
        specs = (self.specs, P(), caches, P(), P(), P(), P())
        return jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=(P(), caches), check_vma=False)(
            params, rope, kv_caches, input_ids, positions, md, out)

    def compute_logits(self, params, hidden, cfg=None, rows=None):
        """llama.compute_logits' signature (`cfg` and `rows` ignored): vocabulary-parallel
        over every device, gathered."""
        del cfg, rows
        return jax.shard_map(lambda p, h: compute_logits(p, h, self.local_cfg, axis=self.vocab_axes), mesh=self.mesh,
                             in_specs=(self.specs, P()), out_specs=P(), check_vma=False,
                             )(params, hidden)


def _pipeline(params, rope, kv_caches, input_ids, positions, md, out: OutputRows, *, cfg: ModelConfig,
              plan: StagePlan, slots: CacheSlots, groups: KVCacheGroups, attention_fn: AttentionFn,
              vocab: tuple[str, ...]):
    """One device's pipeline (inside shard_map): embed (the vocabulary split over
    `vocab`), the ticks, the last stage's hidden states to every device, the rows `out`
    names."""
    stages, stage = plan.num_stages, jax.lax.axis_index(STAGE_AXIS)
    x = embed_input(params, input_ids, cfg, vocab)
    t_total = x.shape[0]
    m_count = num_microbatches(t_total, stages)
    size = t_total // m_count
    mds = md if isinstance(md, tuple) else (md,)
    caches = tuple(jax.tree.map(lambda a: a[0], c) for c in kv_caches)  # this stage's
    layers = tuple(jax.tree.map(lambda a: a[0], lp) for lp in params.layers)
    run = functools.partial(_stage_layers, layers, cfg=cfg, plan=plan, slots=slots, groups=groups,
                            attention_fn=attention_fn, stage=stage)
    received = jnp.zeros((size, x.shape[1]), x.dtype)
    hidden = jnp.zeros_like(x)
    last = stage == stages - 1
    for tick in range(m_count + stages - 1):
        m = tick - stage
        active = (m >= 0) & (m < m_count)
        mc = jnp.clip(m, 0, m_count - 1)
        first_in = jax.lax.dynamic_slice_in_dim(x, min(tick, m_count - 1) * size, size)
        inputs = jnp.where(stage == 0, first_in, received)
        pos = jax.lax.dynamic_slice_in_dim(positions, mc * size, size)
        mb_mds = tuple(microbatch_metadata(g, mc, size) for g in mds)
        y, caches = jax.lax.cond(active, lambda a, c, p, g: run(a, c, rope_rows(rope, p), g),
                                 lambda a, c, p, g: (a, c), inputs, caches, pos, mb_mds)
        hidden = jnp.where(last & active, jax.lax.dynamic_update_slice_in_dim(hidden, y, mc * size, 0), hidden)
        if tick < m_count + stages - 2:
            received = jax.lax.ppermute(y, STAGE_AXIS, [(s, s + 1) for s in range(stages - 1)])
    hidden = jax.lax.psum(jnp.where(last, hidden, 0), STAGE_AXIS)
    rows = HiddenRows(hidden[out.indices], jnp.where(out.every, hidden, 0))
    return rows, tuple(jax.tree.map(lambda a: a[None], c) for c in caches)


def _stage_layers(layers, x, caches, ropes, mds, *, cfg: ModelConfig, plan: StagePlan, slots: CacheSlots,
                  groups: KVCacheGroups, attention_fn: AttentionFn, stage):
    """This stage's layers over one micro-batch: at each position the layer every stage
    runs there, or (where they differ) the stage's own, chosen by `lax.switch`."""
    caches = list(caches)
    for j, lp in enumerate(layers):
        kinds = {}  # one branch per distinct layer kind at this position
        index = []
        for s in range(plan.num_stages):
            i = plan.layer(s, j)
            key = None if i is None else (cfg.is_sliding(i), cfg.layer_window(i), cfg.is_moe(i), groups.group_of(i),
                                          slots.local(s, groups.slot_of(i)))
            index.append(kinds.setdefault(key, (len(kinds), i))[0])
        branches = [functools.partial(_one_layer, i, lp, mds=mds, ropes=ropes, cfg=cfg, groups=groups,
                                      slot=None if key is None else key[-1], attention_fn=attention_fn)
                    for key, (_, i) in kinds.items()]
        with jax.named_scope(f"position{j}"):
            if len(branches) == 1:
                x, caches = branches[0](x, caches)
            else:
                x, caches = jax.lax.switch(jnp.asarray(index, jnp.int32)[stage], branches, x, caches)
    return x, tuple(caches)


def _one_layer(i: int | None, lp, x, caches: list, *, mds, ropes, cfg: ModelConfig, groups: KVCacheGroups,
               slot: int | None, attention_fn: AttentionFn):
    """Model layer `i` writing local cache slot `slot` (None: no layer here)."""
    if i is None:
        return x, caches
    caches = list(caches)
    x, caches[slot] = decoder_layer(i, lp, x, ropes, caches[slot], mds[groups.group_of(i)], cfg, attention_fn,
                                    TP_AXIS, None)
    return x, caches


def model_functions(cfg: ModelConfig, attention_fn: AttentionFn, mesh: Mesh | None = None):
    """(forward_rows, compute_logits) for one device, a tensor-parallel mesh or a
    (stage, model) mesh."""
    if stages_of(mesh) > 1:
        model = PipelinedModel(cfg, mesh, attention_fn)
        return model.forward_rows, model.compute_logits
    return tensor_parallel_functions(cfg, attention_fn, mesh)
