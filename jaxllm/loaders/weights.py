"""Assemble ModelParams from named checkpoint tensors (HF names, [out, in] layout).

Every loader (HF safetensors, GGUF) reduces to a `TensorSource`: a function from an HF
tensor name to a numpy array (or None when absent). This module checks each shape
against the ModelConfig, transposes to [in, out], fuses q/k/v and gate/up, and moves
the result to the device in the compute dtype: all as the parameters' declaration
(jaxllm.models.params.declare) says.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.models.params import (
    ModelParams,
    ParamDecl,
    QuantizedWeight,
    declarations,
    declare,
    fuse,
    map_declared,
    stack_experts,
    unfuse,
)
from jaxllm.models.quant import dequantize

TensorSource = Callable[[str], "np.ndarray | None"]


class CheckpointError(ValueError):
    """A checkpoint file is missing a tensor, has a wrong shape, or cannot be read."""


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each HF tensor's name and shape, as the declaration (jaxllm.models.params.declare)
    implies them."""
    return {name: one.hf_shape(n) for decl in declarations(cfg) for one in decl.per_expert() for name, n in one.hf}


def build_params(cfg: ModelConfig, source: TensorSource, dtype, where: str, on_host: bool = False) -> ModelParams:
    """Read every tensor of `cfg`'s parameters through `source`, validate, fuse and place
    on device (or keep in host memory, numpy arrays of `dtype`, for placing shard by
    shard: `on_host`; jaxllm.models.params.shard_major lays them out for tensor
    parallelism).

    `where` names the checkpoint in error messages.
    """
    return build_declared(declare(cfg), source, dtype, where, on_host)


def build_declared(decls, source: TensorSource, dtype, where: str, on_host: bool = False):
    """build_params for any declaration (a pytree of ParamDecl: a model's, or a
    vision-language model's image side, jaxllm.models.vision_params)."""

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray | QuantizedWeight:
        array = source(name)
        if array is None:
            raise CheckpointError(f"{where}: missing tensor {name!r}")
        if tuple(array.shape) != shape:  # a QuantizedWeight's is its values' shape
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(array.shape)}, "
                f"but the model config implies {shape}"
            )
        return array if isinstance(array, QuantizedWeight) else np.asarray(array, dtype=np.float32)

    def load(decl: ParamDecl):
        if decl.experts:  # stacked: each expert's slice read as a parameter of its own
            experts = [load(one) for one in decl.per_expert()]
            if isinstance(experts[0], QuantizedWeight):  # a GGUF's kept blocks, expert by expert
                return stack_experts(experts)
            return np.stack(experts) if on_host else jnp.stack(experts)
        parts = [get(name, decl.hf_shape(n)) for name, n in decl.hf]
        if decl.quant:
            return _load_quantized(decl, parts, on_host, where)
        if decl.transposed:
            parts = [p.T for p in parts]
        array = fuse(parts) if len(parts) > 1 else parts[0]
        return np.ascontiguousarray(array, dtype=jnp.dtype(dtype)) if on_host else jnp.asarray(array, dtype=dtype)

    return map_declared(load, decls)


def _load_quantized(decl: ParamDecl, parts: list, on_host: bool, where: str) -> QuantizedWeight:
    """A parameter the source gives quantized (GGUF blocks, grouped along the HF
    tensor's rows: [out, in] values and [out, in / 32] scales and mins per part; int8
    with a scale per row, [out]):
    transposed and fused like a float one, values, scales and mins alike."""
    if not all(isinstance(p, QuantizedWeight) and p.group_axis == 1 for p in parts):
        raise CheckpointError(f"{where}: {decl.hf[0][0]} is declared {decl.quant} but not stored so")
    if (parts[0].perm is not None) != decl.act_order or any(
            not np.array_equal(p.perm, parts[0].perm) for p in parts if p.perm is not None):
        raise CheckpointError(f"{where}: {decl.hf[0][0]}'s parts are not in the activation order declared")
    if decl.transposed:
        parts = [p.transposed().map_arrays(np.ascontiguousarray) for p in parts]
    fused_field = lambda field: fuse([getattr(p, field) for p in parts])
    fused = parts[0].replace(q=fused_field("q"), scale=fused_field("scale"),
                             mins=None if parts[0].mins is None else fused_field("mins"))
    if on_host:
        return fused
    return fused.map_arrays(jnp.asarray).replace(perm=None if fused.perm is None else jnp.asarray(fused.perm))


def params_to_hf_tensors(cfg: ModelConfig, params: ModelParams) -> dict[str, np.ndarray]:
    """The inverse of build_params: HF-named float32 numpy tensors (for exporting;
    quantized projections dequantized)."""
    out: dict[str, np.ndarray] = {}

    def export(decl: ParamDecl, array) -> None:
        if decl.experts:
            for e, one in enumerate(decl.per_expert()):
                export(one, np.asarray(array)[e])
            return
        if isinstance(array, QuantizedWeight):
            array = dequantize(array)
        parts = unfuse(np.asarray(array, np.float32), [n for _, n in decl.hf])
        for (name, _), part in zip(decl.hf, parts, strict=True):
            out[name] = np.ascontiguousarray(part.T if decl.transposed else part)

    map_declared(export, declare(cfg), params)
    return out
