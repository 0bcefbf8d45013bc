"""Dense projections, and the weight layout each linear backend multiplies.

`linear(x, w)` is `x @ w` as `w`'s stored layout is multiplied (jaxllm.models.formats:
one class per layout): XLA's dot for a plain [in, out] weight, and the C++ custom call
of jaxllm/cpu_kernels/dense.cc for a PackedWeight (jaxllm.models.params): the same
[in, out] matrix cut into panels of 32 columns, [out/32, in, 32], the last panel
zero-padded. The model code is the same for all; the model runner packs the weights
once, at load, when its backend is `cpu` (`pack_weight`, here).

Backends, chosen by name (EngineConfig.linear_backend):
- `xla`: plain weights, XLA's dot; every platform and dtype.
- `cpu`: packed weights and the custom call; XLA:CPU, float32 or bfloat16 weights
  (bfloat16: x rounded to bfloat16, float32 sums, as XLA's dot; where the CPU has
  AVX512_BF16 by vdpbf16ps or by the float tiles, the same sums, or where it has AMX by
  its tiles, the fastest per step shape measured at start-up (`PackedWeight.bf16_tiles`):
  which one wins depends on the CPU and the rows). How it compares with XLA's dot per build: docs/benchmarks.md.
- `pallas`: quantized projections (QuantizedWeight) through the Pallas weight-only
  matmul (pallas_kernels.quantized_matmul: int8 tiles dequantized in the kernel, so
  the weights cross memory at a byte each; interpret mode off GPU, for tests), float
  ones through XLA's dot. Opt-in: correct natively on an H200 (2026-11-27) but 0.11-0.76x
  XLA's path for the same weights there (docs/kernels.md), so `auto` is xla on a GPU.
- `auto`: on the CPU platform for float32 or bfloat16, where the kernels build, the faster of
  `cpu` and `xla` per step shape, measured at start-up (jaxllm.worker.autotune); else
  `xla` (the reason logged).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree, Shaped

from jaxllm import cpu_kernels
from jaxllm.config import LINEAR_BACKENDS
from jaxllm.models.formats import Panels, format_of
from jaxllm.models.params import (
    BF16_STEP,
    BF16_TILES,
    INT16_STEP,
    NO_BF16,
    LayerParams,
    ModelParams,
    PackedWeight,
    QuantizedWeight,
    Weight,
)
from jaxllm.models.quant import (
    ACTIVATION_MAX,
    activation_quantization_ready,
)
from jaxllm.platform import backend_candidates

logger = logging.getLogger(__name__)


def pack_weight(w: Shaped[Array, "*E K N"] | Shaped[np.ndarray, "*E K N"] | jax.ShapeDtypeStruct | QuantizedWeight
                ) -> PackedWeight:
    """`w` as the `cpu` backend's panels, as its format packs (jaxllm.models.formats); an
    abstract `w` (jax.ShapeDtypeStruct) gives abstract panels. Packed with numpy on the
    host (the backend runs on the CPU platform, where that is a view of the array)."""
    return format_of(w).pack(w)


def unpack_weight(w: PackedWeight) -> Float[Array, "K N"] | Float[Array, "E K N"]:
    """The [in, out] matrix back, dequantized (tests and debugging); a mixture of
    experts' [E, in, out]."""
    return Panels.unpack(w)


def linear(x: Float[Array, "... K"], w: Weight, preferred_element_type=None, rows: Int[Array, ""] | None = None
           ) -> Float[Array, "... N"]:
    """x @ w, as `w`'s stored layout is multiplied (jaxllm.models.formats: a plain
    array by XLA's dot, a QuantizedWeight by its integer values and scales, packed
    panels by the C++ custom calls, returning float32). `rows` (packed weights, x
    [T, K]): only x's first `rows` rows are multiplied, the rest of y is zeros; other
    layouts compute every row. A weight in activation order (`perm`: its rows sorted by
    group) multiplies x's inputs in that order."""
    if isinstance(w, (QuantizedWeight, PackedWeight)) and w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    return format_of(w).matmul(x, w, preferred_element_type, rows)


def packed_rows(w: PackedWeight, rows: Int[Array, " T"]) -> Float[Array, "T K"]:
    """Rows `rows` of the [out, in] matrix a packed output projection transposes (the
    embedding rows of a tied model: jaxllm.models.formats.Panels.take_rows)."""
    return Panels.take_rows(w, rows)


