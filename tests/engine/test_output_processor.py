"""OutputProcessor: output kinds, stop strings and finishes, n > 1 aggregation, logprobs,
prompt logprobs over prefill chunks, metrics and abort."""

from __future__ import annotations

import time

import pytest

from jaxllm.engine.output_processor import OutputProcessor, ParentRequest, RequestOutputKind, fan_out
from jaxllm.loaders.hf import load_hf_tokenizer
from jaxllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from jaxllm.outputs import Logprob
from jaxllm.sampling_params import SamplingParams

EOS = 2  # <|im_end|>
FOX = "The quick brown fox jumps over the lazy dog."
FOX_PIECES = [
    "The", " qu", "ick", " brow", "n", " fox", " ju", "mp", "s", " over", " the", " laz", "y", " do", "g", "."
]
DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tokenizer(test_models_dir):
    return load_hf_tokenizer(test_models_dir / "llama")


@pytest.fixture(scope="module")
def fox_ids(tokenizer):
    ids = tokenizer.encode(FOX, add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == FOX_PIECES
    return ids


def make_request(request_id: str, prompt_token_ids: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt_token_ids, SamplingParams(**params), EOS, time.monotonic())


def out(request_id: str, token_ids: list[int], finish: FinishReason | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, token_ids, finish_reason=finish, **kw)


def run(processor: OutputProcessor, request_id: str, ids: list[int], finish=FinishReason.LENGTH):
    """Feed ids one per step, the last with `finish`; all RequestOutputs produced."""
    outputs = []
    for k, token_id in enumerate(ids):
        last = k == len(ids) - 1
        processed = processor.process_outputs([out(request_id, [token_id], finish if last else None)])
        assert processed.reqs_to_abort == []
        outputs += processed.request_outputs
    return outputs


# ------------------------------------------------------------------ kinds


def test_delta_outputs_hold_only_what_is_new(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1, 5]), "prompt", DELTA)
    outputs = run(processor, "r", fox_ids)
    assert [o.outputs[0].text for o in outputs] == FOX_PIECES
    assert [o.outputs[0].token_ids for o in outputs] == [[i] for i in fox_ids]
    assert [o.finished for o in outputs] == [False] * (len(fox_ids) - 1) + [True]
    assert [o.outputs[0].finish_reason for o in outputs][-2:] == [None, "length"]
    assert all(o.request_id == "r" and o.prompt == "prompt" and o.prompt_token_ids == [1, 5] for o in outputs)
    assert not processor.has_unfinished_requests()


def test_cumulative_outputs_hold_everything_so_far(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1]), None, CUMULATIVE)
    outputs = run(processor, "r", fox_ids)
    assert [o.outputs[0].text for o in outputs] == ["".join(FOX_PIECES[: k + 1]) for k in range(len(fox_ids))]
    assert [o.outputs[0].token_ids for o in outputs] == [fox_ids[: k + 1] for k in range(len(fox_ids))]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_final_only_gives_one_output(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1]), None, FINAL_ONLY)
    outputs = run(processor, "r", fox_ids)
    assert len(outputs) == 1
    (completion,) = outputs[0].outputs
    assert (completion.text, completion.token_ids, completion.finish_reason) == (FOX, fox_ids, "length")
    assert completion.cumulative_logprob is None and completion.logprobs is None


# ------------------------------------------------------------------ finish


def test_stop_string_finishes_and_asks_core_to_abort(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1], stop=["jumps"]), None, DELTA)
    texts = []
    for token_id in fox_ids[:8]:  # up to ' ju','mp': "ju", "jump" are held back
        processed = processor.process_outputs([out("r", [token_id])])
        assert processed.reqs_to_abort == []
        texts.append(processed.request_outputs[0].outputs[0].text)
    assert texts[-3:] == [" fox", " ", ""]
    processed = processor.process_outputs([out("r", [fox_ids[8]])])  # 's'
    assert processed.reqs_to_abort == ["r"]
    (request_output,) = processed.request_outputs
    completion = request_output.outputs[0]
    assert request_output.finished
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("", "stop", "jumps")
    assert "".join(texts) == "The quick brown fox "
    assert not processor.has_unfinished_requests()
    # The core's outputs for it that were already under way are ignored.
    later = processor.process_outputs([out("r", [fox_ids[9]]), out("r", [], FinishReason.ABORT)])
    assert later.request_outputs == [] and later.reqs_to_abort == []


def test_stop_string_on_the_cores_last_token(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1], stop=["n f"], include_stop_str_in_output=True), None, FINAL_ONLY)
    processed = processor.process_outputs([out("r", fox_ids[:6], FinishReason.LENGTH)])
    assert processed.reqs_to_abort == []  # the core has finished it already
    completion = processed.request_outputs[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("The quick brown f", "stop", "n f")
    assert completion.token_ids == fox_ids[:6]


@pytest.mark.parametrize("skip", [True, False])
def test_eos_is_not_in_the_text(tokenizer, fox_ids, skip):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1], skip_special_tokens=skip), None, FINAL_ONLY)
    outputs = run(processor, "r", [*fox_ids, EOS], finish=FinishReason.STOP)
    completion = outputs[0].outputs[0]
    assert (completion.text, completion.token_ids) == (FOX, [*fox_ids, EOS])
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)


