"""The Pallas kernels lower for CUDA (Triton) without a GPU, for every engine config.

``jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))`` runs the Pallas ->
Triton IR lowering. On top of it we capture each Triton module, run the MLIR verifier
on it and check every ``tt.dot`` has all dimensions >= 16 (Triton's MMA minimum,
which the lowering itself does not check). The last tests show the check can fail.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

try:  # private: used only to capture the Triton module for extra checks
    from jax._src.pallas.triton import pallas_call_registration as _registration
except ImportError:  # pragma: no cover - other JAX versions
    _registration = None

from pallas_kernels.cuda_lowering import (
    DEFAULT_BUCKETS,
    ENGINE_CONFIGS,
    AttentionConfig,
    attention_specs,
    check_cuda_lowering,
    has_triton_call,
    lower_attention_for_cuda,
    lower_for_cuda,
    lower_write_kv_cache_for_cuda,
)
from pallas_kernels.ragged_paged_attention import (
    build_ragged_paged_attention_call,
    ragged_paged_attention,
)

DOT_RE = re.compile(r"tt\.dot .*: tensor<(\d+)x(\d+)x\w+> \* tensor<(\d+)x(\d+)x\w+>")


@pytest.fixture
def triton_modules(monkeypatch):
    """Capture (and verify) every Triton module the Pallas lowering produces."""
    jax.clear_caches()  # identical kernels of earlier tests would not be re-lowered
    modules: list[str] = []
    if _registration is None or not hasattr(
            getattr(_registration, "lowering", None), "lower_jaxpr_to_triton_module"):
        return None  # this JAX version does not expose the Triton module
    original = _registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        assert result.module.operation.verify()
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(_registration.lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


@pytest.mark.parametrize("cfg", ENGINE_CONFIGS, ids=lambda c: c.name)
def test_engine_configs_lower_for_cuda(cfg, triton_modules):
    for num_tokens, max_num_seqs in DEFAULT_BUCKETS:
        lowered = lower_attention_for_cuda(cfg, num_tokens, max_num_seqs)
        assert has_triton_call(lowered.as_text())
        lowered = lower_write_kv_cache_for_cuda(cfg, num_tokens)
        assert has_triton_call(lowered.as_text())
    if triton_modules is None:
        return  # lowering succeeded; module-level checks unavailable here
    assert len(triton_modules) == 2 * len(DEFAULT_BUCKETS)
    attention_modules = [m for m in triton_modules if "tt.dot" in m]
    assert len(attention_modules) == len(DEFAULT_BUCKETS)
    for module in attention_modules:
        dots = DOT_RE.findall(module)
        assert len(dots) == 2, "expected the QK^T and PV dots"
        for dims in dots:
            assert all(int(x) >= 16 for x in dims), dims
        if cfg.dtype == "float32":  # float32 must not silently run as TF32
            dot_lines = [ln for ln in module.splitlines() if "tt.dot" in ln]
            assert not any("tf32" in ln for ln in dot_lines), dot_lines


SMALL = AttentionConfig("small", 8, 2, 64, num_blocks=64, max_model_len=256)


def _raw_call_specs(cfg, num_tokens, max_num_seqs, num_work):
    sd = jax.ShapeDtypeStruct
    dt = jnp.dtype(cfg.dtype)
    slots = cfg.num_blocks * cfg.block_size
    return (
        sd((num_work,), jnp.int32), sd((num_work,), jnp.int32),
        sd((max_num_seqs + 1,), jnp.int32), sd((max_num_seqs,), jnp.int32),
        sd((max_num_seqs, cfg.max_blocks_per_seq), jnp.int32),
        sd((num_tokens * cfg.num_q_heads, cfg.head_dim), dt),
        sd((slots, cfg.num_kv_heads, cfg.head_dim), dt),
        sd((slots, cfg.num_kv_heads, cfg.head_dim), dt),
    )


def _lower_raw(cfg, *, block_q, block_kv):
    call = build_ragged_paged_attention_call(
        num_tokens=16, num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, num_slots=cfg.num_blocks * cfg.block_size,
        block_size=cfg.block_size, max_blocks=cfg.max_blocks_per_seq, num_work=8,
        dtype=jnp.dtype(cfg.dtype), block_q=block_q, block_kv=block_kv, sm_scale=0.1,
        sliding_window=None, soft_cap=None, num_warps=4, num_stages=2, interpret=False)
    specs = _raw_call_specs(cfg, 16, 4, 8)
    return lower_for_cuda(call, *specs)


def test_raw_kernel_valid_config_lowers():
    """Control for the next test: the same unvalidated builder, valid tiles."""
    assert has_triton_call(_lower_raw(SMALL, block_q=4, block_kv=32).as_text())


def test_invalid_config_fails_at_cuda_lowering():
    """A 24-position K/V tile (not a power of two) is rejected by the Triton lowering
    itself -- the unvalidated builder gets as far as `.lower(...)` and fails there."""
    with pytest.raises(ValueError, match="power of 2"):
        _lower_raw(SMALL, block_kv=24, block_q=4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_kv=24), "power of two"),
    (dict(block_kv=8), ">= 16"),
    (dict(block_q=2), ">= 16"),  # G=4: 2 tokens x 4 heads = 8 MMA rows
])
def test_public_api_rejects_invalid_tiles_before_lowering(kwargs, match):
    f = functools.partial(ragged_paged_attention, sm_scale=0.1, **kwargs)
    with pytest.raises(ValueError, match=match):
        lower_for_cuda(f, *attention_specs(SMALL, 16, 4))


FUNC_ARGS_RE = re.compile(r"tt\.func public @\S+\((.*?)\)\s*(?:attributes|\{)")


def _pointer_args(module: str) -> list[str]:
    """The element types of the Triton kernel's pointer arguments, in order."""
    return re.findall(r"!tt\.ptr<(\w+)>", FUNC_ARGS_RE.search(module).group(1))


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("cfg", [SMALL, ENGINE_CONFIGS[1]], ids=lambda c: f"{c.name}-q_{c.dtype}")
def test_quantized_caches_lower_for_cuda(cfg, cache_dtype, triton_modules):
    """q bfloat16 (or float32) over an int8 (+ scales) or fp8 cache: lowers to one Triton
    kernel per bucket whose dots take q's dtype, named after the cache dtype."""
    cfg = dataclasses.replace(cfg, cache_dtype=cache_dtype)
    for num_tokens, max_num_seqs in DEFAULT_BUCKETS:
        text = lower_attention_for_cuda(cfg, num_tokens, max_num_seqs).as_text()
        assert has_triton_call(text)
        assert f"_kv{cache_dtype}" in text  # the kernel name: own executables per cache dtype
    if triton_modules is None:
        return
    assert len(triton_modules) == len(DEFAULT_BUCKETS)
    q_ir = {"bfloat16": "bf16", "float32": "f32"}[cfg.dtype]
    cache_ir = {"int8": "i8", "float8_e4m3fn": "f8E4M3FN"}[cache_dtype]
    for module in triton_modules:
        # work items, qsl, kv_lens, block tables; q, K, V, [k_scale, v_scale,] out
        scales = ["f32", "f32"] if cache_dtype == "int8" else []
        assert _pointer_args(module) == ["i32"] * 5 + [q_ir, cache_ir, cache_ir, *scales, q_ir]
        dots = DOT_RE.findall(module)
        assert len(dots) == 2
        for dims in dots:
            assert all(int(x) >= 16 for x in dims), dims
        for ln in (ln for ln in module.splitlines() if "tt.dot" in ln):
            operands = re.search(r"tensor<\d+x\d+x(\w+)> \* tensor<\d+x\d+x(\w+)>", ln).groups()
            assert operands == (q_ir, q_ir), ln  # both operands in q's dtype
            if cfg.dtype == "float32":
                assert "tf32" not in ln, ln