MeshAxes = str | tuple[str, ...] | None  # the mesh axis (or axes) a value is split over; None: not split


def all_reduce(x: Float[Array, ...], axis: MeshAxes) -> Float[Array, ...]:
    """The sum over the shards of `axis` of a row-parallel projection's partial results
    (None: not sharded, `x` itself)."""
    return x if axis is None else jax.lax.psum(x, axis)


def grouped_linear(x: Float[Array, "M K"], w: Float[Array, "E K N"] | PackedWeight | QuantizedWeight,
                   group_sizes: Int[Array, " E"]) -> Float[Array, "M N"]:
    """A mixture of experts' projection: `x`'s rows sorted by expert, `group_sizes[e]`
    of them for expert e, each group times its expert's [K, N] (float32 results), as
    `w`'s layout is multiplied (jaxllm.models.formats)."""
    return format_of(w).grouped_matmul(x, w, group_sizes)


def pallas_params(params: PyTree, activation_dtype=None) -> PyTree:
    """The `pallas` backend's layout: every quantized projection marked for the Pallas
    kernel (the arrays as they are), in ModelParams or any pytree of weights; abstract
    params too. Compiled for a Hopper with 16-bit activations (`activation_dtype`), a
    ModelParams' layer projections and output projection that the Mosaic GPU kernel
    multiplies are held for it instead (`mosaic_weight`)."""
    marked = _marked(params, QuantizedWeight, kernel="pallas")
    if activation_dtype is None or not isinstance(marked, ModelParams):
        return marked
    held = lambda w: pallas_weight(w, activation_dtype) if isinstance(w, QuantizedWeight) else w
    is_leaf = lambda x: isinstance(x, QuantizedWeight)
    return marked.replace(layers=jax.tree.map(held, marked.layers, is_leaf=is_leaf),
                          lm_head=jax.tree.map(held, marked.lm_head, is_leaf=is_leaf))


def pallas_weight(w: QuantizedWeight, activation_dtype) -> QuantizedWeight:
    """One projection in the `pallas` layout: marked for the Triton kernel, or compiled
    for a Hopper held for the Mosaic GPU one where it serves it (`mosaic_weight`)."""
    from jaxllm.platform import targets_hopper

    w = w.replace(kernel="pallas")
    return mosaic_weight(w, activation_dtype) if targets_hopper() else w


def mosaic_weight(w: QuantizedWeight, activation_dtype) -> QuantizedWeight:
    """`w` held for the Mosaic GPU matmul (pallas_kernels.quantized_matmul_mgpu: its
    values transposed to [N, K], marked "mosaic": jaxllm.models.formats.MosaicTiles)
    where that kernel multiplies it: one [K, N] matrix grouped along its inputs, float
    activations of `activation_dtype` (16-bit), N a multiple of 64, 4-bit values two to
    a byte (`_int4`); else as it was."""
    from pallas_kernels.quantized_matmul_mgpu import unsupported

    k, n = w.shape[-2:]
    if (len(w.shape) != 2 or w.group_axis or w.perm is not None or w.activations != "float"
            or unsupported(activation_dtype, n=n, k=k, group=w.group, bits=w.bits) is not None):
        return w
    flip = lambda a: jax.ShapeDtypeStruct(a.shape[::-1], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a.T
    w = w.replace(q=flip(w.q), kernel="mosaic")
    w = _int4(w) if w.bits == 4 else w
    # scales and mins as the kernel reads them, float32, converted once here rather than
    # by every step (a GGUF's are float16)
    return w.replace(scale=_float32(w.scale), mins=None if w.mins is None else _float32(w.mins))


def _float32(a):
    """`a` as float32; abstract arrays too."""
    return jax.ShapeDtypeStruct(a.shape, jnp.float32) if isinstance(a, jax.ShapeDtypeStruct) else a.astype(jnp.float32)


def _int4(w: QuantizedWeight) -> QuantizedWeight:
    """4-bit values held two to a byte (int4: the kernel reads half the bytes), signed:
    a format storing q in [0, 15] with mins (Q4_1, GPTQ's int4) holds q - 8, its mins
    taking the 8 scales (Q4_0's values are q - 8 already); abstract arrays too."""
    def as_int4(a, shift: int):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, jnp.int4)
        return (a - shift).astype(jnp.int4)

    if w.mins is None or isinstance(w.mins, jax.ShapeDtypeStruct):  # Q4_0; or abstract: no values to shift
        return w.replace(q=as_int4(w.q, 0))
    return w.replace(q=as_int4(w.q, 8), mins=_float32(w.mins) + 8 * _float32(w.scale))


