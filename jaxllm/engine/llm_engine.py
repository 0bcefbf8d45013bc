"""LLMEngine: the in-process frontend around an EngineCore, for offline use.

Prompts go through the InputProcessor (tokenize, validate) into the core; core outputs
go through the OutputProcessor (detokenize, stop strings, n > 1 merging) back out as
RequestOutputs. A request that a stop string finishes is aborted in the core.
"""

from __future__ import annotations

from jaxllm.engine.config import EngineConfig
from jaxllm.engine.core import PAUSE_MODES, EngineCore, eos_token_id
from jaxllm.engine.input_processor import InputProcessor, Prompt
from jaxllm.engine.output_processor import OutputProcessor, ParentRequest, RequestOutputKind, core_requests
from jaxllm.lora.request import LoRARequest
from jaxllm.messages import EngineCoreOutputs, EngineCoreRequest
from jaxllm.multimodal.image_processor import ImageProcessorConfig
from jaxllm.multimodal.inputs import MultiModalProcessor
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        if config.data_parallel_size != 1:
            raise ValueError("data_parallel_size: data-parallel replicas are served by `python -m jaxllm.serve "
                             "--data-parallel-size N`; offline, run one LLM per group of devices")
        self.config = config
        self.core = EngineCore(config, progress=progress)
        self.tokenizer = self.core.model.tokenizer
        model = self.core.model
        self.input_processor = InputProcessor(
            self.tokenizer,
            eos_token_id=eos_token_id(self.tokenizer, model.config),
            vocab_size=model.config.vocab_size,
            max_model_len=self.core.max_model_len,
            multimodal=None if model.config.vision is None else MultiModalProcessor(
                model.config.vision, ImageProcessorConfig.from_folder(model.path), self.tokenizer,
                config.images_per_prompt),
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    def add_requests(
        self,
        items: list[tuple[str, Prompt, SamplingParams]],
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        add_special_tokens: bool = True,
        lora_requests: list[LoRARequest | None] | None = None,
    ) -> None:
        """Queue (request_id, prompt, params) items, each under its `lora_requests`
        adapter (None: the base model); all are validated first, so a ValueError
        leaves nothing queued."""
        prepared = []
        loras = lora_requests or [None] * len(items)
        for index, ((rid, prompt, params), lora) in enumerate(zip(items, loras, strict=True)):
            try:
                prepared.append(self.input_processor.make_request(
                    rid, prompt, params, add_special_tokens=add_special_tokens, lora_request=lora))
            except ValueError as e:  # the field stays first; say which request it was
                raise ValueError(f"{e} (request {index} of {len(items)})") from None
        children: list[tuple[EngineCoreRequest, str | None, ParentRequest | None, int]] = []
        for request, text in prepared:
            core, parent = core_requests(request)
            children += [(child, text, parent, i) for i, child in enumerate(core)]
        self.core.add_requests([child for child, _, _, _ in children])
        for child, text, parent, index in children:
            self.output_processor.add_request(child, text, output_kind, parent=parent, index=index)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        core_ids = []
        for rid in request_ids:
            parent = self.output_processor.parent_requests.get(rid)
            core_ids += parent.child_ids if parent is not None else [rid]
        outputs = self.output_processor.abort_requests(request_ids)
        self.core.abort_requests(core_ids)
        return outputs

    def step(self) -> list[RequestOutput]:
        """One engine step. If it fails, every request in flight is aborted (the call
        that was waiting for them gets the error) and the engine stays usable."""
        try:
            core_outputs = self.core.step()
        except Exception:
            self.abort_requests(self._tracked())
            raise
        return self._process(core_outputs)

    def _process(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> list[RequestOutput]:
        """Stop scheduling until resume_generation() (vLLM's pause_generation): requests
        added meanwhile wait; those in flight, by `mode`: "abort" ends them
        (finish_reason abort), "wait" runs them to their end here, "keep" holds them
        (they go on after resume). `clear_cache`: the prefix cache is emptied, and kept
        requests are recomputed after resume. Returns the outputs this produced
        (nothing is lost)."""
        outputs: list[RequestOutput] = []
        if mode == "abort":
            outputs += self.abort_requests(self._tracked())
        outputs += self._process(self.core.pause(mode, clear_cache))
        while self.core.has_work():  # "wait"
            outputs += self.step()
        return outputs

    def resume_generation(self) -> None:
        self.core.resume()

    def is_paused(self) -> bool:
        return self.core.is_paused()

    def update_weights(self, weights, mode: str = "abort") -> list[RequestOutput]:
        """New weights for the same model (EngineCore.update_weights says what they may
        be). What runs meanwhile, by `mode`: "abort" ends it with finish_reason abort,
        "wait" lets it finish on the old weights first, "keep" holds it and goes on
        with the new weights (each kept request recomputed from its tokens so far: its
        tokens before the update came from the old weights); the outputs come back
        here (nothing is lost). The engine schedules as before afterwards (unless it was
        paused already)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: unknown {mode!r}; choose one of {', '.join(PAUSE_MODES)}")
        was_paused = self.is_paused()
        outputs = self.pause_generation(mode)
        try:
            self.core.update_weights(weights)
        finally:
            if not was_paused:
                self.resume_generation()
        return outputs

    def _tracked(self) -> list[str]:
        """The user requests in flight (an n > 1 request by its parent's id)."""
        return list(self.output_processor.parent_requests) + [
            rid for rid, state in self.output_processor.request_states.items() if state.parent is None]

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()
