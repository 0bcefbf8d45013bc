"""The engine core: one scheduler and one model runner, stepped together.

It takes tokenized EngineCoreRequests and returns EngineCoreOutputs (token ids, not
text); the frontends around it (offline LLMEngine, the server's async client) do the
tokenizing and detokenizing. It sizes the KV cache from the memory budget, validates
max_model_len against the model and the pool, and compiles every bucket at start-up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.attention.kv_cache import KVCacheFormat, choose_kv_cache_format, kv_cache_format
from jaxllm.config import CHECKPOINT_METHODS, ModelConfig
from jaxllm.core.encoder_cache_manager import EncoderCacheManager
from jaxllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_DEVICE_MEMORY_FRACTION, EngineConfig, parse_memory
from jaxllm.engine.ray_executor import Placement, RayExecutor, initialize, wait_for_workers
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.loaders import LoadedModel, load_model, peek_model_config
from jaxllm.loaders.default_model import model_path
from jaxllm.loaders.dtype import choose_dtype
from jaxllm.loaders.hf import kv_cache_scales
from jaxllm.loaders.pooling import is_sentence_transformers, model_pooler
from jaxllm.loaders.weights import build_params
from jaxllm.lora.request import LoRARequest
from jaxllm.messages import EngineCoreOutputs, EngineCoreRequest
from jaxllm.models.linear import rounds_activations
from jaxllm.models.lora import lora_partition_specs
from jaxllm.models.parallel import check_tensor_parallel, shard_config
from jaxllm.models.params import ModelParams, abstract_params
from jaxllm.models.pipeline import StagePlan, cache_slots, check_pipeline_parallel
from jaxllm.models.quant import quantize_params, quantized_config
from jaxllm.platform import CompileHook, compilation_cache_path
from jaxllm.pooling_params import PoolerConfig
from jaxllm.reasoning import PARSERS as REASONING_PARSERS
from jaxllm.reasoning import ThinkingState
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.draft_model import DraftModelProposer
from jaxllm.structured_output.manager import StructuredOutputManager, apply_token_filters, bitmask_width
from jaxllm.worker.model_runner import DispatchedStep, ModelRunner, RunnerConfig, weights_mismatch
from jaxllm.worker.pooling_runner import PoolingRunner, PoolingRunnerConfig

logger = logging.getLogger(__name__)
WAKE_TAGS = ("weights", "kv_cache")  # what wake_up brings back (vLLM's tags)
PAUSE_MODES = ("abort", "wait", "keep")  # what pause does with the requests in flight (vLLM's modes)


def eos_token_id(tokenizer, model_config: ModelConfig) -> int | None:
    """The token that ends a generation: the tokenizer's EOS, else the model config's first."""
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return model_config.eos_token_ids[0] if model_config.eos_token_ids else None


def resolve_chat_template(value: str | None) -> str | None:
    """A chat template given inline, or as the path of a file holding one."""
    if value is not None and "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    return value


def kv_cache_bytes(kv_cache_memory: str | int | float | None) -> int:
    """The KV cache budget in bytes: given in bytes, or a fraction of what the device
    reports (GPUs), or vLLM's CPU default of 2 GiB on devices that report nothing."""
    memory = parse_memory(kv_cache_memory)
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if memory is None:
        return DEFAULT_CPU_KV_CACHE_BYTES if limit is None else int(DEFAULT_DEVICE_MEMORY_FRACTION * (limit - stats.get("bytes_in_use", 0)))
    if isinstance(memory, float) and memory <= 1:
        if limit is None:
            raise ValueError("kv_cache_memory: a fraction needs a device that reports its memory; give bytes (e.g. 4GiB)")
        return int(memory * (limit - stats.get("bytes_in_use", 0)))
    return int(memory)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    num_blocks: int  # including the null block
    block_size: int
    max_model_len: int
    groups: KVCacheGroups  # a block holds `groups.group_size` layers' K/V
    chunk: int  # the most tokens a request computes in one step (max_num_batched_tokens)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds (in every group; with several, per layer of a group)."""
        return (self.num_blocks - 1) * self.block_size

    def max_concurrency(self, num_tokens: int | None = None) -> float:
        """Requests of `num_tokens` tokens (default max_model_len) the pool holds at once,
        each at its peak (vLLM's "maximum concurrency")."""
        n = num_tokens or self.max_model_len
        return (self.num_blocks - 1) / self.groups.peak_blocks(n, self.block_size, self.chunk)

    def describe(self) -> str:
        text = f"{self.num_blocks - 1} blocks of {self.block_size} tokens"
        groups = self.groups
        if groups.num_groups == 1:
            text += f" = {self.capacity_tokens} tokens"
        else:
            full = sum(w is None for w in groups.windows)
            windows = ", ".join(map(str, sorted({w for w in groups.windows if w is not None})))
            layers = f"{groups.group_size} layer{'s' * (groups.group_size > 1)}"
            text += (f" x {layers}, shared by {groups.num_groups} layer groups ({full} full, "
                     f"{groups.num_groups - full} sliding over {windows})")
        return f"{text}, {self.max_concurrency():.1f}x max_model_len at once"


