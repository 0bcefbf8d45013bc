"""entrypoints/openai/serving.py against a stand-in engine: what the HTTP layer makes of
engine outputs, without a server."""

import asyncio

from jaxllm.entrypoints.openai import serving
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams


class Engine:
    """Answers every request with one token "x"; remembers the request ids."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    async def generate(self, request_id, prompt_ids, params, output_kind):
        self.request_ids.append(request_id)
        yield RequestOutput(request_id, None, prompt_ids, [CompletionOutput(0, "x", [7], finish_reason="length")],
                            finished=True)


def test_one_id_from_the_engine_to_the_response():
    """The response's id is the one the engine ran the request under (its jobs' prefix),
    so logs, metrics and aborts name what the client saw."""
    engine = Engine()
    jobs = [serving.Job("cmpl-abc-0", [1, 2], "p", 0), serving.Job("cmpl-abc-1", [3], "q", 1)]
    shape = serving.CompletionShape(engine, echo=False, num_logprobs=None, num_prompt_logprobs=None)
    body = asyncio.run(serving.completions(engine, "cmpl-abc", jobs, SamplingParams(max_tokens=1), model="m",
                                           shape=shape, stream=False, include_usage=False))
    assert body["id"] == "cmpl-abc" and sorted(engine.request_ids) == ["cmpl-abc-0", "cmpl-abc-1"]
    assert [c["text"] for c in body["choices"]] == ["x", "x"]
    job = serving.Job("chatcmpl-def", [1], "p", 0)
    body = asyncio.run(serving.chat(engine, job, SamplingParams(max_tokens=1), model="m", stream=False,
                                    include_usage=False, num_top_logprobs=0))
    assert body["id"] == "chatcmpl-def" == engine.request_ids[-1]
