"""Parameter pytrees of a Llama-family model.

Weights are stored per layer (a tuple of LayerParams, not one stacked array): indexing
stacked weights inside jit, or scanning over layers, measured 4x slower at batch 1 on
XLA:CPU. Matmul weights are laid out [in, out] so a projection is `x @ w`, and the
projections that read the same input are fused: q/k/v into `wqkv`, gate/up into
`w_gate_up`. For the `cpu` linear backend the model runner packs them into panels
(PackedWeight; jaxllm.models.linear).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int, Int8, UInt8

if TYPE_CHECKING:
    from jaxllm.config import ModelConfig


GGUF_BLOCK = 32  # rows (inputs) per scale of a GGUF block (Q8_0, Q4_0, Q4_1)
PANEL = 32  # columns per panel of a PackedWeight: kPanel in jaxllm/cpu_kernels/dense.cc


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a quantized projection is held (jaxllm.models.quant): `group` inputs per
    scale (0: one scale per output column), values of `bits` bits (int8 values in
    [-2^(bits-1), 2^(bits-1)) without mins, [0, 2^bits) with them), whether each
    group also has a min added after the scaling (GGUF's Q4_1: w = d * q + m), and the
    dtype its scales (and mins) are held in: GGUF's own blocks keep the file's float16
    (every float16 is a float32: the weights are the same; they take half the bytes)."""

    name: str
    group: int
    bits: int
    mins: bool = False
    scale_dtype: str = "float32"


QUANT_FORMATS = {
    "int8": QuantFormat("int8", 0, 8),
    "q8_0": QuantFormat("q8_0", GGUF_BLOCK, 8, scale_dtype="float16"),
    "q4_0": QuantFormat("q4_0", GGUF_BLOCK, 4, scale_dtype="float16"),
    "q4_1": QuantFormat("q4_1", GGUF_BLOCK, 4, mins=True, scale_dtype="float16"),
    # int4 weight-only from float weights: 4-bit values, a float32 scale and min per 128
    # (or 32) inputs of each column (jaxllm.models.quant.quantize_grouped)
    "int4": QuantFormat("int4", 128, 4, mins=True),
    "int4_g32": QuantFormat("int4_g32", 32, 4, mins=True),
    "int4_g64": QuantFormat("int4_g64", 64, 4, mins=True),  # a GPTQ / AWQ checkpoint's group of 64
    # int8 by groups (a GPTQ int8 or compressed-tensors W8A16 group checkpoint; or quantized
    # at load): int8 values, a float32 scale and min per 128 / 64 / 32 inputs
    "int8_g128": QuantFormat("int8_g128", 128, 8, mins=True),
    "int8_g64": QuantFormat("int8_g64", 64, 8, mins=True),
    "int8_g32": QuantFormat("int8_g32", 32, 8, mins=True),
    # a GGUF of mixed block types, each weight exact (jaxllm.models.quant.gguf_container_parts)
    "gguf_int8": QuantFormat("gguf_int8", 16, 8, mins=True),
}
# jaxllm's own grouped formats (a float32 scale and min per group; quantize_grouped): what a
# GPTQ / AWQ / compressed-tensors checkpoint's groups are held in (jaxllm.loaders.prequantized)
GROUPED_FORMATS = ("int4", "int4_g32", "int4_g64", "int8_g128", "int8_g64", "int8_g32")


# How the cpu kernel sums bfloat16 (PackedWeight.bf16_tiles); a name's index is its code in
# jaxllm/cpu_kernels/dense.cc (BF16Tiles)
BF16_TILES = ("float", "dot", "amx")
# A step's choice beside them for a float32 model's kept blocks that multiply in bfloat16
# (activation_quantization auto on AMX): "none", no bfloat16 rounding at that step, its inputs
# and dequantized weights multiplied in float32 (`float_dtype` float32: the same arrays), where
# the start-up measurement finds it faster (few rows: docs/cpu_kernels.md).
NO_BF16 = "none"
# A step's choices for a float32 model's kept blocks that activation_quantization `auto`
# multiplies with int16 activations where the kernels also have vdpbf16ps (AVX512_BF16 without
# AMX: a Zen 4): INT16_STEP, as marked; or BF16_STEP, x and each dequantized weight rounded to
# bfloat16 and summed by vdpbf16ps from the same dot-layout arrays (PackedWeight.activations
# "bfloat16"), at the buckets where the start-up measurement finds that faster (many rows:
# docs/bench-log/2026-12-04-zen4.md).
INT16_STEP, BF16_STEP = "int16", "bfloat16"