def plan_cache(config: EngineConfig, model: ModelConfig, fmt: KVCacheFormat, shard: ModelConfig | None = None,
               extra_block_bytes: int = 0, stages: StagePlan | None = None) -> CacheLayout:
    """The KV cache's blocks: as many as `kv_cache_memory` holds on one device in format
    `fmt`, whose share of the KV heads is `shard`'s (default: the whole model's) and
    whose layers are its pipeline stage's (`stages`; default: all), each with
    `extra_block_bytes` beside it (a draft model's block of the same tokens)."""
    max_model_len = config.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's context length "
            f"{model.max_position_embeddings}"
        )
    heads = shard or model
    groups = model.kv_cache_groups(hybrid=not config.disable_hybrid_kv_cache_manager)
    slots = groups.group_size if stages is None else cache_slots(stages, groups).count
    block_bytes = config.block_size * fmt.token_bytes(slots, heads.num_kv_heads, heads.head_dim)
    num_blocks = kv_cache_bytes(config.kv_cache_memory) // (block_bytes + extra_block_bytes)
    layout = CacheLayout(num_blocks, config.block_size, max_model_len, groups, config.max_num_batched_tokens)
    if groups.peak_blocks(max_model_len, config.block_size, config.max_num_batched_tokens) > num_blocks - 1:
        raise ValueError(
            f"max_model_len: {max_model_len} tokens do not fit in the KV cache "
            f"({layout.describe()}); raise kv_cache_memory or lower max_model_len"
        )
    return layout


def make_kv_cache_manager(config: EngineConfig, cache: CacheLayout) -> KVCacheManager | HybridKVCacheManager:
    """One manager for one KV cache group (with the group's sliding window: every layer
    of a Mistral slides), a hybrid one for several."""
    groups = cache.groups
    if groups.num_groups == 1:
        return KVCacheManager(cache.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
                              sliding_window=groups.windows[0], chunk=config.max_num_batched_tokens)
    return HybridKVCacheManager(cache.num_blocks, config.block_size, groups, chunk=config.max_num_batched_tokens,
                                enable_caching=config.enable_prefix_caching)


def draft_block_bytes(config: EngineConfig, draft: LoadedModel) -> int:
    """Bytes of a draft model's K/V for one block of tokens (every layer)."""
    cfg = draft.config
    fmt = kv_cache_format(config.kv_cache_dtype, draft.params.final_norm.dtype)
    return config.block_size * fmt.token_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def _quantized(model: LoadedModel, quantization: str | None) -> LoadedModel:
    """A model loaded by the caller, quantized as the engine's config asks (one already
    quantized so, a None ask or a checkpoint method's name, as it is)."""
    if quantization in (None, model.config.quantization, *CHECKPOINT_METHODS):
        return model
    if model.config.quantization is not None:
        raise ValueError(f"quantization: {quantization!r} asked for a model loaded with {model.config.quantization!r}")
    cfg = quantized_config(model.config, quantization)
    return dataclasses.replace(model, config=cfg, params=quantize_params(cfg, model.params))


def runner_config(config: EngineConfig, cache: CacheLayout, cache_dir: Path, kv_format: KVCacheFormat,
                  before_measuring=None, images: tuple[int, int] = (0, 0)) -> RunnerConfig:
    """The model runner's configuration: the engine's options it needs, and the KV
    cache planned for them (of `kv_format`, what kv_cache_dtype gave); `before_measuring`
    runs before any start-up measurement; `images`: a vision-language model's encoder
    cache slots and images per step (`encoder_cache_plan`)."""
    return RunnerConfig(
        num_blocks=cache.num_blocks,
        block_size=config.block_size,
        max_model_len=cache.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        attention_backend=config.attention_backend,
        linear_backend=config.linear_backend,
        cache_dir=cache_dir,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        kv_cache_dtype=kv_format.name,
        kv_layer_scales=kv_format.layer_scaled,
        activation_quantization=config.activation_quantization,
        hybrid_kv_cache=not config.disable_hybrid_kv_cache_manager,
        batch_invariant=config.batch_invariant,
        async_scheduling=config.runs_async,
        num_scheduler_steps=config.decode_steps,
        speculative_config=config.speculative_config,
        lora_config=config.lora_config,
        encoder_cache_slots=images[0],
        max_images_per_step=images[1],
        before_measuring=before_measuring,
    )


