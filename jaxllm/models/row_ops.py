"""The layers' row-wise operations through the C++ kernels (jaxllm/cpu_kernels/row_ops.cc):
RMSNorm, alone or after the residual add (one pass for both), and the gated MLP's
activation, each row an item on both threads. The model (jaxllm.models.llama) takes them
where the projection that reads their output is packed for the `cpu` backend, whose
kernel library they share; elsewhere the jnp forms (llama.rms_norm, moe.gated) run.
Measurements: docs/cpu_kernels.md.

Numerics: the norm sums each row's squares in llama.row_sums' order (a row gives the
same bits alone or in any batch) and takes 1 / sqrt of the mean square (XLA's rsqrt
differs in the last bit now and then); the activation computes exp and a reciprocal
otherwise than XLA does. Both within a few ulp of the jnp forms
(tests/kernels/test_row_ops.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxllm.cpu_kernels import load_kernels

RMS_NORM_TARGET = "jaxllm_rms_norm"
ADD_RMS_NORM_TARGET = "jaxllm_add_rms_norm"
GLU_TARGET = "jaxllm_glu"
NORM_DTYPES = (jnp.float32, jnp.bfloat16)


def rms_norm_cpu(x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float, offset: float = 0.0
                 ) -> Float[Array, "... D"]:
    """llama.rms_norm by the C++ kernel: x float32 or bfloat16, the result x's type."""
    if x.dtype not in NORM_DTYPES:
        raise ValueError(f"rms_norm_cpu needs float32 or bfloat16 x (got {x.dtype})")
    load_kernels()
    x2 = x.reshape(-1, x.shape[-1])
    y = jax.ffi.ffi_call(RMS_NORM_TARGET, jax.ShapeDtypeStruct(x2.shape, x.dtype))(
        x2, weight.astype(jnp.float32), eps=np.float32(eps), offset=np.float32(offset))
    return y.reshape(x.shape)


def add_rms_norm_cpu(x: Float[Array, "T D"], y: Float[Array, "T D"], weight: Float[Array, " D"], eps: float,
                     offset: float = 0.0) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """(x + y, llama.rms_norm(x + y)) in one pass of the C++ kernel (the residual add and
    the next sublayer's norm): x and y of one type, float32 or bfloat16."""
    if x.dtype not in NORM_DTYPES or y.dtype != x.dtype or x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"add_rms_norm_cpu needs x and y of one shape [T, D] and type, float32 or bfloat16 "
                         f"(got {x.dtype} {x.shape} and {y.dtype} {y.shape})")
    load_kernels()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    s, n = jax.ffi.ffi_call(ADD_RMS_NORM_TARGET, (out, out))(
        x, y, weight.astype(jnp.float32), eps=np.float32(eps), offset=np.float32(offset))
    return s, n


def gated_cpu(x: Float[Array, "T F2"], act: str) -> Float[Array, "T F"]:
    """moe.gated by the C++ kernel: act(gate) * up of a float32 [gate | up], SiLU for
    "silu", else GELU's tanh form (as moe.gated)."""
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[1] % 2:
        raise ValueError(f"gated_cpu needs float32 [T, 2F] (got {x.dtype} {x.shape})")
    load_kernels()
    out = jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // 2), jnp.float32)
    return jax.ffi.ffi_call(GLU_TARGET, out)(x, act=np.int32(0 if act == "silu" else 1))
