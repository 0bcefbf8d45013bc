"""The Mosaic GPU ragged paged attention (pallas_kernels.ragged_paged_attention_mgpu)
against the jnp reference, in Mosaic GPU's interpreter on the CPU: TMA copies, barriers,
wgmma and shared memory simulated, uninitialized memory NaN, out-of-bounds reads
raising, and, on a reduced grid, races between copies and reads detected. The batches
are the Triton kernel tests' (test_pallas_ragged_paged_attention.make_batch): kv lengths
1, bs-1, bs, bs+1 and one of three K/V tiles (more than the two slots of the ring),
padding rows and sequences, shuffled block tables, NaN in every cache slot and query
row the kernel must not read. Then: it lowers for CUDA (Mosaic GPU's custom call) in
every bfloat16 engine configuration, and the engine's pallas backend picks it on a
Hopper only, for the configurations it serves.
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.attention.backends import attention_candidates, get_attention_fn
from jaxllm.platform import targets_gpu, targets_hopper
from pallas_kernels.cuda_lowering import (
    DEFAULT_BUCKETS,
    ENGINE_CONFIGS,
    attention_specs,
    cuda_target,
    has_triton_call,
    lower_for_cuda,
)
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu, unsupported
from tests.kernels.test_pallas_ragged_paged_attention import make_batch, oracle, seq_specs

# The interpreter, unless JAXLLM_PALLAS_INTERPRET=0 (scripts/gpu_check.py on a Hopper).
NATIVE = os.environ.get("JAXLLM_PALLAS_INTERPRET", "1") == "0"
TOL = 2e-3  # P rounded to the inputs' 16-bit type for the second product, as on the GPU


def interpret(races: bool = False):
    return False if NATIVE else plgpu.InterpretGPUParams(detect_races=races)


def run(case, *, races=False, **kw):
    """The kernel and the float32 reference on one batch; the rows that are not padding."""
    g, d, bs, dtype, kind = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    args, n_rows = make_batch(rng, seq_specs(kind, bs), hq=g * 2, hkv=2, d=d, bs=bs, dtype=dtype)
    kw.setdefault("sm_scale", d ** -0.5)
    out = ragged_paged_attention_mgpu(*args, interpret=interpret(races), **kw)
    assert out.shape == args[0].shape and out.dtype == dtype
    ref_kw = {k: v for k, v in kw.items() if k in ("sm_scale", "sliding_window", "soft_cap")}
    return np.asarray(out.astype(jnp.float32))[:n_rows], oracle(args, **ref_kw)[:n_rows]


# (group, head_dim, block_size, dtype, kind): every group meets every batch kind, the
# rest spread over them; G=3 pads to 4 rows a token, 16 to 4 tokens a work item.
# The default run takes groups 1 and 8 (3 with races, 2 in float16 below); the slow run
# all (each ~2 s interpreted).
SLOW = pytest.mark.slow
CASES = [
    (1, 64, 16, jnp.bfloat16, "mixed"),
    pytest.param((1, 128, 32, jnp.float16, "decode"), marks=SLOW),
    pytest.param((2, 128, 16, jnp.bfloat16, "prefill"), marks=SLOW),
    pytest.param((2, 64, 32, jnp.float16, "mixed"), marks=SLOW),
    pytest.param((4, 64, 32, jnp.float16, "decode"), marks=SLOW),
    pytest.param((4, 128, 16, jnp.float16, "mixed"), marks=SLOW),
    (8, 128, 32, jnp.bfloat16, "prefill"),
    pytest.param((8, 64, 16, jnp.float16, "decode"), marks=SLOW),
    pytest.param((3, 64, 16, jnp.bfloat16, "mixed"), marks=SLOW),
    pytest.param((16, 64, 16, jnp.bfloat16, "prefill"), marks=SLOW),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-d{c[1]}-bs{c[2]}-{jnp.dtype(c[3]).name}-{c[4]}")
def test_kernel_matches_reference(case):
    got, want = run(case)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("case,kw", [((3, 64, 16, jnp.bfloat16, "mixed"), {}),
                                     pytest.param((1, 64, 16, jnp.bfloat16, "decode"), {"block_kv": 128, "stages": 3},
                                                  marks=SLOW)],
                         ids=["mixed-g3", "decode-bkv128-3-stages"])
def test_no_races_and_no_reads_out_of_bounds(case, kw):
    """With race detection on (the interpreter raises on a shared-memory read that a
    TMA copy may still be writing, or on a read out of bounds); a deeper ring and
    tiles of 8 pages in the second case."""
    if NATIVE:
        pytest.skip("the interpreter's checks")
    got, want = run(case, races=True, **kw)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("sliding_window,soft_cap", [pytest.param(20, None, marks=SLOW),
                                                     pytest.param(None, 5.0, marks=SLOW), (33, 2.0)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    got, want = run((4, 64, 16, jnp.bfloat16, "mixed"), sm_scale=0.125, sliding_window=sliding_window,
                    soft_cap=soft_cap)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_no_sequences_gives_zeros_and_num_seqs_may_be_a_scalar():
    rng = np.random.default_rng(2)
    args, n_rows = make_batch(rng, seq_specs("mixed", 16), hq=4, hkv=2, d=64, bs=16, dtype=jnp.float16,
                              poison=False)
    scalar = ragged_paged_attention_mgpu(*args[:6], args[6][0], sm_scale=0.125, interpret=interpret())
    np.testing.assert_allclose(np.asarray(scalar.astype(jnp.float32))[:n_rows],
                               oracle(args, sm_scale=0.125)[:n_rows], atol=TOL, rtol=0)
    none = ragged_paged_attention_mgpu(*args[:6], jnp.zeros((1,), jnp.int32), sm_scale=0.125,
                                       interpret=interpret())
    assert not np.asarray(none.astype(jnp.float32)).any()


def test_unsupported_configurations_say_why():
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    assert unsupported(jnp.bfloat16, jnp.bfloat16, **kw) is None
    assert "float32" in unsupported(jnp.float32, jnp.float32, **kw)
    assert "int8 cache" in unsupported(jnp.bfloat16, jnp.int8, **kw)
    assert "head_dim 96" in unsupported(jnp.bfloat16, jnp.bfloat16, **(kw | {"head_dim": 96}))
    assert "block_size 4" in unsupported(jnp.bfloat16, jnp.bfloat16, **(kw | {"block_size": 4}))
    assert "128 query heads" in unsupported(jnp.bfloat16, jnp.bfloat16, **(kw | {"num_q_heads": 128, "num_kv_heads": 1}))
    rng = np.random.default_rng(0)
    args, _ = make_batch(rng, seq_specs("decode", 16), hq=4, hkv=2, d=64, bs=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        ragged_paged_attention_mgpu(*args, sm_scale=0.1)


SERVED = [c for c in ENGINE_CONFIGS if not unsupported(c.dtype, c.kv_dtype, num_q_heads=c.num_q_heads,
                                                       num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                                       block_size=c.block_size)]


@pytest.mark.parametrize("cfg", SERVED, ids=lambda c: c.name)
def test_lowers_for_cuda(cfg):
    """Pallas -> Mosaic GPU (layout inference, the kernel module embedded in the
    custom call) for every engine configuration it serves, both buckets."""
    for num_tokens, max_num_seqs in DEFAULT_BUCKETS:
        fn = lambda *a: ragged_paged_attention_mgpu(*a, sm_scale=cfg.sm_scale, sliding_window=cfg.sliding_window,
                                                    soft_cap=cfg.soft_cap)
        assert "mosaic_gpu" in lower_for_cuda(fn, *attention_specs(cfg, num_tokens, max_num_seqs)).as_text()


def test_the_mosaic_backend_lowers_to_it_and_pallas_to_triton(monkeypatch):
    """attention_backend="mosaic" lowers to Mosaic GPU for an H100 and a bfloat16 model;
    "pallas" to the Triton kernel, a Hopper's too. "mosaic" is refused, saying why, off a
    Hopper, for float32 queries and for an int8 cache. `auto` on a Hopper offers both
    for the start-up measurement (the Triton kernel first: it wins a tie), where mosaic
    serves the model; elsewhere the Triton kernel alone."""
    llama = next(c for c in ENGINE_CONFIGS if c.name == "llama-3.1-8b")

    def lowered(name, cfg, kind):
        attention = get_attention_fn(name)

        def fn(*args):
            scales = dict(zip(("k_scale", "v_scale"), args[7:]))
            return attention(*args[:7], sm_scale=cfg.sm_scale, **scales)
        return lower_for_cuda(fn, *attention_specs(cfg, 8, 8), device_kind=kind).as_text()

    assert "mosaic_gpu" in lowered("mosaic", llama, "NVIDIA H100 80GB HBM3")
    assert has_triton_call(lowered("pallas", llama, "NVIDIA H200"))
    shape = dict(head_dim=128, heads=(32, 8), block_size=16)
    with cuda_target("NVIDIA H200"):
        assert attention_candidates("mosaic", dtype=jnp.bfloat16, **shape) == ["mosaic"]
        with pytest.raises(ValueError, match="float32"):
            attention_candidates("mosaic", dtype=jnp.float32, **shape)
        with pytest.raises(ValueError, match="int8 cache"):
            attention_candidates("mosaic", dtype=jnp.bfloat16, cache_dtype=jnp.int8, **shape)
    with cuda_target("NVIDIA A100-SXM4-80GB"), pytest.raises(ValueError, match="Hopper"):
        attention_candidates("mosaic", dtype=jnp.bfloat16, **shape)
    if not targets_gpu():  # this CPU: no Hopper to run it
        with pytest.raises(ValueError, match="Hopper"):
            attention_candidates("mosaic", dtype=jnp.bfloat16, **shape)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the platform `auto` reads, as on a GPU
    with cuda_target("NVIDIA H200"):
        assert attention_candidates("auto", dtype=jnp.bfloat16, **shape) == ["pallas", "mosaic"]
        assert attention_candidates("auto", dtype=jnp.float32, **shape) == ["pallas"]
        assert attention_candidates("auto", dtype=jnp.bfloat16, cache_dtype=jnp.int8, **shape) == ["pallas"]
    with cuda_target("NVIDIA A100-SXM4-80GB"):
        assert attention_candidates("auto", dtype=jnp.bfloat16, **shape) == ["pallas"]
    with cuda_target("NVIDIA H200"):
        assert targets_hopper() and targets_gpu()
    with cuda_target("NVIDIA A100-SXM4-80GB"):
        assert targets_gpu() and not targets_hopper()
    if jax.default_backend() == "cpu":
        assert not targets_gpu() and not targets_hopper()
