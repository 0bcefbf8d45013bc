"""The cpu backend (C++ custom call) against the plain-softmax reference: decodes,
prefill chunks longer than a row tile, kv lengths around tile and block edges, sliding
windows, soft caps, GQA groups of 1..8 query heads (chunks of 4 and remainders), head
dims 16..128, block sizes smaller and larger than the 16-token key tile, padding
tokens and sequences, shuffled block tables; and how backends are chosen."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import cpu_kernels
from jaxllm.attention import backends, cpu
from jaxllm.cpu_kernels import build
from pallas_kernels import ragged_paged_attention_reference
from tests.support.attention import make_batch, shared_prefix_batch

CASES = {
    "decode_only": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 300)],
    "prefill_only": [(70, 70), (5, 5), (33, 33)],
    "mixed_chunked": [(1, 40), (45, 200), (1, 129), (2, 2), (31, 31), (1, 128), (64, 190)],
}
# (num_kv_heads, group, head_dim)
HEADS = [(2, 3, 32), (3, 3, 64), (1, 8, 128), (4, 1, 16), (2, 7, 64), (1, 2, 256)]


def _check(args, valid, atol=2e-5, **kw):
    got = np.asarray(jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, **kw))(*args))
    want = np.asarray(ragged_paged_attention_reference(*args, **kw))
    np.testing.assert_allclose(got[:valid], want[:valid], atol=atol, rtol=0)
    np.testing.assert_array_equal(got[valid:], 0)  # padding rows


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hkv{h[0]}-g{h[1]}-d{h[2]}")
@pytest.mark.parametrize("block_size", [16, 4, 48])
def test_matches_reference(heads, block_size):
    hkv, group, head_dim = heads
    rng = np.random.default_rng(block_size + 10 * group)
    seqs = [s for case in CASES.values() for s in case]
    args, valid = make_batch(rng, seqs, block_size=block_size, num_kv_heads=hkv, group=group, head_dim=head_dim)
    _check(args, valid, sm_scale=0.3)


@pytest.mark.parametrize("sliding_window", [1, 20, 100])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng(sliding_window)
    seqs = CASES["mixed_chunked"] + CASES["decode_only"]
    args, valid = make_batch(rng, seqs, block_size=8, num_kv_heads=2, group=3, head_dim=64)
    _check(args, valid, sm_scale=0.2, sliding_window=sliding_window, soft_cap=soft_cap)


def test_large_scores_stay_finite_and_close():
    """Scores of +-hundreds: the online softmax's running max keeps exp in range (float32
    rounding of scores that large differs from the reference's by ~1e-5 relative)."""
    rng = np.random.default_rng(3)
    args, valid = make_batch(rng, [(1, 200), (40, 90)], block_size=16, num_kv_heads=1, group=4, head_dim=64)
    q = args[0] * 30.0
    _check((q, *args[1:]), valid, atol=2e-4, sm_scale=1.0)


def test_num_seqs_zero_and_empty_sequences():
    rng = np.random.default_rng(4)
    args, _ = make_batch(rng, [(3, 10), (0, 5), (1, 7)], block_size=16, num_kv_heads=2, group=2, head_dim=32)
    _check(args, int(args[5][3]), sm_scale=0.5)  # a sequence with no new tokens in the middle
    q, k, v, kv_lens, tables, qsl, _ = args
    got = cpu.ragged_paged_attention_cpu(q, k, v, kv_lens, tables, qsl, jnp.int32(0), sm_scale=0.5)
    np.testing.assert_array_equal(np.asarray(got), 0)


def test_backend_candidates(caplog):
    """auto on a CPU: both, the kernel first (the runner measures them); an explicit
    name: itself, or a ValueError saying why it cannot run."""
    assert backends.attention_candidates("auto", head_dim=64, dtype=jnp.float32) == ["cpu", "xla"]
    assert backends.attention_candidates("xla", head_dim=64, dtype=jnp.float32) == ["xla"]
    assert backends.attention_candidates("cpu", head_dim=64, dtype=jnp.float32) == ["cpu"]
    with caplog.at_level(logging.WARNING, logger="jaxllm.attention.backends"):
        assert backends.attention_candidates("auto", head_dim=64, dtype=jnp.bfloat16) == ["xla"]
    assert "needs float32" in caplog.text
    with pytest.raises(ValueError, match="head_dim"):
        backends.attention_candidates("cpu", head_dim=80, dtype=jnp.float32)
    with pytest.raises(ValueError, match="unknown 'cuda'"):
        backends.attention_candidates("cuda", head_dim=64, dtype=jnp.float32)