@struct.dataclass
class PackedWeight:
    """An [in, out] weight as panels of PANEL columns, [out/PANEL, in, PANEL], the last
    panel zero-padded: the layout the `cpu` linear backend multiplies. A quantized weight
    (QuantizedWeight) packs its values so, with its scales (and mins) padded to the
    panels' columns; 4-bit values two to a byte, [out/PANEL, in, PANEL / 2] uint8, byte
    j holding column j in its low nibble and column j + 16 in its high one (an offset of
    8 added where the values are signed: Q4_0). bfloat16 weights pack their inputs in
    pairs, [out/PANEL, in/2, PANEL, 2] (an odd `in` padded with a zero row): the two
    inputs vdpbf16ps multiplies side by side for each column. A mixture of experts'
    [E, in, out] weight stacks each expert's panels (`experts` = E)."""

    panels: (Float[Array, "*E P K 32"] | Int8[Array, "*E P K 32"] | UInt8[Array, "*E P K 16"]
             | Float[Array, "*E P K2 32 2"] | UInt8[Array, "*E P K8 32 4"] | Int8[Array, "*E P K4 32 4"])
    out_features: int = struct.field(pytree_node=False)
    # [P * 32] per column, [P, G, 32] per group; a mixture of experts' with a leading [E]
    scale: Float[Array, "*E P32"] | Float[Array, "*E P G 32"] | None = None
    group: int = struct.field(pytree_node=False, default=0)
    mins: Float[Array, "*E P G 32"] | None = None  # Q4_1
    experts: int = struct.field(pytree_node=False, default=0)  # > 0: a MoE projection, each expert's panels stacked
    float_dtype: str = struct.field(pytree_node=False, default="float32")  # a quantized one's: QuantizedWeight's
    # "int8" or "int16" (QuantizedWeight's `activations`): the dot layout, 4-bit values
    # [out/PANEL, in/8, PANEL, 4] uint8, int8 ones [out/PANEL, in/4, PANEL, 4]; "bfloat16": that
    # layout multiplied as a bfloat16 model's kept blocks (a step's mark: BF16_STEP)
    activations: str = struct.field(pytree_node=False, default="float")
    # bfloat16 sums (bfloat16 panels, or a bfloat16 model's quantized ones): "dot" by vdpbf16ps where
    # the kernels are built with AVX512_BF16, "float" by the float tiles (the same sums either way),
    # "amx" by AMX's tiles where the CPU has them (float32 sums in the tile unit's order);
    # jaxllm/cpu_kernels/dense.cc; the fastest chosen at start-up (jaxllm.worker.autotune)
    bf16_tiles: str = struct.field(pytree_node=False, default="dot")
    perm: Int[Array, " K"] | None = None  # QuantizedWeight's (activation order)

    @property
    def in_features(self) -> int:
        """Rows of the packed matrix (rounded up to even for bfloat16 pairs)."""
        dims = self.panels.shape[1:] if self.experts else self.panels.shape
        if self.activations != "float":  # the dot layout: 8 4-bit inputs or 4 int8 ones per row
            return dims[1] * (8 if self.panels.dtype == jnp.uint8 else 4)
        return dims[1] * (2 if len(dims) == 4 else 1)