def encoder_cache_plan(config: EngineConfig, cfg: ModelConfig) -> tuple[int, int]:
    """A vision-language model's encoder cache: (slots, images a step may encode), a
    step's token budget of images (at least one) and as many again kept for reuse;
    (0, 0) for a text model. ValueError where the engine cannot serve its images yet."""
    vision = cfg.vision
    if vision is None:
        return 0, 0
    if config.devices_per_engine > 1 or config.num_processes > 1:
        raise ValueError(f"{vision.architecture}: images not yet with tensor or pipeline parallelism or several "
                         "processes; serve it on one device")
    if vision.bidirectional_images and vision.tokens_per_image > config.max_num_batched_tokens:
        raise ValueError(f"max_num_batched_tokens: {config.max_num_batched_tokens} is fewer than an image's "
                         f"{vision.tokens_per_image} tokens, which {vision.architecture} computes in one step")
    per_step = max(1, config.max_num_batched_tokens // vision.tokens_per_image)
    return 2 * (per_step + 1), per_step


class EngineCore:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, *, progress: bool = True,
                 placement: Placement | None = None) -> None:
        """`placement`: this core is a process other than 0 of an engine over several
        (a Ray worker: jaxllm.engine.ray_executor); process 0 places the others itself."""
        self.config = config
        self.executor = self._start_processes(config, placement)
        cache_dir = compilation_cache_path(config.compilation_cache_dir)
        load = lambda: load_model(config.model, config.dtype, resolve_chat_template(config.chat_template),
                                  conversion_cache_dir=cache_dir / "converted-models",
                                  on_host=config.devices_per_engine > 1,  # placed shard by shard
                                  quantization=config.quantization)
        # When the config can be read without the weights (an HF folder, or a GGUF
        # converted on an earlier start), the weights load on a thread while the step
        # executables load: those need only the params' shapes.
        cfg = None if model is not None else peek_model_config(config.model, config.dtype, cache_dir / "converted-models",
                                                               config.quantization)
        loading = None
        if cfg is not None:
            pool = concurrent.futures.ThreadPoolExecutor(1, "model-load")
            loading = pool.submit(load)
            pool.shutdown(wait=False)  # the thread ends when the load does
            params = abstract_params(cfg, choose_dtype(config.dtype, cfg.checkpoint_dtype)[0])
        else:
            self.model = _quantized(model, config.quantization) if model is not None else load()
            cfg, params = self.model.config, self.model.params
        self.pooler: PoolerConfig | None = None  # the pooling runner's
        self._rng = np.random.default_rng(config.seed)
        # async scheduling: the step dispatched and not yet collected, with its schedule
        self._in_flight: tuple[SchedulerOutput, DispatchedStep] | None = None
        self._clear_when_drained = False  # pause(mode="wait", clear_cache=True) until its requests finish
        path = self.model.path if model is not None else model_path(config.model)
        self._checkpoint_kv_scales = kv_cache_scales(path, cfg.num_layers)
        if config.runner_type(cfg, is_sentence_transformers(path)) == "pooling":
            self._start_pooling(config, cfg, params, loading, cache_dir)
        else:
            self._start_generate(config, cfg, params, loading, cache_dir, progress)
        # The runner holds the weights from here (packed copies for linear_backend cpu):
        # this reference would keep a second copy alive.
        self.model = dataclasses.replace(self.model, params=None)
        if self.executor is not None:
            wait_for_workers(self.executor)
        self.structured_outputs = StructuredOutputManager(
            self.model.tokenizer, vocab_size=self.model.config.vocab_size,
            eos_token_id=eos_token_id(self.model.tokenizer, self.model.config))
        # with a reasoning parser, a structured output's grammar starts after the thinking
        self.reasoning = None if config.reasoning_parser is None else (
            REASONING_PARSERS[config.reasoning_parser],
            *REASONING_PARSERS[config.reasoning_parser].token_ids(self.model.tokenizer))

    def _kv_layer_scaled(self, config: EngineConfig, kv_format: KVCacheFormat) -> KVCacheFormat:
        """An fp8 cache with scales per layer: calculated from the first batch
        (calculate_kv_scales), else the checkpoint's where it has them; other formats
        do not read a checkpoint's scales (said in the log)."""
        found = self._checkpoint_kv_scales is not None
        if config.calculate_kv_scales:
            self.kv_cache_why += "; scales calculated from the first batch" + (
                " (in place of the checkpoint's)" if found else "")
            return dataclasses.replace(kv_format, layer_scaled=True)
        if not found:
            return kv_format
        if kv_format.dtype != jnp.float8_e4m3fn:
            logger.info("the checkpoint's KV cache scales (k_scale, v_scale) apply to an fp8 KV cache only "
                        "(--kv-cache-dtype fp8); this %s cache does not use them", kv_format.name)
            return kv_format
        if config.pipeline_parallel_size > 1:
            raise ValueError("kv_cache_dtype: the checkpoint's fp8 KV cache scales are not yet supported with "
                             "pipeline_parallel_size > 1")
        self.kv_cache_why += "; the checkpoint's scales"
        return dataclasses.replace(kv_format, layer_scaled=True)

    def _start_generate(self, config: EngineConfig, cfg: ModelConfig, params, loading, cache_dir: Path,
                        progress: bool) -> None:
        """The KV cache, scheduler and model runner of a generating engine; `params`
        abstract while `loading` (a future) reads the weights."""
        check_tensor_parallel(cfg, config.tensor_parallel_size)
        stages = check_pipeline_parallel(cfg, config.pipeline_parallel_size, config.tensor_parallel_size)
        if config.enable_lora:  # refuses a model (or split) adapters cannot serve, before anything is built
            lora_partition_specs(cfg, config.tensor_parallel_size)
        kv_format, self.kv_cache_why = choose_kv_cache_format(
            config.kv_cache_dtype, params.final_norm.dtype,
            rounds_activations(params, config.activation_quantization, config.linear_backend))
        kv_format = self._kv_layer_scaled(config, kv_format)
        draft = self._load_draft(config, cfg, cache_dir)
        # kv_cache_memory is per device: the blocks are sized by one shard's KV heads, in its stage's layers
        self.cache = plan_cache(config, cfg, kv_format, shard_config(cfg, config.tensor_parallel_size),
                                0 if draft is None else draft_block_bytes(config, draft), stages)
        self.max_model_len = self.cache.max_model_len
        self.kv_cache_manager = make_kv_cache_manager(config, self.cache)
        images = encoder_cache_plan(config, cfg)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_loras=config.max_loras if config.enable_lora else 0,
            num_scheduler_steps=config.decode_steps,
            decode=self._decode,
            policy=config.scheduling_policy,
            encoder_cache=EncoderCacheManager(images[0]) if images[0] else None,
            max_images_per_step=images[1],
            whole_images=cfg.vision is not None and cfg.vision.bidirectional_images,
        )
        # the weights' loading thread done before any measurement (it would share the cores);
        # an event, not the future: the runner keeps the callable, and the future would keep
        # the loaded (unpacked) weights alive beside the runner's own for the engine's life
        quiet = None
        if loading is not None:
            loaded = threading.Event()
            loading.add_done_callback(lambda _: loaded.set())
            quiet = loaded.wait
        self.runner = ModelRunner(cfg, params, runner_config(config, self.cache, cache_dir, kv_format, quiet, images))
        if kv_format.layer_scaled and not config.calculate_kv_scales:
            self.runner.set_kv_layer_scales(*self._checkpoint_kv_scales)
        self.runs_async = config.runs_async
        if config.async_scheduling is None and config.async_scheduling_blocked:
            logger.info("async scheduling off: %s", config.async_scheduling_blocked)
        if draft is not None:
            self.runner.set_proposer(self._draft_proposer(config, draft, cache_dir))
        if loading is not None:  # laid out for the linear backend (packing ~1.5 s) on a thread too
            layout_pool = concurrent.futures.ThreadPoolExecutor(1, "model-layout")
            laid_out = layout_pool.submit(lambda: self.runner.layout_params(loading.result().params))
            layout_pool.shutdown(wait=False)
        self.warmup_seconds = self.runner.warm_up(progress) if config.warm_up else 0.0
        if loading is not None:
            self.model = loading.result()
            if self.model.config != cfg:
                raise RuntimeError(f"{self.model.path}: the loaded config differs from the one read before loading")
            self.runner.set_params(laid_out.result())
        if cfg.vision is not None:
            self.runner.set_vision_params(self.model.vision_params)
            self.model = dataclasses.replace(self.model, vision_params=None)  # the runner's now

    def _start_pooling(self, config: EngineConfig, cfg: ModelConfig, params, loading, cache_dir: Path) -> None:
        """The scheduler and pooling runner of an engine serving embeddings. An encoder
        keeps no KV cache: its block pool only counts each step's tokens, and a prompt
        is pooled whole in one step (the step's budget is at least max_model_len)."""
        refused = [name for name, on in (("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
                                         ("pipeline_parallel_size > 1", config.pipeline_parallel_size > 1),
                                         ("num_processes > 1", config.num_processes > 1),
                                         ("enable_lora", config.enable_lora),
                                         ("speculative_config", config.speculative_config is not None),
                                         ("batch_invariant", config.batch_invariant)) if on]
        if refused:
            raise ValueError(f"runner: pooling is not yet served with {', '.join(refused)}")
        if config.activation_quantization not in ("auto", "none"):
            raise ValueError(f"activation_quantization: {config.activation_quantization} is not yet applied by the "
                             "pooling runner (its projections multiply float activations); leave it auto")
        if cfg.is_encoder and config.quantization not in (None, "none"):
            raise ValueError(f"quantization: {config.quantization} is not yet applied to encoders (BERT's weights are "
                             "held as loaded)")
        if config.async_scheduling:
            raise ValueError("async_scheduling: a pooling step samples nothing the next one waits for; leave it unset")
        if loading is not None:  # the start-up measurement needs the weights
            self.model = loading.result()
        model_pooler_config, trained_len = model_pooler(self.model.path, cfg)
        self.pooler = config.pooler_config.over(model_pooler_config) if config.pooler_config else model_pooler_config
        self.max_model_len = config.max_model_len or trained_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's {cfg.max_position_embeddings} "
                             "positions")
        budget = max(config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-budget // config.block_size) + config.max_num_seqs + 1
        self.cache = CacheLayout(blocks, config.block_size, self.max_model_len, cfg.kv_cache_groups(False), budget)
        self.kv_cache_why = "none kept between steps"
        self.kv_cache_manager = KVCacheManager(blocks, config.block_size, enable_caching=False)
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=budget, max_model_len=self.max_model_len)
        self.runner = PoolingRunner(cfg, params, PoolingRunnerConfig(
            config.max_num_seqs, budget, self.max_model_len, self.pooler, config.linear_backend,
            config.attention_backend, config.block_size, cache_dir))
        self.runs_async = False
        self.warmup_seconds = self.runner.warm_up(self.model.params, compile_buckets=config.warm_up)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """The tokenizer's text of `token_ids` (a beam search's stop strings)."""
        return self.model.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @staticmethod
    def _load_draft(config: EngineConfig, target: ModelConfig, cache_dir: Path) -> LoadedModel | None:
        """The draft model `speculative_config` names (method draft_model), checked
        against the target: the same vocabulary, one device."""
        spec = config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        if config.devices_per_engine > 1 or config.num_processes > 1:
            raise ValueError("speculative_config: a draft model runs on one device (tensor_parallel_size 1, "
                             "pipeline_parallel_size 1, num_processes 1) for now")
        draft = load_model(spec.model, config.dtype, conversion_cache_dir=cache_dir / "converted-models")
        if draft.config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.config.vocab_size} tokens) "
                             f"differs from the target's ({target.vocab_size})")
        return draft

    def _draft_proposer(self, config: EngineConfig, draft: LoadedModel, cache_dir: Path) -> DraftModelProposer:
        """The draft model's runner, over a pool of the target's blocks and room for
        every sequence's drafts, and its proposer."""
        k, bs = config.speculative_config.num_speculative_tokens, config.block_size
        num_blocks = self.cache.num_blocks + config.max_num_seqs * -(-k // bs)
        target = self.runner.runner_config
        runner = ModelRunner(draft.config, draft.params, RunnerConfig(
            num_blocks, bs, self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
            attention_backend=config.attention_backend, linear_backend=config.linear_backend,
            cache_dir=target.cache_dir, kv_cache_dtype=config.kv_cache_dtype, hybrid_kv_cache=False))
        if config.warm_up:
            runner.warm_up(progress=False)
        manager = KVCacheManager(num_blocks, bs, enable_caching=False)
        return DraftModelProposer(runner, manager, k, config.max_num_batched_tokens)

    # --------------------------------------------------------------- requests

    def add_request(self, req: EngineCoreRequest) -> None:
        self.add_requests([req])

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """Validate all, then queue all: a ValueError (naming the field) leaves nothing queued."""
        if self.is_sleeping():
            raise ValueError("the engine is asleep: wake_up() first (after a level-2 sleep, update_weights too)")
        requests = [self.make_request(req) for req in reqs]
        ids = [r.request_id for r in requests]
        duplicate = next((i for i in ids if ids.count(i) > 1 or i in self.scheduler.requests), None)
        if duplicate is not None:
            raise ValueError(f"request_id: {duplicate!r} is already in use")
        for request in requests:
            self.scheduler.add_request(request)
            if request.structured is not None:
                if self.reasoning is not None:
                    request.structured.thinking = ThinkingState.of_prompt(*self.reasoning, request.prompt_token_ids)
                self.structured_outputs.submit(request.structured)

    def make_request(self, req: EngineCoreRequest) -> Request:
        """The scheduler's Request for `req`, after every check that can reject it."""
        req.validate(vocab_size=self.model.config.vocab_size, max_model_len=self.max_model_len)
        self.check_runner(req)
        self.check_images(req)
        params, n = req.sampling_params, len(req.prompt_token_ids)
        room = self.max_model_len - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        if req.priority and self.config.scheduling_policy != "priority":
            raise ValueError("priority: the server schedules first come, first served; start it with "
                             "--scheduling-policy priority to rank requests")
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        if params.use_beam_search:
            self.check_beam_search(params)
        request = Request.from_engine_core_request(req, max_tokens, seed % 2**64)
        self.kv_cache_manager.check_fits(request, self.scheduler.max_kv_tokens(request))
        return request

    def check_runner(self, req: EngineCoreRequest) -> None:
        """A request this engine's runner serves: pooling requests where it pools (with
        parameters the model supports), generation where it generates; ValueError
        saying how to start the other."""
        name = self.config.model or "the model"
        if self.pooler is None and req.pooling_params is not None:
            raise ValueError(f"pooling_params: {name} is served for generation; embeddings need a server started "
                             "with --runner pooling")
        if self.pooler is not None and req.pooling_params is None:
            raise ValueError(f"sampling_params: {name} is served for pooling (--runner pooling): it returns "
                             "embeddings, not generated text; start it with --runner generate to generate")
        if req.pooling_params is not None:
            req.pooling_params.check_for_model(self.pooler, self.model.config.hidden_size)

    def check_images(self, req: EngineCoreRequest) -> None:
        """A request's images agree with its prompt's image tokens and the model (ValueError)."""
        vision = self.model.config.vision
        if vision is None:
            if req.images:
                raise ValueError("multi_modal_data: this model reads text only (it has no vision tower)")
            return
        if len(req.images) > self.config.images_per_prompt:
            raise ValueError(f"multi_modal_data: {len(req.images)} images, more than the {self.config.images_per_prompt} "
                             "a prompt may have (--limit-mm-per-prompt)")
        tokens = [i for i, t in enumerate(req.prompt_token_ids) if t == vision.image_token_id]
        spans = [p for image in req.images for p in range(image.offset, image.offset + image.length)]
        if tokens != spans or any(image.length != vision.tokens_per_image for image in req.images):
            raise ValueError(f"prompt: its {len(tokens)} image tokens do not stand for its {len(req.images)} images "
                             f"({vision.tokens_per_image} tokens each)")
        shape = (vision.num_channels, vision.image_size, vision.image_size)
        bad = next((i for i, image in enumerate(req.images)
                    if tuple(image.shape) != shape or len(image.pixels) != 4 * np.prod(shape)), None)
        if bad is not None:
            raise ValueError(f"multi_modal_data: image {bad} is {tuple(req.images[bad].shape)} after "
                             f"preprocessing, the model's {shape}")

    def check_beam_search(self, params: SamplingParams) -> None:
        """What this engine cannot run of a beam search (ValueError naming the field)."""
        params.check_beam_width(self.config.max_num_seqs)
        if self.config.speculative_config is not None:
            raise ValueError("use_beam_search: not supported with speculative decoding (speculative_config)")
        if params.num_beam_candidates > self.model.config.vocab_size:
            raise ValueError(f"n: a beam width of {params.n} ranks more candidates than the vocabulary has")

    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter (kept on the host for the requests naming it), in
        every process of the engine; ValueError saying what is wrong with it, or that
        LoRA is off."""
        if self.runner.lora is None:
            raise ValueError(f"lora_request: {lora.lora_name!r} asked of an engine without LoRA; start it with "
                             "enable_lora=True (--enable-lora)")
        new = lora.lora_int_id not in self.runner.lora.list_loras()
        self.runner.lora.add(lora)
        if new and self.executor is not None:  # each worker's runner loads it into the same slots as this one
            try:
                self.executor.add_lora(lora)
            except ValueError:
                self.runner.lora.remove(lora.lora_int_id)
                raise

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter, in every process; whether it was known."""
        if self.executor is not None:
            self.executor.remove_lora(lora_int_id)
        return self.runner.lora is not None and self.runner.lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return [] if self.runner.lora is None else self.runner.lora.list_loras()

    def abort_requests(self, request_ids) -> EngineCoreOutputs:
        return EngineCoreOutputs(self.scheduler.abort_requests(request_ids), self.scheduler.make_stats())

    # --------------------------------------------------------------- weights

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back between uses (enable_sleep_mode): the KV cache is
        freed (its prefix cache emptied) and the weights copied to host memory (level 1)
        or dropped (level 2: update_weights brings new ones). Between requests only."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep: start the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"level: 1 (weights kept in host memory) or 2 (weights dropped), got {level!r}")
        self._check_nothing_runs("sleep")
        if self.executor is not None or self.pooler is not None:
            raise ValueError("sleep: not yet for an engine over several processes or a pooling model")
        if self.is_sleeping():
            raise RuntimeError("sleep: the engine is asleep already; wake_up() first")
        self._clear_prefix_cache()
        self.runner.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Back on the device: "weights" (those a level-1 sleep kept; after level 2 they
        come with update_weights) and "kv_cache" (empty), both by default."""
        tags = WAKE_TAGS if tags is None else tuple(tags)
        unknown = sorted(set(tags) - set(WAKE_TAGS))
        if unknown:
            raise ValueError(f"tags: unknown {unknown}; choose from {list(WAKE_TAGS)}")
        self.runner.wake_up(weights="weights" in tags, kv_cache="kv_cache" in tags)

    def update_weights_from_path(self, path: str) -> None:
        """update_weights with the weights of an HF folder (or a GGUF) of this model. An
        engine over several processes: each reads `path` on its own node (the same path
        everywhere) and takes its share; this process checks them first, so weights that
        do not fit are refused before any process takes them."""
        self._check_nothing_runs("update_weights")
        loaded = load_model(path, jnp.dtype(self.runner.param_dtype).name,
                            conversion_cache_dir=compilation_cache_path(self.config.compilation_cache_dir)
                            / "converted-models")
        if self.executor is None:
            self.update_weights(loaded.params)
            return
        weights = self._fitting_weights(loaded.params)
        calls = self.executor.update_weights_from_path(path)
        self.runner.set_params(weights)
        self._clear_prefix_cache()
        self.executor.wait(calls)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (possible only when no request holds blocks)."""
        return self.kv_cache_manager.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are given back (requests wait for both)."""
        return any(self.runner.asleep) if self.pooler is None else False

    def update_weights(self, weights: ModelParams | Mapping[str, Any]) -> None:
        """New weights for the same model, which the next steps use: jaxllm's parameter
        tree of this model (jaxllm.loaders.load_model(...).params; arrays of the dtype the
        engine runs) or a mapping of its HF tensor names to arrays (read as a
        checkpoint's tensors are). Float weights for an engine that keeps projections
        quantized are quantized as at load. The prefix cache is emptied: nothing
        computed with the old weights is reused. Between requests only (the caller
        finishes or aborts them, or pauses them with mode "keep": then they are recomputed
        after resume; LLMEngine.update_weights' mode). ValueError naming the first
        parameter that does not fit; nothing is applied then."""
        self._check_nothing_runs("update_weights")
        if self.executor is not None:
            raise ValueError("update_weights: an engine over several processes takes weights from a path every "
                             "node reads (update_weights_from_path; POST /update_weights {\"path\"}), not arrays of "
                             "this process")
        if self.pooler is not None:
            raise ValueError("update_weights: not yet for a pooling model")
        self.runner.set_params(self._fitting_weights(weights))
        self._clear_prefix_cache()

    def _fitting_weights(self, weights: ModelParams | Mapping[str, Any]) -> ModelParams:
        """`weights` as this engine holds them: HF names read as a checkpoint's, float
        weights quantized where the engine keeps blocks; ValueError naming the first
        parameter that does not fit."""
        if not isinstance(weights, Mapping) and self.runner.laid_out(weights):  # the cpu backend's panels
            return weights
        cfg, dtype = self.model.config, self.runner.param_dtype
        float_cfg = dataclasses.replace(cfg, quantization=None)
        if isinstance(weights, Mapping):
            weights = build_params(float_cfg, weights.get, dtype, "update_weights")
        if cfg.quantization is not None and self.runner.weights_mismatch(weights) is not None:
            problem = weights_mismatch(weights, abstract_params(float_cfg, dtype))
            if problem is not None:
                raise ValueError(f"weights: {problem}")
            weights = quantize_params(cfg, weights)
        problem = self.runner.weights_mismatch(weights)
        if problem is not None:
            raise ValueError(f"weights: {problem}")
        return weights

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def has_work(self) -> bool:
        """Whether step() has anything to run (requests held by a pause do not count)."""
        return self.scheduler.has_work() or self._in_flight is not None

    # ------------------------------------------------------------------ pause

    def watch_compiles(self, while_compiling: CompileHook) -> None:
        """Enter `while_compiling()` around each compile at first use (without warm-up, a
        step shape, a block-copy size, an image batch, a draft model's or a pooling
        model's bucket is compiled at the first step that needs it): the core's process
        says meanwhile that it is alive (jaxllm.engine.core_proc)."""
        if isinstance(self.runner, PoolingRunner):
            self.runner.while_compiling = while_compiling
            return
        runners = [self.runner] + ([self.runner.proposer.runner]
                                   if isinstance(self.runner.proposer, DraftModelProposer) else [])
        for runner in runners:
            runner.compilation.while_compiling = while_compiling
            if runner.images is not None:
                runner.images.while_compiling = while_compiling

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> EngineCoreOutputs:
        """Stop scheduling requests that arrive from now on until resume() (vLLM's
        pause_scheduler), and those in flight by `mode`: "abort" ends them, "wait" lets
        them run to their end (the caller keeps stepping while has_work()), "keep"
        holds them where they are. `clear_cache`: the prefix cache is emptied (after
        the drain under "wait"), and kept requests let their KV go, to be recomputed
        after resume. The outputs of the step in flight and of the aborted requests."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: unknown {mode!r}; choose one of {', '.join(PAUSE_MODES)}")
        outputs = self._collect() if self._in_flight is not None else EngineCoreOutputs([])
        if mode == "abort":
            ids = list(self.scheduler.beam_groups) + [
                rid for rid, r in self.scheduler.requests.items() if r.beam is None]
            outputs.outputs += self.scheduler.abort_requests(ids)
        self.scheduler.pause(keep=mode != "wait")
        self._clear_when_drained = clear_cache
        if clear_cache and mode != "wait":
            self._clear_prefix_cache()
        outputs.stats = self.scheduler.make_stats()
        return outputs

    def resume(self) -> None:
        """Schedule again what pause() held (a kept request goes on from its tokens)."""
        if self.is_sleeping():
            raise RuntimeError("resume: the engine is asleep; wake_up() first")
        self.scheduler.resume()

    def is_paused(self) -> bool:
        return self.scheduler.paused is not None

    def is_drained(self) -> bool:
        """Paused with nothing left to run (a "wait" pause's requests have finished)."""
        return self.is_paused() and not self.has_work()

    def _clear_prefix_cache(self) -> None:
        """Forget every cached prefix, the requests a pause keeps letting their KV go."""
        self.scheduler.preempt_all()
        if not self.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: KV blocks are still held")
        self._clear_when_drained = False

    def _check_nothing_runs(self, what: str) -> None:
        """Weights and memory change only while nothing runs (RuntimeError otherwise);
        requests a pause holds stay (their KV goes: they are recomputed after resume)."""
        if self.has_work():
            raise RuntimeError(f"{what}: requests are in flight; finish or abort them, or pause() first")

    # ------------------------------------------------------------------- step

    def step(self) -> EngineCoreOutputs:
        """One scheduled step. If the model step raises, the requests it held are
        aborted and the prefix cache forgets the blocks it was to fill, then the error
        propagates (the engine stays usable). Under async scheduling, the outputs of
        the step before (`_step_async`)."""
        outputs = self._step_async() if self.runs_async else self._step_sync()
        if self._clear_when_drained and self.is_drained():  # pause(mode="wait")'s requests have finished
            self._clear_prefix_cache()
        return outputs

    def _step_sync(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        if sched.is_empty and self.scheduler.waiting:  # they wait for their grammars
            self.structured_outputs.wait_for_compiles(timeout=0.1)
        try:
            bitmask = self._bitmask(sched)
            if self.executor is not None:  # every process runs the step (jaxllm.engine.ray_executor)
                self.executor.send(sched, bitmask)
            result = self.runner.execute_model(sched, bitmask)
        except Exception:
            self.scheduler.fail_step(sched)
            if self.executor is not None:  # a lost worker is the cause to report, not the broken collective
                self.executor.exit_if_a_worker_died()
            raise
        return self.scheduler.update_from_output(sched, result)

    def _step_async(self) -> EngineCoreOutputs:
        """Schedule and dispatch the next step while the one before runs (its sampled
        tokens stand as placeholders the step reads on the device), then wait for that
        one and return its outputs: the host's scheduling, input building and output
        recording overlap the device's work. Where a request's grammar needs the
        tokens first (its next bitmask), the step before is collected first."""
        outputs = None
        if self._in_flight is not None and self._tokens_needed():
            outputs = self._collect()
        sched = self.scheduler.schedule()
        if sched.is_empty and self.scheduler.waiting and self._in_flight is None:
            self.structured_outputs.wait_for_compiles(timeout=0.1)
        try:
            bitmask = self._bitmask(sched)
            flight = self.runner.dispatch(sched, bitmask)
        except Exception:
            self.scheduler.fail_step(sched)
            if self._in_flight is not None:
                self.scheduler.abort_requests(list(self._in_flight[0].num_scheduled_tokens))
                self._in_flight = None
            raise
        self.scheduler.add_placeholders(sched)
        if outputs is None and self._in_flight is not None:
            try:
                outputs = self._collect()
            except Exception:  # the step just dispatched is dropped with it
                self.scheduler.fail_step(sched)
                raise
        self._in_flight = None if flight is None else (sched, flight)
        return outputs if outputs is not None else EngineCoreOutputs([], self.scheduler.make_stats())

    def _bitmask(self, sched) -> np.ndarray | None:
        """The step's token bitmask: the grammars' and the token filters' (allowed_token_ids,
        bad_words); None when no row is constrained."""
        bitmask = self.structured_outputs.bitmask(self.scheduler.constrained_rows(sched), sched.num_sample_rows)
        return apply_token_filters(bitmask, self.scheduler.filtered_rows(sched), sched.num_sample_rows,
                                   bitmask_width(self.structured_outputs.vocab_size))

    def _tokens_needed(self) -> bool:
        """Whether the next schedule needs the ids of the step in flight: a request
        under a grammar samples with a bitmask made from its tokens so far; a beam
        search decides its next beams from the step's candidates; a bad word of several
        tokens is masked after its first ones."""
        return bool(self.scheduler.beam_groups) or any(
            r.structured is not None or (r.token_filter is not None and r.token_filter.needs_tokens)
            for r in self.scheduler.requests.values())

    def _collect(self) -> EngineCoreOutputs:
        """Wait for the step in flight; its requests' outputs (aborted if it fails)."""
        sched, flight = self._in_flight
        self._in_flight = None
        try:
            result = self.runner.collect(flight)
        except Exception:
            self.scheduler.abort_requests(list(sched.num_scheduled_tokens))
            raise
        return self.scheduler.update_from_output(sched, result)

    @staticmethod
    def _start_processes(config: EngineConfig, placement: Placement | None) -> RayExecutor | None:
        """jax.distributed over the engine's processes, before JAX starts a backend: as
        `placement` says (a worker), or (process 0 of several) after placing the others
        on Ray; the executor that sends them the steps (None: one process)."""
        if placement is not None:
            initialize(placement)
            return None
        if config.num_processes == 1:
            if config.distributed_executor_backend == "ray":
                logger.info("distributed_executor_backend ray, num_processes 1: this process drives this host's "
                            "devices; Ray has no other process to place")
            return None
        executor = RayExecutor(config)
        initialize(executor.placement)
        executor.close_at_exit()
        return executor

    def close(self) -> None:
        """Stop the other processes of a multi-process engine."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None

    def describe(self) -> str:
        if self.pooler is not None:
            p = self.pooler
            return (f"runner pooling ({p.pooling_type}{', normalized' if p.normalize else ''}); "
                    f"max_model_len={self.max_model_len}; {len(self.runner.token_buckets)} step shapes of up to "
                    f"{self.scheduler.max_num_batched_tokens} tokens; {self.runner.describe_backends()}")
        c = self.cache
        dtype, why = choose_dtype(self.config.dtype, self.runner.config.checkpoint_dtype)
        return (
            f"dtype {dtype.name} ({why}); KV cache ({self.runner.kv_format.name}, {self.kv_cache_why}): {c.describe()}; "
            f"max_model_len={c.max_model_len}; weights {self.runner.describe_weights()}; "
            f"{len(self.runner.buckets)} step shapes"
            + (f" and {len(self.runner.loop_buckets)} decode loops of {self.runner.num_scheduler_steps} steps"
               if self.runner.loop_buckets else "") + "; "
            f"{self.runner.describe_backends()}"
            + ("; async scheduling" if self.runs_async else "")
        )

