"""The host's side of a step (issue 57): the step's inputs travel as one packed buffer,
and a decoding step moves nothing between host and device but that buffer in and the
sampled tokens out; async scheduling is on by default and off where it cannot overlap."""

import dataclasses
import logging

import jax
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.engine.config import EngineConfig
from jaxllm.messages import EngineCoreRequest
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.worker.packing import PackLayout
from jaxllm.worker.step import SEPARATE_INPUTS, StepInputs
from tests.support.llm import make_llm


def _random_inputs(rng, t=8, s=4, mb=5, w=3, groups=1) -> StepInputs:
    i32 = lambda *shape: rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int64).astype(np.int32)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    b = lambda *shape: rng.random(shape) < 0.5
    attn = tuple(AttentionMetadata(i32(t), i32(s, mb), i32(s), i32(s + 1), np.int32(3), np.int32(1))
                 for _ in range(groups))
    sampling = SamplingMetadata(
        temperature=f32(s), top_k=i32(s), top_p=f32(s), min_p=f32(s), presence_penalty=f32(s),
        frequency_penalty=f32(s), repetition_penalty=f32(s),
        seeds=rng.integers(0, 2**32, (s, 2), dtype=np.uint64).astype(np.uint32), output_index=i32(s),
        bias_token_ids=i32(s, 6), bias_values=np.where(b(s, 6), -np.inf, f32(s, 6)).astype(np.float32),
        history_rows=i32(s), num_prompt_tokens=i32(s), num_known_tokens=i32(s), token_bitmask=i32(s, w),
        all_greedy=np.bool_(True), any_top_k_top_p=np.bool_(False), any_min_p=np.bool_(True),
        any_penalties=np.bool_(False), any_logprobs=np.bool_(True), any_token_bitmask=np.bool_(False),
        any_logit_bias=np.bool_(True), any_beam=np.bool_(False))
    return StepInputs(input_ids=i32(t), positions=i32(t), history_rows=i32(t), from_history=b(t),
                      attn=attn[0] if groups == 1 else attn, logits_indices=i32(s), sampled_history_rows=i32(s),
                      num_logit_rows=np.int32(2), sampling=sampling, prompt_logprob_targets=i32(t),
                      any_prompt_logprobs=np.bool_(True), lora_slots=i32(t))


@pytest.mark.parametrize("groups", [1, 3])
def test_packed_inputs_unpack_to_the_same_bits(groups):
    """Every leaf (int32, uint32 seeds, float32 with infinities, bools, scalars) comes
    back from the one int32 buffer bit for bit, inside a jitted function; the token
    bitmask is passed beside it, not packed. Each leaf starts on a 256-byte boundary
    (Mosaic GPU refuses an operand that does not, and XLA passes a slice as a view)."""
    inputs = _random_inputs(np.random.default_rng(groups), groups=groups)
    layout = PackLayout.of(inputs, SEPARATE_INPUTS)
    packed, separate = layout.pack(inputs)
    assert packed.dtype == np.int32 and packed.ndim == 1 and len(separate) == 1
    np.testing.assert_array_equal(separate[0], inputs.sampling.token_bitmask)
    sizes = [np.size(x) for x in jax.tree.leaves(inputs) if x is not inputs.sampling.token_bitmask]
    assert layout.size == sum(-(-n // 64) * 64 for n in sizes)
    assert all(slot.offset % 64 == 0 for slot in layout.slots if slot is not None)
    back = jax.jit(lambda p, m: layout.unpack(p, (m,)))(packed, *separate)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(inputs), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))  # bits
    # the layout is fixed by shapes alone: abstract inputs give the same one
    assert PackLayout.of(jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), inputs),
                         SEPARATE_INPUTS) == layout


def test_a_leaf_of_another_dtype_is_refused():
    inputs = dataclasses.replace(_random_inputs(np.random.default_rng(0)), input_ids=np.zeros(8, np.int64))
    with pytest.raises(TypeError, match="input_ids.*int64"):
        PackLayout.of(inputs)


@pytest.mark.parametrize("num_steps", [1, 4])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_steps_transfer_only_the_packed_inputs_and_the_tokens(test_models_dir, async_scheduling, num_steps):
    """Once every request decodes, steps run under jax.transfer_guard('disallow'): an
    host-to-device transfer anywhere but the step call's packed inputs (a numpy array
    handed to another jitted function, a block copy, a history row) raises, and so does a
    read-back but the sampled ids'. On a CPU a read-back shares host memory and is no
    transfer, so there this guards the inputs' side; a GPU run guards both. The same
    for calls of several decode steps (multi-step decode)."""
    llm = make_llm(test_models_dir, async_scheduling=async_scheduling, num_scheduler_steps=num_steps)
    core = llm.llm_engine.core
    params = SamplingParams(max_tokens=200, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    core.add_requests([EngineCoreRequest(f"r{i}", [3 + i, 5, 7, 11, 13], params, None, 0.0) for i in range(4)])
    for _ in range(3):  # prompts done, async pipeline full
        core.step()
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.requests.values())
    with jax.transfer_guard("disallow"):
        outputs = [core.step() for _ in range(8)]
    assert sum(len(o.new_token_ids) for out in outputs for o in out.outputs) == 8 * 4 * num_steps


def test_async_scheduling_is_on_by_default_and_off_where_it_cannot_overlap(test_models_dir, caplog):
    assert EngineConfig().async_scheduling is None and EngineConfig().runs_async
    assert not EngineConfig(async_scheduling=False).runs_async
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert not EngineConfig(speculative_config=spec).runs_async
    assert "speculative_config" in EngineConfig(speculative_config=spec).async_scheduling_blocked
    with pytest.raises(ValueError, match="async_scheduling: not with speculative_config"):
        EngineConfig(speculative_config=spec, async_scheduling=True)
    assert make_llm(test_models_dir).llm_engine.core.runner.async_scheduling
    with caplog.at_level(logging.INFO, logger="jaxllm.engine.core"):
        llm = make_llm(test_models_dir, speculative_config=spec)
    assert not llm.llm_engine.core.runner.async_scheduling
    assert "async scheduling off: speculative_config" in caplog.text
