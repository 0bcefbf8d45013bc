"""The offline API: `LLM(...).generate(prompts, sampling_params)`, `.chat(...)`,
`.beam_search(...)`; for a pooling model `.embed(...)`, `.encode(...)`, `.score(...)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from jaxllm.engine.config import EngineConfig
from jaxllm.engine.input_processor import Message, Prompt
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.entrypoints.scoring import cosine, score_pairs
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """An engine in this process. `model=None` is the embedded SmolLM2-135M-Instruct.

    Options are EngineConfig's fields (dtype, quantization, max_model_len, block_size,
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    async_scheduling, seed, attention_backend, linear_backend, chat_template, compilation_cache_dir,
    tensor_parallel_size, pipeline_parallel_size, enable_lora / max_loras / max_lora_rank /
    max_cpu_loras, and distributed_executor_backend="ray" with num_processes for an
    engine over several hosts; data_parallel_size is the server's).
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for a prompt (string or token ids) or a list of them; outputs come
        back in the order of the prompts. `lora_request`: the adapter every prompt runs
        under, or one (or None: the base model) per prompt (enable_lora)."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, add_special_tokens=True, lora_request=lora_request)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the
        model's chat template (`chat_template_kwargs`: its own variables, e.g. Qwen3's
        enable_thinking). A vision-language model reads `image_url` parts (base64 data
        URLs) and `image_pil` parts (PIL images) too."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompt = self.llm_engine.input_processor.chat_prompt
        prompts = [prompt(c, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                          chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Prompt | Message | Sequence[Prompt] | Sequence[list[Message]],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` most likely sequences of each prompt, best first
        (vLLM's `LLM.beam_search`). A prompt is text, token ids, or a conversation
        (a list of chat messages, rendered with the model's chat template). The beams
        run in the engine: one request each, forking by copy-on-write KV blocks."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        if _is_one_prompt(prompts):
            prompts = [prompts]
        processor = self.llm_engine.input_processor
        inputs, rendered = [], []  # a conversation as its template's tokens (they carry their special tokens)
        for p in prompts:
            text = processor.render_chat(p) if _is_conversation(p) else None
            inputs.append(p if text is None else {"prompt_token_ids": processor.tokenize(text, False)[1]})
            rendered.append(text)
        outputs = self._run(inputs, params.to_sampling_params(), use_tqdm, add_special_tokens=True,
                            lora_request=lora_request)
        return [_beam_output(out, text) for out, text in zip(outputs, rendered)]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in their order (vLLM's
        `LLM.embed`; a pooling model: `runner="pooling"`, the default for an encoder).
        Normalized as the model's pooler says unless `PoolingParams(normalize=...)`;
        `dimensions` cuts a matryoshka model's; `truncate_prompt_tokens` keeps a long
        prompt's first tokens (-1: max_model_len) where it would be an error."""
        outputs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        pooling_task: str = "encode",
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """The pooled hidden states of each prompt (vLLM's `LLM.encode`):
        `outputs.data`, a float32 array, the pooler's vector not normalized
        (`pooling_task` "encode"), the embedding ("embed"), or one per token
        ("token_embed", a model served with pooling_type ALL)."""
        return self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The similarity of text pairs (vLLM's `LLM.score` of an embedding model: the
        cosine of their embeddings): one text against each of `data_2`, or
        `data_1[i]` against `data_2[i]`."""
        first, second = score_pairs(data_1, data_2, ("data_1", "data_2"))
        unique = list(dict.fromkeys(first + second))
        by_text = dict(zip(unique, self._pool(unique, None, "embed", truncate_prompt_tokens, use_tqdm), strict=True))
        return [ScoringRequestOutput(str(i), ScoringOutput(cosine(by_text[a].outputs.data, by_text[b].outputs.data)),
                                     by_text[a].prompt_token_ids + by_text[b].prompt_token_ids)
                for i, (a, b) in enumerate(zip(first, second, strict=True))]

    def _pool(self, prompts, pooling_params, task: str, truncate_prompt_tokens: int | None, use_tqdm: bool
              ) -> list[PoolingRequestOutput]:
        """Run prompts as pooling requests of `task` (each PoolingParams given keeps
        its own fields; `truncate_prompt_tokens` where it sets none)."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"pooling_params: {len(pooling_params)} given for {len(prompts)} prompts")
        params = []
        for p in pooling_params:
            p = p if p is not None else PoolingParams(task=task)
            if not isinstance(p, PoolingParams):
                raise ValueError(f"pooling_params: expected PoolingParams, got {type(p).__name__}")
            if truncate_prompt_tokens is not None and p.truncate_prompt_tokens is None:
                p = dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
            params.append(p)
        return self._run(prompts, params, use_tqdm, add_special_tokens=True, desc="embedding")

    def update_weights(self, weights) -> None:
        """New weights for this model, which the next calls use: its parameter tree
        (jaxllm.loaders.load_model(...).params, or a trainer's copy of it: the same
        shapes, the dtype the engine runs; arrays taken as they are where the engine
        multiplies them as given, linear_backend xla), that tree in the cpu backend's
        layout (jaxllm.models.linear.pack_params: taken as it is by an engine of that
        backend alone, batch_invariant's) or a mapping of its HF tensor
        names to arrays (numpy or jax). ValueError naming the first parameter that does
        not fit, with nothing applied. The prefix cache is emptied: no prompt reuses K/V
        computed with the old weights."""
        self.llm_engine.update_weights(weights)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> list[RequestOutput]:
        """Hold generation until resume_generation() (vLLM's; for a weight update in the
        middle of rollouts driven through llm_engine): the requests in flight are aborted,
        finished ("wait") or kept to go on after resume ("keep"); their outputs are
        returned. generate() refuses while paused."""
        return self.llm_engine.pause_generation(mode, clear_cache)

    def resume_generation(self) -> None:
        self.llm_engine.resume_generation()

    def is_paused(self) -> bool:
        return self.llm_engine.is_paused()

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back until wake_up (enable_sleep_mode=True): the KV
        cache is freed and the weights kept in host memory (level 1) or dropped (level
        2: update_weights brings the next ones). Nothing recompiles on waking."""
        self.llm_engine.core.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """The weights (after a level-1 sleep) and the KV cache back on the device; `tags`
        ("weights", "kv_cache") wakes one of them."""
        self.llm_engine.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.core.is_sleeping()

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter ahead of its requests (ValueError if it cannot be served)."""
        self.llm_engine.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.core.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.llm_engine.core.list_loras()

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm: bool, add_special_tokens: bool,
             lora_request=None, desc: str = "generating") -> list:
        """Run the prompts, one params each (SamplingParams, or PoolingParams for a
        pooling model); their finished outputs in order."""
        from tqdm import tqdm

        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, PoolingParams)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts"
            )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"lora_request: {len(lora_request)} given for {len(prompts)} prompts")
        if self.is_paused():
            raise RuntimeError("the engine is paused: resume_generation() first")
        ids = [str(next(self._ids)) for _ in prompts]
        engine = self.llm_engine
        engine.add_requests(list(zip(ids, prompts, sampling_params)), add_special_tokens=add_special_tokens,
                            lora_requests=list(lora_request))
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc=desc, disable=not use_tqdm, unit="req") as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]


def _beam_output(output: RequestOutput, rendered: str | None) -> BeamSearchOutput:
    """vLLM's shape of a beam search's result (`rendered`: a conversation's prompt text)."""
    prompt_ids, prompt = output.prompt_token_ids, output.prompt or rendered or ""
    return BeamSearchOutput([
        BeamSearchSequence(tokens=prompt_ids + c.token_ids, text=prompt + c.text, cum_logprob=c.cumulative_logprob,
                           output_token_ids=c.token_ids, output_text=c.text, finish_reason=c.finish_reason,
                           stop_reason=c.stop_reason)
        for c in output.outputs])


def _is_conversation(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def _is_one_prompt(prompts) -> bool:
    """A single prompt (text, token ids, {"prompt_token_ids": ...} or a conversation)
    rather than a list of them."""
    if isinstance(prompts, (str, dict)) or _is_conversation(prompts):
        return True
    return isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)

