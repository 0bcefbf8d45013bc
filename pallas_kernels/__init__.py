"""Pallas kernels for jaxllm's GPU path, and their pure-jnp references.

Public API (see docs/kernels.md):

* ``ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables,
  query_start_loc, num_seqs, *, sm_scale, sliding_window=None, soft_cap=None,
  interpret=False, k_scale=None, v_scale=None)`` -> ``[T, num_q_heads, head_dim]``:
  mixed prefill + decode attention over the paged KV cache in one launch (a cache of
  float32, bfloat16, float16, float8_e4m3fn, or int8 with its scales).
* ``ragged_paged_attention_mgpu(...)``: the same on Mosaic GPU for Hopper (bfloat16 /
  float16 over a cache of their dtype; ``ragged_paged_attention_mgpu.unsupported``
  says why not otherwise; ``interpret`` takes Mosaic GPU's ``InterpretGPUParams``).
* ``write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, interpret=False)``
  -> ``(k_cache, v_cache)``: scatter the new tokens' K/V into the cache.
* ``write_kv_cache_mgpu(...)``: the same on Mosaic GPU (a cache of the new K/V's dtype).
* ``quantized_matmul(x, q, scale, mins=None, *, group=0, interpret=False)`` ->
  ``[M, N]``: x times a weight held as int8 values and float32 scales (per column, or
  per 32 inputs with optional mins: GGUF's Q8_0 / Q4_0 / Q4_1), dequantized in the
  kernel; ``quantized_matmul_reference`` is its oracle.
* ``quantized_matmul_mgpu(x, q_t, scale, mins=None, *, group=0)``: the same on Mosaic GPU
  for Hopper, the values held transposed ``[N, K]`` (bfloat16 / float16 x).
* ``ragged_paged_attention_reference`` / ``write_kv_cache_reference``: the same
  signatures in plain jnp (the oracles; also usable as the XLA backend for small
  shapes).
"""

from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.kv_cache_write_mgpu import write_kv_cache_mgpu
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference
from pallas_kernels.quantized_matmul_mgpu import quantized_matmul_mgpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu
from pallas_kernels.reference import (
    ragged_paged_attention_reference,
    write_kv_cache_reference,
)

__all__ = [
    "quantized_matmul",
    "quantized_matmul_mgpu",
    "quantized_matmul_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_mgpu",
    "ragged_paged_attention_reference",
    "write_kv_cache",
    "write_kv_cache_mgpu",
    "write_kv_cache_reference",
]
