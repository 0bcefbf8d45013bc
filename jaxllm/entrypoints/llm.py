"""The offline API: `LLM(...).generate(prompts, sampling_params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jaxllm.engine.config import EngineConfig
from jaxllm.engine.input_processor import Message, Prompt
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams


class LLM:
    """An engine in this process. `model=None` is the embedded SmolLM2-135M-Instruct.

    Options are EngineConfig's fields (dtype, quantization, max_model_len, block_size,
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    seed, attention_backend, linear_backend, chat_template, compilation_cache_dir,
    tensor_parallel_size, and coordinator_address / num_processes / process_id for an
    engine over several processes; data_parallel_size is the server's).
    """

    def __init__(self, model: str | None = None, *, progress: bool = True, **options) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **options), progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for a prompt (string or token ids) or a list of them; outputs come
        back in the order of the prompts."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, add_special_tokens=True)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the
        model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = self.llm_engine.input_processor.render_chat
        prompts = [render(c, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
                   for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm: bool, add_special_tokens: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts"
            )
        ids = [str(next(self._ids)) for _ in prompts]
        engine = self.llm_engine
        engine.add_requests(list(zip(ids, prompts, sampling_params)), add_special_tokens=add_special_tokens)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", disable=not use_tqdm, unit="req") as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]
