"""The runner's input building on its own (jaxllm.worker.input_builder): numpy from the
rows' host state, nothing compiled. Token positions, KV slots, query offsets and sample
rows of a mixed step, and a multi-step decode call's limits."""

import numpy as np

from jaxllm import SamplingParams
from jaxllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.kv_cache_groups import kv_cache_groups
from jaxllm.worker.buckets import StepShape, StepShapes
from jaxllm.worker.decode_loop import LoopInputs
from jaxllm.worker.input_batch import STOP_WIDTH, InputBatch
from jaxllm.worker.input_builder import InputBuilder
from jaxllm.worker.step import StepInputs

BLOCK = 4


def _builder(decode_steps: int = 1) -> InputBuilder:
    batch = InputBatch(4, 64, 16)
    return InputBuilder(batch, StepShapes.make(32, 4, decode_steps=decode_steps), kv_cache_groups([None, None]),
                        block_size=BLOCK, max_model_len=64, async_scheduling=False, with_lora=False,
                        bitmask_width=2, num_scheduler_steps=decode_steps)


def _new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0, **params) -> NewRequestData:
    return NewRequestData(req_id, tokens, len(tokens), SamplingParams(**params), seed=1, eos_token_id=2,
                          block_ids=(blocks,), num_computed_tokens=computed)


def _sched(new=(), cached=(), tokens=None, decode_steps=None) -> SchedulerOutput:
    return SchedulerOutput(list(new), list(cached), tokens, sum(tokens.values()), set(), set(),
                           decode_steps=decode_steps or {})


def test_a_prompt_chunk_and_a_decode():
    b = _builder()
    # "a": a 6-token prompt, 4 computed (a prefix hit), its last 2 this step; "b": decoding at position 5
    a = _new("a", [3, 4, 5, 6, 7, 8], [1, 2], computed=4)
    b.input_batch.add_request(_new("b", [10, 11, 12, 13, 14, 15], [7, 8], computed=5))
    b.input_batch.add_request(a)  # (the runner adds a step's new requests before preparing it)
    step = b.prepare_step(_sched([a], [], {"b": 1, "a": 2}))
    host = step.host
    np.testing.assert_array_equal(host.positions, [5, 4, 5])
    np.testing.assert_array_equal(host.qsl, [0, 1, 3])
    np.testing.assert_array_equal(host.seq_lens, [6, 6])
    np.testing.assert_array_equal(host.slots[0], [8 * BLOCK + 1, 2 * BLOCK + 0, 2 * BLOCK + 1])
    np.testing.assert_array_equal(host.input_ids, [15, 7, 8])
    np.testing.assert_array_equal(host.logit_rows, [0, 2])  # each row's last token
    assert step.shape == StepShape(4, 4, 4) and isinstance(step.inputs, StepInputs)
    assert step.inputs.input_ids.shape == (4,) and step.inputs.attn.block_tables.shape == (4, 16)


def test_a_decode_loop_carries_its_limits():
    b = _builder(decode_steps=4)
    for i, stops in enumerate(([], list(range(100, 100 + STOP_WIDTH + 3)))):
        b.input_batch.add_request(_new(f"r{i}", [3, 4, 5, 6, 7], [1 + 2 * i, 2 + 2 * i], computed=4,
                                       stop_token_ids=stops, min_tokens=3 * i))
    step = b.prepare_step(_sched([], [CachedRequestData("r0", ([],), 4), CachedRequestData("r1", ([],), 4)],
                                 {"r0": 1, "r1": 1}, decode_steps={"r0": 4, "r1": 2}))
    assert step.shape == StepShape(4, 4, 4, 4) and isinstance(step.inputs, LoopInputs)
    limits = step.inputs.limits
    np.testing.assert_array_equal(limits.max_steps, [4, 2, 0, 0])
    np.testing.assert_array_equal(limits.min_tokens, [0, 3, 0, 0])
    assert limits.num_steps == 4
    assert limits.stop_token_ids[0].tolist() == [2] + [-1] * (STOP_WIDTH - 1)  # EOS
    assert limits.stop_token_ids[1].tolist() == [2] + list(range(100, 100 + STOP_WIDTH - 1))  # EOS, then the first