def test_abort_flushes_held_back_text(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("a", [1], stop=["brown cow"]), None, DELTA)
    processor.add_request(make_request("b", [1]), None, FINAL_ONLY)
    processed = processor.process_outputs([out("a", fox_ids[:4]), out("b", fox_ids[:2])])
    assert [o.outputs[0].text for o in processed.request_outputs] == ["The quick "]  # "brow" held
    assert processor.get_num_unfinished_requests() == 2
    aborted = processor.abort_requests(["a", "b", "unknown"])
    assert [(o.request_id, o.finished) for o in aborted] == [("a", True), ("b", True)]
    assert [o.outputs[0].text for o in aborted] == ["brow", "The qu"]
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort", "abort"]
    assert processor.abort_requests(["a"]) == []
    assert not processor.has_unfinished_requests()


def test_metrics_and_cached_tokens(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    request = make_request("r", [1, 5, 7])
    processor.add_request(request, None, CUMULATIVE)
    assert processor.process_outputs([out("r", [], num_cached_tokens=2)]).request_outputs == []
    first = processor.process_outputs([out("r", fox_ids[:1], num_cached_tokens=2)]).request_outputs[0]
    metrics = first.metrics
    assert first.num_cached_tokens == 2
    assert metrics.arrival_time == request.arrival_time <= metrics.first_token_time
    assert metrics.finished_time is None
    last = processor.process_outputs([out("r", fox_ids[1:2], FinishReason.LENGTH, num_cached_tokens=2)])
    assert last.request_outputs[0].metrics.first_token_time == metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time


# ------------------------------------------------------------------ n > 1


def test_fan_out():
    request = make_request("p", [1, 2], n=3, seed=7, prompt_logprobs=2, temperature=0.8)
    children = fan_out(request, 3)
    assert [c.request_id for c in children] == ["p-0", "p-1", "p-2"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    assert [c.sampling_params.n for c in children] == [1, 1, 1]
    assert [c.sampling_params.prompt_logprobs for c in children] == [2, None, None]
    assert all(c.sampling_params.temperature == 0.8 and c.prompt_token_ids == [1, 2] for c in children)
    assert request.sampling_params.n == 3  # the parent's params are untouched
    unseeded = fan_out(make_request("q", [1], n=2), 2)
    assert [c.sampling_params.seed for c in unseeded] == [None, None]


def add_parent(processor: OutputProcessor, kind: RequestOutputKind, n: int = 2) -> list[str]:
    request = make_request("p", [1, 9], n=n, max_tokens=20)
    parent = ParentRequest.from_request(request)
    children = fan_out(request, n)
    for i, child in enumerate(children):
        processor.add_request(child, "a prompt", kind, parent=parent, index=i)
    return [c.request_id for c in children]


def test_n2_delta_streams_each_child_under_the_parent_id(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    c0, c1 = add_parent(processor, DELTA)
    steps = [
        [out(c0, fox_ids[0:1]), out(c1, fox_ids[5:6])],
        [out(c1, fox_ids[6:7], FinishReason.LENGTH), out(c0, fox_ids[1:2])],
        [out(c0, fox_ids[2:3], FinishReason.LENGTH)],
    ]
    outputs = [o for step in steps for o in processor.process_outputs(step).request_outputs]
    assert all(o.request_id == "p" and len(o.outputs) == 1 for o in outputs)
    seen = [(o.outputs[0].index, o.outputs[0].text, o.outputs[0].finish_reason, o.finished) for o in outputs]
    assert seen == [
        (0, "The", None, False),
        (1, " fox", None, False),
        (1, " ju", "length", False),
        (0, " qu", None, False),
        (0, "ick", "length", True),
    ]
    assert not processor.has_unfinished_requests()


def test_n2_final_only_aggregates_sorted_by_index(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    c0, c1 = add_parent(processor, FINAL_ONLY)
    first = processor.process_outputs([out(c0, fox_ids[:2]), out(c1, fox_ids[5:7], FinishReason.LENGTH)])
    assert first.request_outputs == []
    assert processor.get_num_unfinished_requests() == 1
    # Child 0 ends on a stop token ('ick'), whose text is left out.
    last = processor.process_outputs([out(c0, fox_ids[2:3], FinishReason.STOP, stop_reason=fox_ids[2])])
    (final,) = last.request_outputs
    assert final.request_id == "p" and final.finished and final.prompt == "a prompt"
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in final.outputs] == [
        (0, "The qu", fox_ids[:3], "stop"),
        (1, " fox ju", fox_ids[5:7], "length"),
    ]
    assert final.outputs[0].stop_reason == fox_ids[2]


def test_n2_cumulative_holds_every_childs_latest(tokenizer, fox_ids):
    processor = OutputProcessor(tokenizer)
    c0, c1 = add_parent(processor, CUMULATIVE)
    first = processor.process_outputs([out(c1, fox_ids[5:6])]).request_outputs
    assert [[(c.index, c.text) for c in o.outputs] for o in first] == [[(1, " fox")]]
    step = [out(c0, fox_ids[:1], FinishReason.LENGTH), out(c1, fox_ids[6:7])]
    outputs = processor.process_outputs(step).request_outputs
    assert [[(c.index, c.text) for c in o.outputs] for o in outputs] == [
        [(0, "The"), (1, " fox")],
        [(0, "The"), (1, " fox ju")],
    ]
    assert [o.finished for o in outputs] == [False, False]
    (last,) = processor.process_outputs([out(c1, fox_ids[7:8], FinishReason.LENGTH)]).request_outputs
    assert last.finished and [c.text for c in last.outputs] == ["The", " fox jump"]


@pytest.mark.parametrize("kind", [DELTA, FINAL_ONLY])
def test_abort_parent_aborts_unfinished_children(tokenizer, fox_ids, kind):
    processor = OutputProcessor(tokenizer)
    c0, c1 = add_parent(processor, kind)
    processor.process_outputs([out(c0, fox_ids[:1], FinishReason.LENGTH), out(c1, fox_ids[1:2])])
    aborted = processor.abort_requests(["p"])
    if kind is DELTA:
        assert [(o.outputs[0].index, o.outputs[0].text, o.finished) for o in aborted] == [(1, "", True)]
    else:
        (final,) = aborted
        expected = [(0, "The", "length"), (1, " qu", "abort")]
        assert [(c.index, c.text, c.finish_reason) for c in final.outputs] == expected
    assert aborted[-1].outputs[-1].finish_reason == "abort"
    assert not processor.has_unfinished_requests() and processor.abort_requests(["p"]) == []


# ---------------------------------------------------------------- logprobs


def rows(*entries: tuple[list[int], list[float], int]) -> LogprobsLists:
    return LogprobsLists([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])


def test_sample_logprobs_and_cumulative_logprob(tokenizer, fox_ids):
    t0, t1, t2, t3 = fox_ids[:4]
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1], logprobs=2), None, DELTA)
    # Row: the sampled token, then the top alternatives (padded to 3 for another request).
    first = rows(([t0, t1, t0, t2], [-0.75, -0.5, -0.75, -2.0], 2))
    second = rows(([t3, t3, t2, t1], [-0.25, -0.25, -1.5, -3.0], 1))
    (o1,) = processor.process_outputs([out("r", [t0], new_logprobs=first)]).request_outputs
    (o2,) = processor.process_outputs([out("r", [t3], FinishReason.LENGTH, new_logprobs=second)]).request_outputs
    text = {t: tokenizer.decode([t]) for t in (t0, t1, t2, t3)}
    assert o1.outputs[0].logprobs == [{t0: Logprob(-0.75, 2, text[t0]), t1: Logprob(-0.5, 1, text[t1])}]
    assert o2.outputs[0].logprobs == [{t3: Logprob(-0.25, 1, text[t3]), t2: Logprob(-1.5, 2, text[t2])}]
    assert o1.outputs[0].cumulative_logprob == -0.75
    assert o2.outputs[0].cumulative_logprob == -1.0


