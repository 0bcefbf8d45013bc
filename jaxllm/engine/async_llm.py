"""AsyncLLM: the server's frontend to an engine core running in its own process.

Tokenizing, detokenizing and everything user-facing happen here, in the server's
event loop; the core process only schedules and runs the model. Each request gets an
async stream of RequestOutputs. Closing a stream before it finished (a client that
disconnected) aborts the request in the core at once, freeing its KV blocks. If the
core dies, every open stream ends with EngineDeadError and `is_healthy()` turns false;
so it does when the core has work but has sent nothing for `hang_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxllm.engine import serialization as wire
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.core_client import DEAD, CoreClient
from jaxllm.engine.dp_client import DataParallelClient
from jaxllm.engine.input_processor import InputProcessor, Prompt
from jaxllm.engine.output_processor import OutputProcessor, RequestOutputKind, core_requests
from jaxllm.engine.protocol import EngineCoreReady, LoRAUpdate, UtilityCall, UtilityResult
from jaxllm.lora.request import LoRARequest
from jaxllm.messages import EngineCoreOutputs, ImageInput, SchedulerStats
from jaxllm.metrics import EngineMetrics
from jaxllm.multimodal.inputs import MultiModalProcessor
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine core process is gone; the request cannot finish."""


class CoreBusy(RuntimeError):
    """An engine core utility refused to run while requests are in flight."""