@struct.dataclass
class QuantizedWeight:
    """An [in, out] weight as integer values and float scales (weight-only:
    jaxllm.models.quant): one scale per output column, w[k, n] ~ q[k, n] * scale[n], or
    with `group` > 0 one per column and `group` consecutive rows, w[k, n] = q[k, n] *
    scale[k // group, n] (+ mins[k // group, n] where there are mins: GGUF's Q4_1). The
    values are int8 whatever `bits` says (4: GGUF's Q4_0 as q - 8, Q4_1 as q); the
    `cpu` backend packs 4-bit ones two to a byte (PackedWeight). Scales and mins are
    float32, or float16 for GGUF's blocks (QuantFormat.scale_dtype)."""

    q: Int8[Array, "*E K N"]  # E: a mixture of experts' stacked experts
    scale: Float[Array, "*E N"] | Float[Array, "*E G N"]
    group: int = struct.field(pytree_node=False, default=0)
    mins: Float[Array, "*E G N"] | None = None
    bits: int = struct.field(pytree_node=False, default=8)
    group_axis: int = struct.field(pytree_node=False, default=0)  # 1: groups along the last axis (the embedding)
    kernel: str = struct.field(pytree_node=False, default="")  # "pallas": the `pallas` linear backend's layout
    # The float matrix it stands for: float32 as gguf dequantizes it, or in a bfloat16
    # model (grouped formats) each of those values rounded to bfloat16, as the model would
    # hold it dequantized; multiplied as that model's plain weights (jaxllm.models.linear).
    float_dtype: str = struct.field(pytree_node=False, default="float32")
    # "int8" / "int16": multiplied with its inputs quantized to int8 / int16 per 32
    # (quantized_activation_matmul in jaxllm.models.quant; EngineConfig.activation_quantization),
    # in integer dot products; "float": as the float matrix it stands for.
    activations: str = struct.field(pytree_node=False, default="float")
    # A checkpoint quantized in activation order (GPTQ's desc_act): its rows (inputs) sorted
    # so that each group's are consecutive; x @ w is then x[..., perm] @ q (jaxllm.models.linear)
    perm: Int[Array, " K"] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """[K, N]; a mixture of experts' [E, K, N]."""
        return self.q.shape

    def map_arrays(self, fn) -> QuantizedWeight:
        """`fn` applied to the values, the scales and the mins alike (transposes, row
        orders, layouts along the output axis, which all three share)."""
        return self.replace(q=fn(self.q), scale=fn(self.scale), mins=None if self.mins is None else fn(self.mins))

    def transposed(self) -> QuantizedWeight:
        """The transpose, its groups along the other axis (a tied embedding [V, D],
        grouped along D, as the output projection [D, V], grouped along its inputs);
        abstract arrays too."""
        flip = lambda a: jax.ShapeDtypeStruct(a.shape[::-1], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a.T
        return self.map_arrays(flip).replace(group_axis=1 - self.group_axis)

    def take_rows(self, rows: Int[Array, " T"]) -> QuantizedWeight:
        """Rows of an embedding grouped along its last axis (a lookup)."""
        return self.map_arrays(lambda a: a[rows])

    def expert(self, e: int) -> QuantizedWeight:
        """Expert `e`'s [K, N] of a mixture of experts' stacked [E, K, N] (values, scales
        and mins stacked alike; `group_axis` counts within one expert's matrix)."""
        return self.map_arrays(lambda a: a[e])


def stack_experts(experts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Each expert's QuantizedWeight stacked along a new leading axis: [E, K, N] values,
    [E, ...] scales and mins."""
    first = experts[0]
    stack = np.stack if isinstance(first.q, np.ndarray) else jnp.stack
    mins = None if first.mins is None else stack([w.mins for w in experts])
    return first.replace(q=stack([w.q for w in experts]), scale=stack([w.scale for w in experts]), mins=mins)


Weight = Float[Array, "K N"] | PackedWeight | QuantizedWeight


@struct.dataclass
class LayerParams:
    attn_norm: Float[Array, " D"]
    wqkv: Weight  # [D, QKV] columns: q (H*hd) | k (Hkv*hd) | v (Hkv*hd)
    bqkv: Float[Array, " QKV"] | None  # Qwen2 / attention_bias
    q_norm: Float[Array, " hd"] | None  # Qwen3
    k_norm: Float[Array, " hd"] | None  # Qwen3
    wo: Weight  # [H*hd, D]
    attn_post_norm: Float[Array, " D"] | None  # Gemma: the attention's output normed before the residual add
    mlp_norm: Float[Array, " D"]
    w_gate_up: Weight | Float[Array, "E D F2"]  # [D, 2F] columns: gate (F) | up (F); MoE: [E, D, 2F] per expert
    w_down: Weight | Float[Array, "E F D"]  # [F, D]; MoE: [E, F, D]
    mlp_post_norm: Float[Array, " D"] | None  # Gemma: the MLP's output normed before the residual add
    router: Weight | None = None  # MoE: [D, E], the router's logits
    shared_gate_up: Weight | None = None  # Qwen2-MoE: the shared expert's [D, 2Fs]
    shared_down: Weight | None = None  # Qwen2-MoE: [Fs, D]
    shared_gate: Weight | None = None  # Qwen2-MoE: [D, 1], the sigmoid gate of the shared expert's output


@struct.dataclass
class ModelParams:
    embed: Float[Array, "V D"] | QuantizedWeight | PackedWeight  # packed: a tied table in its head's layout
    layers: tuple[LayerParams, ...]
    final_norm: Float[Array, " D"]
    lm_head: Weight | None  # [D, V]; None when tied to `embed` (then `embed` is packed where the head is)


@dataclasses.dataclass(frozen=True)
class ParamDecl:
    """One parameter, declared once; its initialization (abstract shapes), loading and
    exporting (the checkpoint tensors it is made of), packing and sharding are derived
    from this declaration (`declare`).

    `shape` is jaxllm's layout ([in, out] for a projection); `axes` names each axis
    logically (`AXES`), which sharding rules map to mesh axes. `hf` lists the HF
    checkpoint tensors that make it, in order, each with its size along the last axis:
    several are fused by concatenation there (q | k | v, gate | up). `transposed`: the
    HF tensors hold the matrix as [out, in] (torch.nn.Linear)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    hf: tuple[tuple[str, int], ...]
    transposed: bool = False
    kv_parts: tuple[int, ...] = ()  # which of `hf` hold K/V heads (replicated when shards outnumber them)
    quant: str | None = None  # a projection held quantized (a QUANT_FORMATS name: QuantizedWeight); None: as loaded
    act_order: bool = False  # its rows sorted by group, with the permutation of its inputs (QuantizedWeight.perm)
    experts: int = 0  # > 0: stacked along a leading axis from `experts` tensors each, `hf` names holding "{e}"

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape) or sum(n for _, n in self.hf) != self.shape[-1]:
            raise ValueError(f"inconsistent parameter declaration {self}")

    def hf_shape(self, size: int) -> tuple[int, ...]:
        """The shape of one of its HF tensors (one expert's), of `size` along the fused axis."""
        shape = (*self.shape[1 if self.experts else 0:-1], size)
        return shape[::-1] if self.transposed else shape

    def expert(self, e: int) -> ParamDecl:
        """The declaration of expert `e`'s slice of a stacked parameter (its own HF names)."""
        return dataclasses.replace(self, shape=self.shape[1:], axes=self.axes[1:], experts=0,
                                   hf=tuple((name.format(e=e), n) for name, n in self.hf))

    def per_expert(self) -> list[ParamDecl]:
        """The declarations a parameter is read from: each expert's, or itself."""
        return [self.expert(e) for e in range(self.experts)] if self.experts else [self]


# Logical axes of the parameters. Tensor parallelism shards "vocab", "qkv", "heads" and
# "mlp"; the fused ones ("qkv": q | k | v columns, "mlp" of w_gate_up: gate | up) are
# laid out shard-major when loaded for several shards (jaxllm.loaders.weights), so that
# every shard holds whole heads and matching gate and up columns.
AXES = ("vocab", "embed", "qkv", "heads", "mlp", "head_dim", "expert")


ACT_ORDER = "act_order"  # a tensor_quantization format's suffix: the projection's rows sorted by group


def declare(cfg: ModelConfig) -> ModelParams:
    """Every parameter of a model of `cfg`, as a ModelParams of ParamDecl leaves (an
    encoder's: jaxllm.models.bert_params.BertParams); each quantized projection in
    `cfg.quantization`'s format, or in the one `cfg.tensor_quantization` gives it (by
    its first HF tensor's name; "none": as stored)."""
    if cfg.is_encoder:
        from jaxllm.models import bert_params  # it builds on this module

        return bert_params.declare(cfg)
    decls = _declare(cfg)
    if not cfg.tensor_quantization:
        return decls
    formats = dict(cfg.tensor_quantization)

    def own(d: ParamDecl) -> ParamDecl:  # "none": a projection the checkpoint stores unquantized
        quant, order, _ = (formats.get(d.hf[0][0], d.quant) if d.quant else "none").partition(f"+{ACT_ORDER}")
        return dataclasses.replace(d, quant=None if quant == "none" else quant, act_order=bool(order))

    return jax.tree.map(own, decls, is_leaf=lambda x: isinstance(x, ParamDecl))


def _declare(cfg: ModelConfig) -> ModelParams:
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = cfg.q_size + 2 * cfg.kv_size

    def layer(i: int) -> LayerParams:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        q_k_v = ((attn + "q_proj.{}", cfg.q_size), (attn + "k_proj.{}", cfg.kv_size), (attn + "v_proj.{}", cfg.kv_size))
        named = lambda parts, what: tuple((name.format(what), n) for name, n in parts)
        norm = lambda name: ParamDecl((d,), ("embed",), ((p + name, d),))
        sandwich = cfg.sandwich_norms  # Gemma: post_attention_layernorm is the attention's output norm
        gate_up = ((mlp + "gate_proj.weight", f), (mlp + "up_proj.weight", f))
        mlp_decls = _moe_decls(cfg, i) if cfg.is_moe(i) else dict(
            w_gate_up=ParamDecl((d, 2 * f), ("embed", "mlp"), gate_up, transposed=True, quant=cfg.quantization),
            w_down=ParamDecl((f, d), ("mlp", "embed"), ((mlp + "down_proj.weight", d),), transposed=True,
                             quant=cfg.quantization))
        return LayerParams(
            attn_norm=norm("input_layernorm.weight"),
            wqkv=ParamDecl((d, qkv), ("embed", "qkv"), named(q_k_v, "weight"), transposed=True, kv_parts=(1, 2),
                          quant=cfg.quantization),
            bqkv=ParamDecl((qkv,), ("qkv",), named(q_k_v, "bias"), kv_parts=(1, 2)) if cfg.qkv_bias else None,
            q_norm=ParamDecl((hd,), ("head_dim",), ((attn + "q_norm.weight", hd),)) if cfg.qk_norm else None,
            k_norm=ParamDecl((hd,), ("head_dim",), ((attn + "k_norm.weight", hd),)) if cfg.qk_norm else None,
            wo=ParamDecl((cfg.q_size, d), ("heads", "embed"), ((attn + "o_proj.weight", d),), transposed=True,
                        quant=cfg.quantization),
            attn_post_norm=norm("post_attention_layernorm.weight") if sandwich else None,
            mlp_norm=norm("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
            mlp_post_norm=norm("post_feedforward_layernorm.weight") if sandwich else None,
            **mlp_decls,
        )

    return ModelParams(
        embed=ParamDecl((cfg.vocab_size, d), ("vocab", "embed"), (("model.embed_tokens.weight", d),),
                        quant=cfg.embed_quantization),
        layers=tuple(layer(i) for i in range(cfg.num_layers)),
        final_norm=ParamDecl((d,), ("embed",), (("model.norm.weight", d),)),
        lm_head=None if cfg.tie_word_embeddings else ParamDecl(
            (d, cfg.vocab_size), ("embed", "vocab"), (("lm_head.weight", cfg.vocab_size),), transposed=True,
            quant=cfg.quantization),
    )


def _moe_decls(cfg: ModelConfig, i: int) -> dict[str, ParamDecl | None]:
    """A MoE layer's MLP: the router, the experts' weights stacked [E, ...] from the
    checkpoint's per-expert tensors (Mixtral's block_sparse_moe.experts.N.w1 / w3 / w2,
    Qwen's mlp.experts.N.gate_proj / up_proj / down_proj), Qwen2-MoE's shared expert."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if cfg.model_type == "mixtral":
        moe = f"model.layers.{i}.block_sparse_moe."
        gate, up, down = (moe + "experts.{e}." + w for w in ("w1.weight", "w3.weight", "w2.weight"))
    else:
        moe = f"model.layers.{i}.mlp."
        gate, up, down = (moe + "experts.{e}." + w for w in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    decls = dict(
        router=ParamDecl((d, e), ("embed", None), ((moe + "gate.weight", e),), transposed=True),
        w_gate_up=ParamDecl((e, d, 2 * f), ("expert", "embed", "mlp"), ((gate, f), (up, f)), transposed=True,
                            experts=e, quant=cfg.quantization),
        w_down=ParamDecl((e, f, d), ("expert", "mlp", "embed"), ((down, d),), transposed=True, experts=e,
                         quant=cfg.quantization))
    fs = cfg.shared_expert_intermediate_size
    if fs:
        shared = moe + "shared_expert."
        decls.update(
            shared_gate_up=ParamDecl((d, 2 * fs), ("embed", "mlp"), ((shared + "gate_proj.weight", fs),
                                                                     (shared + "up_proj.weight", fs)), transposed=True,
                                     quant=cfg.quantization),
            shared_down=ParamDecl((fs, d), ("mlp", "embed"), ((shared + "down_proj.weight", d),), transposed=True,
                                  quant=cfg.quantization),
            shared_gate=ParamDecl((d, 1), ("embed", None), ((moe + "shared_expert_gate.weight", 1),), transposed=True))
    return decls


def declarations(cfg: ModelConfig) -> list[ParamDecl]:
    """`declare(cfg)`'s leaves, in the pytree's order."""
    return jax.tree.leaves(declare(cfg), is_leaf=lambda x: isinstance(x, ParamDecl))


def abstract_params(cfg: ModelConfig, dtype) -> ModelParams:
    """ModelParams of jax.ShapeDtypeStruct leaves: the shapes `cfg` implies."""
    def abstract(decl: ParamDecl):
        if decl.quant:
            return quantized_abstract(decl)
        return jax.ShapeDtypeStruct(decl.shape, dtype)

    return map_declared(abstract, declare(cfg))


def quantized_layout(decl: ParamDecl) -> dict:
    """QuantizedWeight's static fields for `decl`: its format's group and bits, and the
    axis the groups run along, the HF tensor's rows (its inputs): axis 0 of a
    projection (transposed to [in, out]), the last axis of the embedding."""
    fmt = QUANT_FORMATS[decl.quant]
    return dict(group=fmt.group, bits=fmt.bits, group_axis=0 if decl.transposed or not fmt.group else 1)


def quantized_abstract(decl: ParamDecl) -> QuantizedWeight:
    """The abstract QuantizedWeight of a parameter declared quantized."""
    fmt, layout = QUANT_FORMATS[decl.quant], quantized_layout(decl)
    *experts, a, b = decl.shape  # a mixture of experts' [E, K, N]: each expert's scales stacked
    if not fmt.group:
        scale_shape = (b,)
    else:
        scale_shape = (a // fmt.group, b) if layout["group_axis"] == 0 else (a, b // fmt.group)
    scale = jax.ShapeDtypeStruct((*experts, *scale_shape), jnp.dtype(fmt.scale_dtype))
    perm = jax.ShapeDtypeStruct((a,), jnp.int32) if decl.act_order else None
    return QuantizedWeight(jax.ShapeDtypeStruct(decl.shape, jnp.int8), scale, mins=scale if fmt.mins else None,
                           perm=perm, **layout)


# Tensor parallelism over a mesh axis named "model" (Megatron's layout): q/k/v and
# gate/up column-parallel, the attention output and down projections row-parallel, the
# embedding and output projection split by vocabulary; norms replicated.
# a logical axis -> the mesh axis (or axes, major first) it is split over
ShardingRules = dict[str, str | tuple[str, ...]]
TENSOR_PARALLEL_RULES: ShardingRules = {"vocab": "model", "qkv": "model", "heads": "model", "mlp": "model"}


def map_declared(fn, decls: ModelParams, *rest: ModelParams) -> ModelParams:
    """jax.tree.map over a declaration (ParamDecl leaves) and pytrees of its structure."""
    return jax.tree.map(fn, decls, *rest, is_leaf=lambda x: isinstance(x, ParamDecl))


def fuse(parts: list[np.ndarray], shards: int = 1, repeats: Sequence[int] | None = None) -> np.ndarray:
    """Arrays concatenated along their last axis, shard-major for `shards` shards:
    [part 0's shard 0 | part 1's shard 0 | ... | part 0's shard 1 | ...], so that
    cutting the result into `shards` equal pieces gives each shard its share of every
    part. A part with `repeats` r > 1 is cut into shards / r pieces, each given to r
    consecutive shards (K/V heads replicated when the shards outnumber them). One
    shard: a plain concatenation."""
    repeats = repeats or [1] * len(parts)
    xp = _array_module(parts[0])
    pieces = []
    for p, r in zip(parts, repeats, strict=True):
        if shards % r or p.shape[-1] % (shards // r):
            raise ValueError(f"fused parts of sizes {[p.shape[-1] for p in parts]} do not split into {shards} shards"
                             + (f" (repeats {list(repeats)})" if max(repeats) > 1 else ""))
        pieces.append(xp.split(p, shards // r, axis=-1))
    return xp.concatenate([pieces[i][s // r] for s in range(shards) for i, r in enumerate(repeats)], axis=-1)


def unfuse(array: np.ndarray, sizes: list[int], shards: int = 1, repeats: Sequence[int] | None = None
           ) -> list[np.ndarray]:
    """The inverse of `fuse`: the parts, of `sizes` along the last axis (a repeated
    part read from the first shard of each group holding it)."""
    repeats = repeats or [1] * len(sizes)
    xp = _array_module(array)
    widths = [n // (shards // r) for n, r in zip(sizes, repeats, strict=True)]
    per_shard = xp.split(array, shards, axis=-1)
    split = [xp.split(piece, np.cumsum(widths)[:-1].tolist(), axis=-1) for piece in per_shard]
    return [xp.concatenate([split[s][i] for s in range(0, shards, r)], axis=-1) for i, r in enumerate(repeats)]


def _array_module(array):
    """jax.numpy for arrays on a device (they are relaid out there), else numpy."""
    return jnp if isinstance(array, jax.Array) else np


def kv_replicas(cfg: ModelConfig, shards: int) -> int:
    """How many shards hold each KV head: 1 while the shards divide the KV heads; when
    they outnumber them, shards / KV heads (vLLM replicates KV heads the same way)."""
    return max(1, shards // cfg.num_kv_heads)


def part_repeats(decl: ParamDecl, replicas: int) -> list[int]:
    """Per HF part of `decl`, how many shards hold each piece of it."""
    return [replicas if i in decl.kv_parts else 1 for i in range(len(decl.hf))]


def laid_out_shape(decl: ParamDecl, shards: int, replicas: int) -> tuple[int, ...]:
    """`decl`'s shape laid out for `shards` shards (`fuse`): replicated K/V heads widen
    the fused axis."""
    width = sum(n * r for (_, n), r in zip(decl.hf, part_repeats(decl, replicas), strict=True))
    return (*decl.shape[:-1], width)


def shard_major(cfg: ModelConfig, params: ModelParams, shards: int) -> ModelParams:
    """Loaded (one-shard) params with their fused parameters laid out for `shards`
    tensor-parallel shards (`fuse`, K/V heads replicated where the shards outnumber
    them); the others are returned as they are. Abstract params get the shapes."""
    if shards == 1:
        return params
    replicas = kv_replicas(cfg, shards)

    def relayout(decl: ParamDecl, array):
        if len(decl.hf) == 1:
            return array
        if isinstance(array, QuantizedWeight):  # both lie along the fused (last) axis
            return array.map_arrays(lambda a: relayout(decl, a))
        if isinstance(array, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((*array.shape[:-1], laid_out_shape(decl, shards, replicas)[-1]), array.dtype)
        parts = unfuse(array if isinstance(array, jax.Array) else np.asarray(array), [n for _, n in decl.hf])
        return fuse(parts, shards, part_repeats(decl, replicas))  # a device's array: relaid out on its devices

    return map_declared(relayout, declare(cfg), params)