def test_logprobs_zero_gives_the_sampled_token_only_cumulative_keeps_all(tokenizer, fox_ids):
    t0, t1 = fox_ids[:2]
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1], logprobs=0, detokenize=False), None, CUMULATIVE)
    processor.process_outputs([out("r", [t0], new_logprobs=rows(([t0, t1], [-1.0, -0.5], 2)))])
    (o,) = processor.process_outputs(
        [out("r", [t1], FinishReason.LENGTH, new_logprobs=rows(([t1, t1], [-0.5, -0.5], 1)))]
    ).request_outputs
    assert o.outputs[0].logprobs == [{t0: Logprob(-1.0, 2, None)}, {t1: Logprob(-0.5, 1, None)}]
    assert o.outputs[0].cumulative_logprob == -1.5
    assert o.outputs[0].text == ""


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_prompt_logprobs_accumulate_over_chunks(tokenizer, fox_ids, kind):
    prompt = fox_ids[:5]
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", prompt, prompt_logprobs=1), None, kind)

    def row(k: int) -> tuple[list[int], list[float], int]:  # position k scores prompt[k]
        return [prompt[k], fox_ids[9]], [-float(k), -0.1], k + 1

    chunk1 = processor.process_outputs([out("r", [], new_prompt_logprobs=rows(row(1), row(2)))])
    chunk2 = processor.process_outputs([out("r", [fox_ids[5]], new_prompt_logprobs=rows(row(3), row(4)))])
    later = processor.process_outputs([out("r", [fox_ids[6]], FinishReason.LENGTH)])
    assert chunk1.request_outputs == []
    expected = [None] + [
        {prompt[k]: Logprob(-float(k), k + 1, FOX_PIECES[k]), fox_ids[9]: Logprob(-0.1, 1, " over")}
        for k in (1, 2, 3, 4)
    ]
    assert chunk2.request_outputs[0].prompt_logprobs == expected
    assert later.request_outputs[0].prompt_logprobs == (None if kind is DELTA else expected)
    assert later.request_outputs[0].outputs[0].logprobs is None