def _marked(params: PyTree, kind: type, where=lambda w: True, **fields) -> PyTree:
    """`params` with `fields` set on every weight of type `kind` that `where` accepts
    (the arrays as they are)."""
    return jax.tree.map(lambda w: w.replace(**fields) if isinstance(w, kind) and where(w) else w, params,
                        is_leaf=lambda x: isinstance(x, kind))


def in_dtype(params: ModelParams, dtype) -> ModelParams:
    """A model of `dtype`'s quantized weights marked as standing for that dtype's
    matrix (`QuantizedWeight.float_dtype`): under bfloat16 each grouped weight (GGUF
    blocks, int4) is its dequantized value rounded to bfloat16 and multiplies as the
    model's plain bfloat16 weights (x rounded, float32 sums), so that such a model
    computes what the same file dequantized to bfloat16 at load computes. int8's
    per-column scales apply to the sums: it multiplies in x's dtype whatever the model's.
    Abstract params too."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return params
    return _marked(params, QuantizedWeight, lambda w: w.group, float_dtype="bfloat16")


def quantized_activations(params: ModelParams, dtype: str = "int8") -> tuple[ModelParams, int]:
    """Every projection kept in blocks of a multiple of 32 inputs (Q4_0, Q4_1, Q8_0,
    int4: `activation_quantization_ready`) marked to multiply int8 (or int16: `dtype`)
    activations, and how many were marked; a quantized embedding too where the output
    projection is tied to it (its lookups are unchanged). `dtype` bfloat16: every
    projection kept in blocks (grouped) marked to multiply as a bfloat16 model's do
    (`in_dtype`: x and each dequantized weight rounded to bfloat16, float32 sums). Abstract
    params too."""
    if dtype not in (*ACTIVATION_MAX, "bfloat16"):
        raise ValueError(f"activation quantization: {dtype!r} is not one of {', '.join(ACTIVATION_MAX)}, bfloat16")
    marked = 0

    def mark(w):
        nonlocal marked
        if not isinstance(w, QuantizedWeight):
            return w
        if dtype == "bfloat16" and w.group:
            marked += 1
            return w.replace(float_dtype="bfloat16")
        if dtype != "bfloat16" and activation_quantization_ready(w.transposed() if w.group_axis else w):
            marked += 1
            return w.replace(activations=dtype)
        return w

    is_leaf = lambda x: isinstance(x, QuantizedWeight)
    layers = jax.tree.map(mark, params.layers, is_leaf=is_leaf)
    head = params.lm_head if params.lm_head is not None else params.embed  # the embedding: a tied head
    head = jax.tree.map(mark, head, is_leaf=is_leaf)
    if params.lm_head is not None:
        return params.replace(layers=layers, lm_head=head), marked
    return params.replace(layers=layers, embed=head), marked


AUTO_ACTIVATIONS = "int16"  # what activation_quantization "auto" picks where it quantizes in integers


def auto_activations() -> str | None:
    """What activation_quantization "auto" multiplies kept blocks in on this CPU's
    kernels: bfloat16 on AMX's tiles where it has them (an Intel Xeon from Sapphire
    Rapids on: faster than int16 from a few dozen rows, slower at one; docs/benchmarks.md),
    int16 where it has integer dot products (AVX2, AVX512_VNNI), else None (float: the
    integer handlers would run a lane at a time)."""
    if _amx():
        return "bfloat16"
    return AUTO_ACTIVATIONS if _integer_dot() else None


def auto_activation_quantization(params: ModelParams, linear_backends: list[str], head: str, dtype) -> str | None:
    """What `activation_quantization="auto"` means for `params`: `auto_activations()`
    where some projection is kept in blocks (of 32 inputs for int16: Q4_0, Q4_1, Q8_0,
    int4), every projection and the output projection run on the `cpu` kernel, in
    float32; else None (float), as on a GPU, under XLA's dot, or for a bfloat16 model
    (which multiplies its blocks in bfloat16 already). int16 as llama.cpp's and vLLM's
    CPU int4 paths do (int8 there), at steps 258 times finer: logprobs within ~1e-3 of
    float's; bfloat16 as a bfloat16 model does. Abstract params too."""
    if list(linear_backends) != ["cpu"] or head != "cpu" or jnp.dtype(dtype) != jnp.float32:
        return None
    chosen = auto_activations()
    return chosen if chosen and quantized_activations(params, chosen)[1] else None