def test_unquantized_kernel_takes_no_scales(triton_modules):
    """The cache in q's dtype: no scale inputs and no conversion of the K/V tiles."""
    text = lower_attention_for_cuda(SMALL, 16, 4).as_text()
    assert has_triton_call(text) and "_kvbfloat16" in text
    if triton_modules is None:
        return
    [module] = triton_modules
    assert _pointer_args(module) == ["i32"] * 5 + ["bf16"] * 4
    assert "sitofp" not in module and "tt.fp_to_fp" not in module
    assert "arith.extf" not in module  # K/V tiles are fed to the dots as loaded


def test_quantized_cache_lowering_checks():
    """check_cuda_lowering covers quantized caches: an fp8 cache lowers both kernels
    (the write saturates), an int8 cache only attention (its write is not Pallas)."""
    fp8 = dataclasses.replace(SMALL, cache_dtype="float8_e4m3fn")
    int8 = dataclasses.replace(SMALL, cache_dtype="int8")
    assert check_cuda_lowering([fp8, int8], buckets=[(8, 8)]) == 3
    assert len(attention_specs(int8, 8, 8)) == len(attention_specs(SMALL, 8, 8)) + 2
    with pytest.raises(ValueError, match="int8"):
        lower_write_kv_cache_for_cuda(int8, 8)
