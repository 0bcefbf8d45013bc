"""C++ kernels for XLA:CPU, as XLA FFI custom calls, in one shared library built on first
use (build.py): ragged paged attention (paged_attention.cc; jaxllm.attention.cpu),
dense projections against packed weights (dense.cc; jaxllm.models.linear), the
sampler's greedy argmax (argmax.cc) and prompt-logprob scores (token_scores.cc;
jaxllm.sample.sampler), the layers' RMSNorm and gated activation (row_ops.cc;
jaxllm.models.row_ops)."""

from __future__ import annotations

import ctypes
import functools

import jax

from jaxllm.cpu_kernels.build import KernelBuildError, library_path

__all__ = ["KernelBuildError", "TARGETS", "has_amx", "has_bf16_dot", "has_integer_dot", "load_kernels",
           "vector_lanes"]

# FFI target name -> the handler symbol the library exports.
TARGETS = {
    "jaxllm_ragged_paged_attention": "JaxllmRaggedPagedAttention",
    "jaxllm_dense_f32": "JaxllmDenseF32",
    "jaxllm_dense_bf16": "JaxllmDenseBF16",
    "jaxllm_grouped_dense_f32": "JaxllmGroupedDenseF32",
    "jaxllm_grouped_dense_bf16": "JaxllmGroupedDenseBF16",
    "jaxllm_grouped_dense_i8": "JaxllmGroupedDenseI8",
    "jaxllm_grouped_dense_q8_0": "JaxllmGroupedDenseQ8_0",
    "jaxllm_grouped_dense_q4_0": "JaxllmGroupedDenseQ4_0",
    "jaxllm_grouped_dense_q4_1": "JaxllmGroupedDenseQ4_1",
    "jaxllm_grouped_dense_q8_mins": "JaxllmGroupedDenseQ8Mins",
    "jaxllm_grouped_dense_bf16_gated": "JaxllmGroupedDenseBF16Gated",
    "jaxllm_grouped_dense_q4_1_gated": "JaxllmGroupedDenseQ4_1Gated",
    "jaxllm_dense_i8": "JaxllmDenseI8",
    "jaxllm_dense_q8_0": "JaxllmDenseQ8_0",
    "jaxllm_dense_q4_0": "JaxllmDenseQ4_0",
    "jaxllm_dense_q4_1": "JaxllmDenseQ4_1",
    "jaxllm_dense_q8_mins": "JaxllmDenseQ8Mins",
    "jaxllm_dense_q4_0_x8": "JaxllmDenseQ4_0X8",
    "jaxllm_dense_q4_1_x8": "JaxllmDenseQ4_1X8",
    "jaxllm_dense_q8_0_x8": "JaxllmDenseQ8_0X8",
    "jaxllm_grouped_dense_q4_0_x8": "JaxllmGroupedDenseQ4_0X8",
    "jaxllm_grouped_dense_q4_1_x8": "JaxllmGroupedDenseQ4_1X8",
    "jaxllm_grouped_dense_q8_0_x8": "JaxllmGroupedDenseQ8_0X8",
    "jaxllm_dense_q4_0_x16": "JaxllmDenseQ4_0X16",
    "jaxllm_dense_q4_1_x16": "JaxllmDenseQ4_1X16",
    "jaxllm_dense_q8_0_x16": "JaxllmDenseQ8_0X16",
    "jaxllm_grouped_dense_q4_0_x16": "JaxllmGroupedDenseQ4_0X16",
    "jaxllm_grouped_dense_q4_1_x16": "JaxllmGroupedDenseQ4_1X16",
    "jaxllm_grouped_dense_q8_0_x16": "JaxllmGroupedDenseQ8_0X16",
    "jaxllm_dense_q4_0_xbf16": "JaxllmDenseQ4_0XBF16",
    "jaxllm_dense_q4_1_xbf16": "JaxllmDenseQ4_1XBF16",
    "jaxllm_grouped_dense_q4_0_xbf16": "JaxllmGroupedDenseQ4_0XBF16",
    "jaxllm_grouped_dense_q4_1_xbf16": "JaxllmGroupedDenseQ4_1XBF16",
    "jaxllm_dense_q8_0_xbf16": "JaxllmDenseQ8_0XBF16",
    "jaxllm_grouped_dense_q8_0_xbf16": "JaxllmGroupedDenseQ8_0XBF16",
    "jaxllm_argmax_f32": "JaxllmArgmaxF32",
    "jaxllm_token_scores_f32": "JaxllmTokenScoresF32",
    "jaxllm_rms_norm": "JaxllmRmsNorm",
    "jaxllm_add_rms_norm": "JaxllmAddRmsNorm",
    "jaxllm_glu": "JaxllmGlu",
}


@functools.cache
def load_kernels() -> str:
    """Build (or find) the library and register its custom calls; the library's path.
    Raises KernelBuildError when this machine cannot build or load it."""
    path = library_path()
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        handlers = {target: getattr(lib, symbol) for target, symbol in TARGETS.items()}
    except (OSError, AttributeError) as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return str(path)


@functools.cache
def vector_lanes() -> int:
    """float32 lanes of the vectors the library was built for: 16 (AVX-512), 8 (AVX2),
    4 (SSE, NEON). Builds and loads the library if needed (KernelBuildError)."""
    return int(ctypes.cdll.LoadLibrary(load_kernels()).JaxllmVectorLanes())


@functools.cache
def has_bf16_dot() -> bool:
    """Whether the library multiplies bfloat16 by vdpbf16ps where a call asks for it
    (`bf16_tiles` dot; built with AVX512_BF16): then it holds both bfloat16 paths, the same
    sums either way, and the faster is measured at start-up. Builds and loads the
    library if needed (KernelBuildError)."""
    return bool(ctypes.cdll.LoadLibrary(load_kernels()).JaxllmBF16Dot())


@functools.cache
def has_amx() -> bool:
    """Whether the library multiplies bfloat16 on AMX's tiles where a call asks for them
    (`bf16_tiles` amx): built with AMX_BF16 (an Intel Xeon from Sapphire Rapids on) and
    the OS lets this process use them. Builds and loads the library if needed
    (KernelBuildError)."""
    return bool(ctypes.cdll.LoadLibrary(load_kernels()).JaxllmAmx())


@functools.cache
def has_integer_dot() -> bool:
    """Whether the library multiplies int8 / int16 activations in vector integer dot
    products (built with AVX2 or AVX512_VNNI); elsewhere those handlers run a lane at a
    time, slower than the float tiles. Builds and loads the library if needed
    (KernelBuildError)."""
    return bool(ctypes.cdll.LoadLibrary(load_kernels()).JaxllmIntegerDot())