def _amx() -> bool:
    """Whether the CPU kernels (built here) multiply bfloat16 on AMX's tiles."""
    return _kernels_have(cpu_kernels.has_amx)


def _integer_dot() -> bool:
    """Whether the CPU kernels (built here) have integer dot products."""
    return _kernels_have(cpu_kernels.has_integer_dot)


def _kernels_have(probe) -> bool:
    """`probe()` of the CPU kernels, False where they cannot be built here."""
    try:
        return probe()
    except cpu_kernels.KernelBuildError:
        return False


def rounds_activations(params: ModelParams, requested: str | None, linear_backend: str) -> bool:
    """Whether activation_quantization `requested` will quantize (or round to bfloat16)
    some projection's inputs, as far as is known before the backends are measured: not
    none, on a CPU, `linear_backend` auto or cpu, a float32 model with projections kept
    in blocks and, for auto, kernels with AMX or integer dot products (auto still settles
    on float where the measurement gives a projection to XLA). Abstract params too."""
    if requested in (None, "none") or linear_backend not in ("auto", "cpu") or jax.default_backend() != "cpu":
        return False
    chosen = auto_activations() if requested == "auto" else requested
    if jnp.dtype(params.final_norm.dtype) != jnp.float32 or chosen is None:
        return False
    return quantized_activations(params, chosen)[1] > 0


def bf16_tiles(params: PyTree, tiles: str) -> PyTree:
    """`params` with every packed weight summing bfloat16 by `tiles` (BF16_TILES: vdpbf16ps
    where the kernels are built with AVX512_BF16, the float tiles, or AMX's where the CPU
    has them), at the speed the start-up measurement found (jaxllm.worker.autotune); or,
    `tiles` NO_BF16, kept blocks that multiply in bfloat16 multiplying in float32 instead
    (`float_dtype`; plain bfloat16 panels as they are); BF16_STEP, blocks that multiply
    int16 activations multiplying in bfloat16 from the same arrays (INT16_STEP: as they
    are). Abstract ones too."""
    if tiles == INT16_STEP:
        return params
    if tiles == BF16_STEP:
        return _marked(params, PackedWeight, lambda w: w.activations == "int16", activations="bfloat16",
                       bf16_tiles="dot")
    if tiles == NO_BF16:
        return _marked(params, PackedWeight, lambda w: w.group > 0 and w.float_dtype == "bfloat16",
                       float_dtype="float32")
    if tiles not in BF16_TILES:
        raise ValueError(f"bf16 tiles: unknown {tiles!r}; choose one of "
                         f"{', '.join((*BF16_TILES, NO_BF16, INT16_STEP, BF16_STEP))}")
    return _marked(params, PackedWeight, bf16_tiles=tiles)


def layout_params(backend: str, params: ModelParams, pack_head: bool = True, activation_dtype=None) -> ModelParams:
    """`params` in the layout of a linear backend: packed (`cpu`), marked (`pallas`; on
    a Hopper partly held for the Mosaic GPU kernel, given the `activation_dtype`), or
    as they are (`xla`)."""
    if backend == "cpu":
        return pack_params(params, pack_head=pack_head)
    return pallas_params(params, activation_dtype) if backend == "pallas" else params


