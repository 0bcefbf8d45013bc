"""LoRA adapters in the step: every adapter of the engine's device slots applied in one
batched product, each token through its own request's adapter (Punica's idea, as
dense matmuls XLA runs at fixed shapes).

For each projection of each layer (the fused ones too: q | k | v, gate | up), the
slots' A matrices sit side by side, [D, L, P, R] (inputs, slot, part of the fusion,
rank), and each part's B matrices, [L, R, N_p] (scaled by alpha / r at load). A token
of slot l (1..L; 0: the base model alone) adds x A_l,p B_l,p to part p's columns:
x times every slot's A at once ([T, L*P*R]), zeroed outside the token's slot, times
every slot's B stacked along the contraction: L times the multiply-adds one adapter
needs (a sort by slot and `lax.ragged_dot` measured slower than these dense dots on
XLA:CPU: docs/bench-log/2026-11-22..27-structured-spec-lora-kv-manager.md). Shapes depend on L and R only: loading an adapter into a slot changes
values, never a shape, so nothing recompiles. Which projections there are, and their
parts' widths, come from the parameter declaration (jaxllm.models.params.declare).
With `kernel="pallas"` (the `pallas` linear backend) the products run through the
Pallas kernels of pallas_kernels.lora instead, which skip the slots a tile of tokens
does not use (interpret mode off GPU).
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jaxllm.config import ModelConfig
from jaxllm.models.params import TENSOR_PARALLEL_RULES, ParamDecl, ShardingRules, declare, kv_replicas
from jaxllm.platform import targets_gpu

# the projections an adapter may target, by LayerParams field
TARGET_FIELDS = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclasses.dataclass(frozen=True)
class LoRATarget:
    """One projection of one layer as adapters see it: its inputs, the modules (HF
    names: q_proj, ...) fused in it with their widths, and the logical axes of its
    inputs and outputs (for sharding)."""

    layer: int
    field: str
    in_features: int
    parts: tuple[tuple[str, int], ...]
    axes: tuple[str | None, str | None]


def lora_targets(cfg: ModelConfig) -> list[LoRATarget]:
    """Every projection adapters may target, from the parameter declaration. ValueError
    for a model whose MLP is a mixture of experts (adapters on experts: not supported)."""
    if any(cfg.is_moe(i) for i in range(cfg.num_layers)):
        raise ValueError("enable_lora: LoRA on a mixture-of-experts model is not supported")
    targets = []
    for i, layer in enumerate(declare(cfg).layers):
        for name in TARGET_FIELDS:
            decl: ParamDecl = getattr(layer, name)
            parts = tuple((hf.split(".")[-2], n) for hf, n in decl.hf)
            targets.append(LoRATarget(i, name, decl.shape[0], parts, (decl.axes[0], decl.axes[-1])))
    return targets


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class LoRAProjection:
    a: Float[Array, "D L P R"]  # inputs, slot, part, rank
    b: tuple[Float[Array, "L R N"], ...]  # per part


@typing.no_type_check
@struct.dataclass
class LoRAWeights:
    """The device slots: per layer, a LoRAProjection per TARGET_FIELDS entry."""

    layers: tuple[dict[str, LoRAProjection], ...]

    @property
    def num_slots(self) -> int:
        return self.layers[0]["wqkv"].a.shape[-3]  # (stage,) inputs, slot, part, rank


def abstract_lora(cfg: ModelConfig, max_loras: int, max_rank: int, dtype) -> LoRAWeights:
    """The slots' shapes (jax.ShapeDtypeStruct leaves)."""
    per_layer: list[dict[str, LoRAProjection]] = [{} for _ in range(cfg.num_layers)]
    for t in lora_targets(cfg):
        a = jax.ShapeDtypeStruct((t.in_features, max_loras, len(t.parts), max_rank), dtype)
        b = tuple(jax.ShapeDtypeStruct((max_loras, max_rank, n), dtype) for _, n in t.parts)
        per_layer[t.layer][t.field] = LoRAProjection(a, b)
    return LoRAWeights(tuple(per_layer))


def lora_partition_specs(cfg: ModelConfig, shards: int, rules: ShardingRules = TENSOR_PARALLEL_RULES
                         ) -> LoRAWeights:
    """The slots' PartitionSpecs under tensor parallelism, from the base weights' axes:
    A split like its projection's inputs (row-parallel o / down: each shard's partial
    product, summed by the projection's all-reduce), each B like its outputs
    (column-parallel q | k | v, gate | up: each shard its columns of every part, the
    shard-major layout of the fused weight). ValueError where the shards outnumber the
    KV heads (the base replicates K/V heads there; adapters do not yet)."""
    from jax.sharding import PartitionSpec as P

    if shards > 1 and kv_replicas(cfg, shards) > 1:
        raise ValueError(f"enable_lora: tensor_parallel_size={shards} exceeds the model's {cfg.num_kv_heads} KV heads "
                         "(replicated K/V heads are not supported with LoRA)")
    per_layer: list[dict[str, LoRAProjection]] = [{} for _ in range(cfg.num_layers)]
    for t in lora_targets(cfg):
        a = P(rules.get(t.axes[0]), None, None, None)
        b = tuple(P(None, None, rules.get(t.axes[1])) for _ in t.parts)
        per_layer[t.layer][t.field] = LoRAProjection(a, b)
    return LoRAWeights(tuple(per_layer))