def test_auto_falls_back_to_xla_when_the_kernels_cannot_build(monkeypatch, caplog):
    def no_build():
        raise cpu.KernelBuildError("no C++ compiler found")

    monkeypatch.setattr(cpu, "load_kernels", no_build)
    with caplog.at_level(logging.WARNING, logger="jaxllm.attention.backends"):
        assert backends.attention_candidates("auto", head_dim=64, dtype=jnp.float32) == ["xla"]
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ValueError, match="no C\\+\\+ compiler found"):
        backends.attention_candidates("cpu", head_dim=64, dtype=jnp.float32)


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.KernelBuildError, match="no C\\+\\+ compiler"):
        build._compiler()


def test_a_failed_build_reports_the_compiler_error(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCES", (bad,))
    with pytest.raises(build.KernelBuildError, match="bad.cc"):
        build._compile(build._compiler(), jax.ffi.include_dir(), tmp_path / "bad.so")
    assert not list(tmp_path.glob("*.so"))  # no half-written library left behind


@pytest.mark.parametrize("block_size,prefix_blocks", [(16, 8), (4, 37), (32, 3)])
@pytest.mark.parametrize("sliding_window", [None, 50])
def test_common_prefix_pass_matches_reference(block_size, prefix_blocks, sliding_window):
    """The common prefix attended once for all rows (decodes and prefill chunks) then
    merged with each sequence's own keys gives what attending to everything does."""
    p = prefix_blocks * block_size
    seqs = [(1, p + 1), (1, p + 40), (20, p + 20), (1, p + 130), (45, p + 100), (1, p + 64)]
    rng = np.random.default_rng(prefix_blocks)
    args, valid = shared_prefix_batch(rng, prefix_blocks, seqs, block_size=block_size, num_kv_heads=2, group=3,
                                      head_dim=64)
    kw = dict(sm_scale=0.2, sliding_window=sliding_window)
    got = jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, common_prefix_blocks=jnp.int32(prefix_blocks), **kw))(
        *args)
    want = ragged_paged_attention_reference(*args, **kw)
    np.testing.assert_allclose(np.asarray(got)[:valid], np.asarray(want)[:valid], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got)[valid:], 0)


def test_common_prefix_blocks_from_tables():
    from jaxllm.attention.metadata import common_prefix_blocks

    tables = np.array([[5, 6, 7, 8, 0], [5, 6, 7, 9, 0], [5, 6, 7, 8, 1]])
    assert common_prefix_blocks(tables, np.array([64, 64, 64]), 16) == 3
    assert common_prefix_blocks(tables, np.array([64, 40, 64]), 16) == 2  # not yet computed in one of them
    assert common_prefix_blocks(tables[:1], np.array([64]), 16) == 0  # a single sequence shares with nobody
    assert common_prefix_blocks(np.array([[1, 2], [3, 2]]), np.array([32, 32]), 16) == 0


def test_common_prefix_hint_is_used():
    """Negative control: with tables that do NOT share their first blocks, a false hint
    changes the result (sequence 0's blocks are read for everyone), so the tests above
    do exercise the common prefix pass."""
    seqs = [(1, 200), (1, 150), (30, 180)]
    args, valid = make_batch(np.random.default_rng(9), seqs, block_size=16, num_kv_heads=2, group=3, head_dim=64)
    want = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.2))[:valid]
    honest = cpu.ragged_paged_attention_cpu(*args, sm_scale=0.2, common_prefix_blocks=jnp.int32(0))
    false = cpu.ragged_paged_attention_cpu(*args, sm_scale=0.2, common_prefix_blocks=jnp.int32(8))
    np.testing.assert_allclose(np.asarray(honest)[:valid], want, atol=2e-5, rtol=0)
    assert np.abs(np.asarray(false)[:valid] - want).max() > 1e-2


def test_auto_on_a_gpu_is_the_pallas_kernel(monkeypatch):
    """On a GPU `auto` means the Pallas kernels (their differing tokens on the H100 were
    bfloat16 rounding: docs/kernels.md), and the CPU kernel is refused with the reason."""
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    assert backends.attention_candidates("auto", head_dim=64, dtype=jnp.bfloat16) == ["pallas"]
    assert backends.attention_candidates("xla", head_dim=64, dtype=jnp.bfloat16) == ["xla"]
    with pytest.raises(ValueError, match="CPU platform only"):
        backends.attention_candidates("cpu", head_dim=64, dtype=jnp.float32)


def _rows_alone(args, **kw):
    """Each real query row of the batch attended alone: a one-row call (a decode at its
    position, the same block table), its output row."""
    q, k, v, kv_lens, tables, qsl, num_seqs = args
    rows = []
    for s in range(int(num_seqs)):
        begin, end, kv = int(qsl[s]), int(qsl[s + 1]), int(kv_lens[s])
        for r in range(begin, end):
            alone = cpu.ragged_paged_attention_cpu(q[r:r + 1], k, v, jnp.array([kv - (end - r) + 1], jnp.int32),
                                                   tables[s:s + 1], jnp.array([0, 1], jnp.int32), jnp.int32(1), **kw)
            rows.append(np.asarray(alone)[0])
    return np.stack(rows)