def pack_params(params: ModelParams, pack_head: bool = True) -> ModelParams:
    """The projection weights packed for the `cpu` backend, and the output projection
    too unless `pack_head` is False (unpacked, XLA's dot runs it). A tied one is packed
    in the embedding's place: `embed` becomes the packed transpose and its lookups read
    the panels (`packed_rows`), so the table is held once. Works on abstract params too."""

    def pack_layer(lp: LayerParams) -> LayerParams:  # a layer's matrices are its projections
        return jax.tree.map(lambda w: pack_weight(w) if isinstance(w, QuantizedWeight) or len(w.shape) >= 2 else w,
                            lp, is_leaf=lambda x: isinstance(x, QuantizedWeight))

    layers = tuple(pack_layer(lp) for lp in params.layers)
    if not pack_head:
        return params.replace(layers=layers)
    if params.lm_head is not None:
        lm_head = params.lm_head
    elif isinstance(params.embed, QuantizedWeight):  # [V, D] grouped along D: [D, V] grouped along its inputs
        lm_head = params.embed.transposed().map_arrays(
            lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else np.ascontiguousarray(a))
    elif isinstance(params.embed, jax.ShapeDtypeStruct):
        lm_head = jax.ShapeDtypeStruct(params.embed.shape[::-1], params.embed.dtype)
    elif isinstance(params.embed, jax.core.Tracer):  # packed as traced (Dense.pack)
        lm_head = params.embed.T
    else:
        lm_head = np.asarray(params.embed).T  # a view; pack_weight copies it once
    if params.lm_head is None:  # tied: the packed head is the table the lookups read
        return params.replace(layers=layers, embed=pack_weight(lm_head))
    return params.replace(layers=layers, lm_head=pack_weight(lm_head))


def unpack_params(params: ModelParams) -> ModelParams:
    """pack_params' inverse: every packed projection back to its [in, out] matrix, and a
    tied model's embedding from the head packed in its place. Traceable and
    differentiable (jnp transposes): a trainer holding the cpu backend's layout
    differentiates its forward through this (jaxllm.models.dense)."""
    def unpack(w):
        return unpack_weight(w) if isinstance(w, PackedWeight) else w

    layers = tuple(jax.tree.map(unpack, lp, is_leaf=lambda x: isinstance(x, PackedWeight)) for lp in params.layers)
    if isinstance(params.embed, PackedWeight):  # tied: the head [in, out] = the table transposed
        return params.replace(layers=layers, embed=unpack_weight(params.embed).T)
    return params.replace(layers=layers, lm_head=unpack(params.lm_head))


def is_packed(params: ModelParams) -> bool:
    """Whether `params` hold packed projections (the cpu backend's layout)."""
    return any(isinstance(w, PackedWeight) for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, PackedWeight)))


def linear_candidates(name: str, dtype, tensor_parallel: bool = False, quantized: bool = False) -> list[str]:
    """The backends `name` may mean for this compute dtype on this platform, in
    preference order (`auto` on a CPU: cpu and xla, measured by the runner per step
    shape: built for AVX2 the kernel won at 32 rows and lost at 512); an explicit
    choice that cannot work raises ValueError saying why. Tensor-parallel steps run
    plain weights (the packed layout is not sharded). `quantized` (int8 weights) on a
    CPU: `auto` is the kernel alone where it builds, unmeasured: XLA's dot converts the
    whole int8 matrix to float32 on every call, 4x the bytes the kernel reads (batch-1
    decode of SmolLM2 at 0.35x float32, where the kernel gives 1.8x); measuring by the
    summed step time chose it anyway under the AVX2 build, for its lead at 512 rows.
    `quantized` on a GPU (one device): `auto` is XLA's dot and the Pallas weight-only
    matmul, measured by the runner (the Mosaic GPU kernel on a Hopper: mosaic_weight);
    XLA's where they tie."""
    platform = jax.default_backend()
    preference = {"cpu": ["cpu", "xla"], "gpu": ["xla", "pallas"] if quantized and not tensor_parallel
                  else ["xla"]}.get(platform, ["xla"])

    def unavailable(backend: str) -> str | None:
        if backend == "pallas":
            return "it is not yet run under tensor parallelism" if tensor_parallel else None
        if backend != "cpu":
            return None
        if tensor_parallel:
            return "its packed weights are not sharded for tensor parallelism"
        return _cpu_backend_unavailable(dtype)

    candidates = backend_candidates("linear_backend", name, LINEAR_BACKENDS, preference, unavailable, logger)
    return candidates[:1] if quantized and name == "auto" and candidates[0] == "cpu" else candidates


def _cpu_backend_unavailable(dtype) -> str | None:
    platform = jax.default_backend()
    if platform != "cpu":
        return f"it runs on the CPU platform only (this is {platform})"
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
        return f"it needs float32 or bfloat16 weights (got {jnp.dtype(dtype).name})"
    try:
        cpu_kernels.load_kernels()
    except cpu_kernels.KernelBuildError as e:
        return str(e)
    return None