class RequestRejected(ValueError):
    """The engine core refused the request (it failed validation there)."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: CoreClient | DataParallelClient, ready: EngineCoreReady, model_name: str,
                 hang_timeout: float) -> None:
        from transformers import PreTrainedTokenizerFast

        self.config = config
        self.client = client
        self.ready = ready
        self.model_name = model_name
        self.hang_timeout = hang_timeout
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(ready.tokenizer_dir)
        shutil.rmtree(ready.tokenizer_dir, ignore_errors=True)  # the core's hand-over copy, now loaded
        multimodal = None if ready.vision is None else MultiModalProcessor(
            ready.vision, ready.image_processor, self.tokenizer, ready.images_per_prompt)
        self.input_processor = InputProcessor(self.tokenizer, eos_token_id=ready.eos_token_id,
                                              vocab_size=ready.vocab_size, max_model_len=ready.max_model_len,
                                              multimodal=multimodal)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self.metrics = EngineMetrics(model_name, ready.block_size, ready.max_model_len, ready.num_blocks,
                                     config.max_loras if config.enable_lora else 0)
        self.stats = SchedulerStats()
        self.dead_reason: str | None = None
        self.core_died = asyncio.Event()  # set when the core process fails or exits on its own
        self._streams: dict[str, asyncio.Queue] = {}
        self._lora_ops: dict[int, tuple[asyncio.Future, list[str | None]]] = {}  # op id -> (done, replies so far)
        self._calls: dict[int, tuple[asyncio.Future, list[UtilityResult]]] = {}  # call_core's, the same way
        self._next_op = 0
        self._loop = asyncio.get_running_loop()
        self._last_heard = time.monotonic()
        client.start(lambda kind, payload: self._loop.call_soon_threadsafe(self._on_core_message, kind, payload))

    @classmethod
    async def start(cls, config: EngineConfig, model_name: str, hang_timeout: float = 60.0) -> AsyncLLM:
        local_one = config.data_parallel_size == 1 and config.data_parallel_backend == "mp"
        client = CoreClient(config) if local_one else DataParallelClient(config)
        try:
            ready = await asyncio.get_running_loop().run_in_executor(None, client.wait_ready)
        except BaseException:
            client.shutdown(timeout=1)
            raise
        return cls(config, client, ready, model_name, hang_timeout)

    # ---------------------------------------------------------------- health

    @property
    def num_unfinished_sequences(self) -> int:
        """Sequences the engine holds or will: an n > 1 request counts n."""
        return self.output_processor.get_num_unfinished_requests()

    def is_healthy(self) -> bool:
        if self.dead_reason is not None or not self.client.is_alive():
            return False
        # the core sends something after every step, and a heartbeat every second when
        # idle: silence means it is hung (or stopped), busy or not
        return time.monotonic() - self._last_heard <= self.hang_timeout

    # ------------------------------------------------------------- requests

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        *,
        add_special_tokens: bool = True,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Stream the request's outputs (under `lora_request`'s adapter; a pooling
        request's one PoolingRequestOutput); ValueError before anything is queued if
        the request is invalid, EngineDeadError if the core dies meanwhile.
        `cache_salt`: the request shares prefix-cache blocks only with requests of the
        same salt (tenant isolation). `priority`: lower runs first (the priority
        scheduling policy; another is refused under fcfs). `images`: a vision-language
        model's, of token ids prepared by `input_processor.with_images`."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        request, text = self.input_processor.make_request(request_id, prompt, params, lora_request=lora_request,
                                                          add_special_tokens=add_special_tokens,
                                                          cache_salt=cache_salt, priority=priority, images=images)
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        children, parent = core_requests(request)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        for index, child in enumerate(children):
            self.output_processor.add_request(child, text, output_kind, parent=parent, index=index)
        self.client.send(wire.ADD, children)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id, [c.request_id for c in children])

    def abort(self, request_id: str, core_ids: list[str]) -> None:
        """Stop tracking a request and abort its core requests."""
        self.output_processor.abort_requests([request_id])
        self.metrics.observe_iteration(self.output_processor.take_stats())
        if self.dead_reason is None:
            self.client.send(wire.ABORT, core_ids)

    # ------------------------------------------------------------ adapters

    async def add_lora(self, lora: LoRARequest) -> None:
        """Have every engine core read and check an adapter; ValueError with the
        reason if one cannot serve it."""
        await self._update_lora(add=lora)

    async def remove_lora(self, lora_int_id: int) -> None:
        await self._update_lora(remove=lora_int_id)

    async def _update_lora(self, **change) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        op_id, self._next_op = self._next_op, self._next_op + 1
        done = self._loop.create_future()
        self._lora_ops[op_id] = (done, [])
        self.client.send(wire.LORA, LoRAUpdate(op_id, **change))
        try:
            error = await done
        finally:
            self._lora_ops.pop(op_id, None)
        if error is not None:
            raise ValueError(error)

    async def call_core(self, method: str, *args):
        """Run an engine core utility (protocol.CORE_UTILITIES) in every replica; the
        first replica's value. CoreBusy if requests were in flight, ValueError with the
        reason if it failed."""
        return (await self._call_every_core(method, *args))[0]

    async def _call_every_core(self, method: str, *args) -> list:
        """call_core's: every replica's value."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        op_id, self._next_op = self._next_op, self._next_op + 1
        done = self._loop.create_future()
        self._calls[op_id] = (done, [])
        self.client.send(wire.UTILITY, UtilityCall(op_id, method, list(args)))
        try:
            results: list[UtilityResult] = await done
        finally:
            self._calls.pop(op_id, None)
        failed = next((r for r in results if r.error is not None), None)
        if failed is not None:
            raise (CoreBusy if failed.busy else ValueError)(failed.error)
        return [r.value for r in results]

    # ---------------------------------------------------------------- pause

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True,
                               poll_seconds: float = 0.02) -> None:
        """Hold generation until resume_generation() (vLLM's), in every replica: new
        requests wait; those in flight are aborted (their streams end with
        finish_reason abort), finished first ("wait": this returns once they have) or
        kept to go on after resume ("keep"). `clear_cache`: the prefix cache is emptied
        and kept requests are recomputed after resume."""
        await self._call_every_core("pause", mode, clear_cache)
        while mode == "wait" and not all(await self._call_every_core("is_drained")):
            await asyncio.sleep(poll_seconds)

    async def resume_generation(self) -> None:
        await self._call_every_core("resume")

    async def is_paused(self) -> bool:
        return any(await self._call_every_core("is_paused"))

    def _on_utility_result(self, result: UtilityResult) -> None:
        call = self._calls.get(result.op_id)
        if call is None:
            return
        done, replies = call
        replies.append(result)
        if len(replies) == self.client.num_replicas and not done.done():
            done.set_result(replies)

    def _on_lora_result(self, op_id: int, error: str | None) -> None:
        """One engine core's answer; the update is done when every replica answered."""
        op = self._lora_ops.get(op_id)
        if op is None:
            return
        done, replies = op
        replies.append(error)
        if len(replies) == self.client.num_replicas and not done.done():
            done.set_result(next((e for e in replies if e is not None), None))

    # ------------------------------------------------------- core messages

    def _on_core_message(self, kind: str, payload: Any) -> None:
        self._last_heard = time.monotonic()
        if kind == wire.OUTPUTS:
            self._on_outputs(payload)
        elif kind == wire.REJECTED:
            state = self.output_processor.request_states.get(payload.request_id)
            request_id = state.parent.request_id if state and state.parent else payload.request_id
            self.output_processor.abort_requests([request_id])
            self.metrics.observe_iteration(self.output_processor.take_stats())
            self._deliver(request_id, RequestRejected(payload.message))
        elif kind == wire.LORA_RESULT:
            self._on_lora_result(payload.op_id, payload.error)
        elif kind == wire.UTILITY_RESULT:
            self._on_utility_result(payload)
        elif kind in (wire.FATAL, DEAD) and self.dead_reason is None:
            self.dead_reason = f"engine core died: {payload}" if payload else "engine core process exited"
            for stream in self._streams.values():
                stream.put_nowait(EngineDeadError(self.dead_reason))
            for done, _ in [*self._lora_ops.values(), *self._calls.values()]:
                if not done.done():
                    done.set_exception(EngineDeadError(self.dead_reason))
            self.core_died.set()

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self.stats = outputs.stats
            self.metrics.observe_stats(outputs.stats, outputs.replica_stats, outputs.replica_report_ages)
        self.metrics.observe_step(outputs.engine_index, outputs.step_tokens)
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.engine_index)
        self.metrics.observe_iteration(self.output_processor.take_stats())
        if processed.reqs_to_abort:
            self.client.send(wire.ABORT, processed.reqs_to_abort)
        for output in processed.request_outputs:
            self._deliver(output.request_id, output)

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    # -------------------------------------------------------------- shutdown

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is still in flight and stop the core process (idempotent)."""
        if self.dead_reason is None:
            self.dead_reason = "server shutting down"
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(self.dead_reason))
        await self._loop.run_in_executor(None, self.client.shutdown, timeout)

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self.ready) | {"model": self.model_name}