@pytest.mark.parametrize("sliding_window", [None, 50])
def test_batch_invariant_rows_are_the_same_bits_alone(sliding_window):
    """batch_invariant: every row of a step mixing decodes and prefill chunks over a shared
    prefix (the common prefix hint given) is bit for bit that row attended alone, and
    matches the reference; without it the prefill path and the prefix pass sum in
    another order (the negative control: some rows differ)."""
    p, bs = 6 * 16, 16
    seqs = [(1, p + 1), (45, p + 100), (1, p + 130), (20, p + 20), (1, p + 64)]
    args, valid = shared_prefix_batch(np.random.default_rng(11), 6, seqs, block_size=bs, num_kv_heads=2, group=3,
                                      head_dim=64)
    kw = dict(sm_scale=0.2, sliding_window=sliding_window)
    call = jax.jit(lambda *a, inv: cpu.ragged_paged_attention_cpu(*a, common_prefix_blocks=jnp.int32(6),
                                                                  batch_invariant=inv, **kw), static_argnames="inv")
    got = np.asarray(call(*args, inv=True))[:valid]
    np.testing.assert_array_equal(got, _rows_alone(args, batch_invariant=True, **kw))
    np.testing.assert_allclose(got, np.asarray(ragged_paged_attention_reference(*args, **kw))[:valid], atol=2e-5,
                               rtol=0)
    assert (np.asarray(call(*args, inv=False))[:valid] != got).any()


def _bf16_cache(args):
    """The batch with its caches in bfloat16 (as a bfloat16 KV cache stores them), and
    the reference's float32 view of the same values."""
    q, k, v, *rest = args
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    return (q, kb, vb, *rest), (q, kb.astype(jnp.float32), vb.astype(jnp.float32), *rest)


@pytest.mark.parametrize("heads", [(2, 3, 64), (1, 8, 128), (3, 5, 64)], ids=lambda h: f"hkv{h[0]}-g{h[1]}-d{h[2]}")
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (50, None), (None, 5.0)])
def test_amx_prefill_path_matches_reference(heads, sliding_window, soft_cap):
    """On a CPU with AMX, a bfloat16 cache's prefill path multiplies on the tile unit, the
    queries and the probabilities each as three bfloat16 parts: within float32 rounding
    of the reference (the float paths' bound), for long chunks that start mid-row and
    cross chunk edges, windows, soft caps, GQA groups, head_dim 64 and 128, and the
    common prefix pass. (With one bfloat16 part each the same batches were 6e-3 to 2e-2
    off, with two up to 2.2e-5.)"""
    if not cpu_kernels.has_amx():
        pytest.skip("this CPU (or its OS) gives no AMX tiles: the prefill path runs its float tiles "
                    "(test_matches_reference)")
    hkv, group, head_dim = heads
    kw = dict(sm_scale=0.2, sliding_window=sliding_window, soft_cap=soft_cap)
    seqs = [(70, 70), (45, 200), (1, 129), (100, 300), (17, 80), (64, 190)]
    args, valid = make_batch(np.random.default_rng(head_dim + group), seqs, block_size=16, num_kv_heads=hkv,
                             group=group, head_dim=head_dim)
    stored, view = _bf16_cache(args)
    attend = jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, **kw))
    got = attend(*stored)
    want = ragged_paged_attention_reference(*view, **kw)
    np.testing.assert_allclose(np.asarray(got)[:valid], np.asarray(want)[:valid], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got)[valid:], 0)
    # the tiles did run: the float tiles give a bfloat16 cache the very bits of a float32 one
    # holding the same values, the tile unit sums in another order
    assert (np.asarray(attend(*view))[:valid] != np.asarray(got)[:valid]).any()
    p = 8 * 16
    shared, valid = shared_prefix_batch(np.random.default_rng(group), 8, [(1, p + 1), (20, p + 20), (45, p + 100)],
                                        block_size=16, num_kv_heads=hkv, group=group, head_dim=head_dim)
    stored, view = _bf16_cache(shared)
    got = jax.jit(lambda *a: cpu.ragged_paged_attention_cpu(*a, common_prefix_blocks=jnp.int32(8), **kw))(*stored)
    want = ragged_paged_attention_reference(*view, **kw)
    np.testing.assert_allclose(np.asarray(got)[:valid], np.asarray(want)[:valid], atol=2e-5, rtol=0)


def _paired_path_runs() -> bool:
    """Whether bf16_products changes the prefill path here: a library built with
    AVX512_BF16 (vdpbf16ps, or on AMX one bfloat16 part each instead of three)."""
    return cpu_kernels.has_bf16_dot()