def zeros_like_abstract(abstract: LoRAWeights) -> LoRAWeights:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)


def set_slot(weights: LoRAWeights, slot: Int[Array, ""], adapter: LoRAWeights) -> LoRAWeights:
    """`weights` with slot `slot` (0-based) holding `adapter` (one slot's arrays: a
    [D, P, R], each b [R, N]; both with a leading stage axis where the slots are stacked
    by pipeline stage, jaxllm.models.pipeline.stack_stages)."""
    def put(w: LoRAProjection, new: LoRAProjection) -> LoRAProjection:
        return LoRAProjection(w.a.at[..., slot, :, :].set(new.a.astype(w.a.dtype)),
                              tuple(b.at[..., slot, :, :].set(nb.astype(b.dtype))
                                    for b, nb in zip(w.b, new.b, strict=True)))

    return LoRAWeights(tuple({k: put(layer[k], new[k]) for k in layer}
                             for layer, new in zip(weights.layers, adapter.layers, strict=True)))


@typing.no_type_check
@struct.dataclass
class LoRAInputs:
    """What a forward needs of the adapters: the slots, each token's slot (0: none) and
    as a one-hot row (slot l of 1..L at column l - 1; the base model: all zeros),
    whether any token of the step has an adapter (else the products are skipped), and
    which implementation multiplies (`kernel`: xla or pallas)."""

    weights: LoRAWeights
    slots: Int[Array, " T"]
    onehot: Float[Array, "T L"]
    active: Bool[Array, ""]
    kernel: str = struct.field(pytree_node=False, default="xla")

    @classmethod
    def make(cls, weights: LoRAWeights, slots: Int[Array, " T"], dtype, kernel: str = "xla") -> LoRAInputs:
        levels = jnp.arange(1, weights.num_slots + 1, dtype=slots.dtype)
        return cls(weights, slots, (slots[:, None] == levels).astype(dtype), (slots > 0).any(), kernel)

    def layer(self, i: int) -> LayerLoRA:
        return LayerLoRA(self.weights.layers[i], self.slots, self.onehot, self.active, self.kernel)

    def tokens(self, start: Int[Array, ""], size: int) -> LoRAInputs:
        """The same adapters for tokens [start, start + size) alone (a micro-batch)."""
        slots = jax.lax.dynamic_slice_in_dim(self.slots, start, size)
        return self.replace(slots=slots, onehot=jax.lax.dynamic_slice_in_dim(self.onehot, start, size),
                            active=(slots > 0).any())


@dataclasses.dataclass(frozen=True)
class LayerLoRA:
    """One layer's slots with the step's token slots (inside a trace)."""

    projections: dict[str, LoRAProjection]
    slots: jax.Array
    onehot: jax.Array
    active: jax.Array
    kernel: str = "xla"

    def add(self, field: str, x: Float[Array, "T D"], y: Float[Array, "T N"]) -> Float[Array, "T N"]:
        """`y` (x's projection by `field`'s base weight) plus each token's adapter's
        product; `y` as it is when no token of the step has one."""
        proj = self.projections[field]
        if self.kernel == "pallas":
            delta = lambda: pallas_lora_delta(x, proj, self.slots)
        else:
            delta = lambda: lora_delta(x, proj, self.onehot)
        return jax.lax.cond(self.active, lambda y: y + delta().astype(y.dtype), lambda y: y, y)

    def take(self, rows: Int[Array, " S"]) -> LayerLoRA:
        """The same adapters for the tokens at `rows` alone (a step's sample rows)."""
        return dataclasses.replace(self, slots=self.slots[rows], onehot=self.onehot[rows])


def lora_delta(x: Float[Array, "T D"], proj: LoRAProjection, onehot: Float[Array, "T L"]) -> Float[Array, "T N"]:
    """Each token's x A B through its slot's A and B, for every part, concatenated."""
    t, d = x.shape
    _, num_slots, num_parts, rank = proj.a.shape
    shrunk = jnp.dot(x, proj.a.reshape(d, num_slots * num_parts * rank).astype(x.dtype))
    shrunk = shrunk.reshape(t, num_slots, num_parts, rank) * onehot[:, :, None, None].astype(x.dtype)
    outs = [jnp.dot(shrunk[:, :, p].reshape(t, num_slots * rank), b.reshape(num_slots * rank, -1).astype(x.dtype))
            for p, b in enumerate(proj.b)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)


def pallas_lora_delta(x: Float[Array, "T D"], proj: LoRAProjection, slots: Int[Array, " T"]) -> Float[Array, "T N"]:
    """lora_delta through the Pallas kernels (pallas_kernels.lora; interpret mode off GPU)."""
    from pallas_kernels.lora import lora_expand, lora_shrink

    interpret = not targets_gpu()
    shrunk = lora_shrink(x, proj.a, slots, interpret=interpret)
    outs = [lora_expand(shrunk[:, p].astype(b.dtype), b, slots, out_dtype=x.dtype, interpret=interpret)
            for p, b in enumerate(proj.b)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