@pytest.mark.parametrize("heads", [(2, 8, 64), (1, 8, 128), (1, 8, 32)], ids=lambda h: f"hkv{h[0]}-g{h[1]}-d{h[2]}")
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (50, None), (None, 5.0)])
def test_bf16_products_prefill_path(heads, sliding_window, soft_cap):
    """bf16_products (a bfloat16 model's attention) with a bfloat16 cache: where the
    library has vdpbf16ps (on AMX: its tiles, at head_dim 64 and 128), the prefill path
    multiplies the queries (times sm_scale, a power of two here, so q's own rounding) and
    the probabilities rounded to bfloat16. So it is within the probabilities' rounding of
    the reference on the queries rounded, and farther from the reference on them
    unrounded, as is the float path from the rounded one (the rounding path did run); the
    same holds through the common prefix pass. Elsewhere the flag changes no bit. Groups
    of 8: every item of these chunks takes the prefill path."""
    hkv, group, head_dim = heads
    kw = dict(sm_scale=0.25, sliding_window=sliding_window, soft_cap=soft_cap)
    seqs = [(70, 70), (45, 200), (100, 300), (17, 80), (64, 190)]
    args, valid = make_batch(np.random.default_rng(head_dim + hkv), seqs, block_size=16, num_kv_heads=hkv,
                             group=group, head_dim=head_dim)
    args = (args[0] * 3.0, *args[1:])  # peakier softmaxes: q's rounding shows
    _paired_checks(args, valid, kw)
    p = 8 * 16
    shared, valid = shared_prefix_batch(np.random.default_rng(group), 8, [(20, p + 20), (45, p + 100), (33, p + 33)],
                                        block_size=16, num_kv_heads=hkv, group=group, head_dim=head_dim)
    _paired_checks((shared[0] * 3.0, *shared[1:]), valid, kw | dict(common_prefix_blocks=jnp.int32(8)))


@pytest.mark.parametrize("heads", [(3, 3, 64), (2, 6, 128), (1, 4, 32)], ids=lambda h: f"hkv{h[0]}-g{h[1]}-d{h[2]}")
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (50, None), (None, 5.0)])
def test_bf16_products_decode_path(heads, sliding_window, soft_cap):
    """The same on the decode path (groups under 8: one query row an item), where the
    library has vdpbf16ps and the kernel no AMX path (attend_chunk_paired: on AMX's Xeons the
    float path is faster, and the flag changes no decode bit there): the queries and the
    probabilities rounded to bfloat16, within the probabilities' rounding of the
    reference on the queries rounded. Odd and even context lengths (the last pair of
    keys half padding), and one past a block's end."""
    hkv, group, head_dim = heads
    kw = dict(sm_scale=0.25, sliding_window=sliding_window, soft_cap=soft_cap)
    seqs = [(1, 70), (1, 201), (1, 300), (1, 17), (1, 1), (1, 129)]
    args, valid = make_batch(np.random.default_rng(head_dim + group), seqs, block_size=16, num_kv_heads=hkv,
                             group=group, head_dim=head_dim)
    amx = cpu_kernels.has_amx() and head_dim % 64 == 0  # the process's AMX path (a bfloat16 cache, D % 64 == 0)
    # nearer the reference on the queries rounded than on them unrounded (by 1.2x at
    # head_dim 32 under the soft cap, one query row a sequence)
    _paired_checks((args[0] * 3.0, *args[1:]), valid, kw, runs=_paired_path_runs() and not amx, margin=1.0)


def _paired_checks(args, valid, kw, runs=None, margin=1.5):
    stored, view = _bf16_cache(args)
    attend = jax.jit(lambda *a, paired: cpu.ragged_paged_attention_cpu(*a, bf16_products=paired, **kw),
                     static_argnames="paired")
    got, floats = np.asarray(attend(*stored, paired=True)), np.asarray(attend(*stored, paired=False))
    if not (_paired_path_runs() if runs is None else runs):
        np.testing.assert_array_equal(got, floats)
        return
    ref_kw = {k: v for k, v in kw.items() if k != "common_prefix_blocks"}
    rounded = np.asarray(ragged_paged_attention_reference(view[0].astype(jnp.bfloat16).astype(jnp.float32), *view[1:],
                                                          **ref_kw))[:valid]
    exact = np.asarray(ragged_paged_attention_reference(*view, **ref_kw))[:valid]
    err = np.abs(got[:valid] - rounded).max()
    assert err < 8e-3, err  # the probabilities' rounding: a relative 2^-9 of each
    # q's rounding moves the outputs further (1.8-16x here; least under the soft cap's tanh)
    assert np.abs(got[:valid] - exact).max() > margin * err
    assert np.abs(floats[:valid] - rounded).max() > margin * err
    np.testing.assert_array_equal(got[valid:], 0)
