"""The model runner: turns a SchedulerOutput into one jitted device call and its
results into a ModelRunnerOutput.

Every step is padded to a bucket (jaxllm.worker.buckets), its inputs built on the host
(jaxllm.worker.input_builder) and packed into one buffer (jaxllm.worker.packing), and
run by the executable compiled for its bucket at start-up (jaxllm.worker.compilation).
The runner dispatches steps, collects their sampled tokens and records them in its rows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, Int

from jaxllm.attention.backends import attention_candidates
from jaxllm.attention.kv_cache import KVCache, allocate_kv_caches, cache_shapes, kv_cache_format
from jaxllm.config import ModelConfig
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.lora.request import LoRAConfig
from jaxllm.messages import LogprobsLists, ModelRunnerOutput
from jaxllm.models import parallel, pipeline
from jaxllm.models.formats import declared_format
from jaxllm.models.linear import (
    auto_activation_quantization,
    auto_activations,
    bf16_tiles,
    in_dtype,
    layout_params,
    linear_candidates,
    quantized_activations,
)
from jaxllm.models.params import INT16_STEP, ModelParams, ParamDecl, declare
from jaxllm.models.quant import param_bytes
from jaxllm.models.rope import model_rope_table
from jaxllm.platform import activation_dtype
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram_proposer import NgramProposer
from jaxllm.structured_output.manager import bitmask_width
from jaxllm.worker.autotune import BackendPlan, StepBackends, backend_plan
from jaxllm.worker.buckets import StepShape, StepShapes, seq_bucket, smallest_at_least
from jaxllm.worker.compilation import CompilationManager
from jaxllm.worker.decode_loop import LoopOutput
from jaxllm.worker.executable_cache import store_directory
from jaxllm.worker.image_encoder import ImageEncoder
from jaxllm.worker.input_batch import InputBatch
from jaxllm.worker.input_builder import InputBuilder, PreparedStep, StepRows
from jaxllm.worker.lora_manager import LoRAManager
from jaxllm.worker.step import StepOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunnerStats:
    """Cumulative accounting of executed steps (read by benchmarks; cheap to keep).

    host_seconds: building the step's inputs on the host (numpy) and dispatching the
    call; device_seconds: waiting for the sampled ids after dispatch (the device
    work not hidden behind host work; under async scheduling it also spans the next
    step's scheduling and dispatch, which run before the wait); post_seconds:
    recording the results.
    """

    num_steps: int = 0  # device calls
    num_model_steps: int = 0  # forward passes: a call of several decode steps counts those it ran
    num_tokens: int = 0  # real (scheduled) tokens
    num_padded_tokens: int = 0  # tokens of the buckets the steps ran in
    num_seqs: int = 0
    num_padded_seqs: int = 0
    num_common_prefix_steps: int = 0  # steps whose sequences all shared their first blocks
    host_seconds: float = 0.0
    device_seconds: float = 0.0
    post_seconds: float = 0.0
    # by (tokens, seqs), and (tokens, seqs, decode steps) for calls of several decode steps
    steps_per_bucket: dict = dataclasses.field(default_factory=dict)
    seconds_per_bucket: dict = dataclasses.field(default_factory=dict)  # host + device wait


def make_proposer(spec: SpeculativeConfig | None) -> NgramProposer | None:
    """The n-gram proposer where `spec` asks for one (a draft model's proposer needs its
    own runner: the engine builds it and hands it over, `ModelRunner.set_proposer`)."""
    if spec is None or spec.method != "ngram":
        return None
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens,
                         spec.short_match_tokens)


def _projection_formats(cfg: ModelConfig) -> str:
    """The projections' formats as declared (jaxllm.models.formats): one, or a mixed
    GGUF's count of each."""
    decls = declare(cfg)
    counts = collections.Counter(declared_format(d).describe(d) for d in jax.tree.leaves(
        (decls.layers, decls.lm_head), is_leaf=lambda x: isinstance(x, ParamDecl)) if len(d.shape) > 1)
    if len(counts) == 1:
        return next(iter(counts))
    return f"{cfg.quantization}: " + ", ".join(f"{n} {fmt}" for fmt, n in counts.most_common())


@dataclasses.dataclass
class DispatchedStep:
    """A step called but not yet waited for (`ModelRunner.dispatch`; `collect` waits)."""

    step: PreparedStep
    out: StepOutput | LoopOutput
    started: float  # perf_counter() before its inputs were built
    dispatched: float  # and once the call returned
    # each row's logprobs / prompt_logprobs setting when dispatched (its row may hold
    # another request by the time the results are recorded)
    logprobs: Int[np.ndarray, " S"]
    prompt_logprobs: Int[np.ndarray, " S"]
    num_removed: int  # InputBatch.num_removed then: while it is unchanged, every row holds its request


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """What a model runner is built for, besides its model: the engine makes one from
    its EngineConfig (jaxllm.engine.core.runner_config) and passes it whole.

    `num_blocks` KV cache blocks of `block_size` tokens; steps of at most
    `max_num_seqs` sequences and `max_num_batched_tokens` tokens, padded to buckets.
    Each bucket's step runs the attention and linear backends of the runner's plan
    (measured per bucket where `auto` leaves a choice: jaxllm.worker.autotune); for the
    `cpu` linear backend the runner keeps the projection weights packed
    (jaxllm.models.linear), a copy of what it is given, and both layouts if some buckets
    use each. Compiled executables and the plan are stored under `cache_dir` (the
    engine's compilation cache; None: compile and measure every start). With
    `tensor_parallel_size` > 1 the step runs over a mesh of that many devices
    (jaxllm.models.parallel): weights and KV cache sharded, the rest replicated; the
    backends are measured on one shard's shapes. With `pipeline_parallel_size` > 1
    over a (stage, model) mesh of both sizes (jaxllm.models.pipeline): each stage's
    layers and KV cache slots on its devices. The KV cache holds `kv_cache_dtype`
    (the engine resolves its auto: jaxllm.attention.kv_cache.choose_kv_cache_format). `activation_quantization`
    "int8" ("int16"): the projections kept in blocks multiply int8 (int16) inputs
    (jaxllm.models.linear.quantized_activations); a model with none is refused. "auto":
    int16 where the cpu kernel multiplies those in integer dot products, else float
    (jaxllm.models.linear.auto_activation_quantization); "none": float.
    `hybrid_kv_cache`: a model mixing sliding and full layers keeps a block table per KV
    cache group (jaxllm.kv_cache_groups), as the engine's HybridKVCacheManager allocates
    them. `async_scheduling`: a step may be dispatched before the one before it is
    collected (its unknown tokens read on the device). `num_scheduler_steps` > 1: the
    multi-step decode loop is compiled for that many steps (jaxllm.worker.decode_loop)
    and run where the scheduler hands over several. `speculative_config`: after each
    step the runner proposes draft tokens for the requests that gained one
    (`ModelRunnerOutput.spec_token_ids`), and a step verifies the drafts the scheduler
    gives back: every position of a drafted row samples as a decode at that position
    would (same uniform, same history), and the drafts are accepted while they agree
    (`ModelRunner._verify`). `lora_config`: LoRA adapters in device slots, each
    request's applied to its tokens (jaxllm.worker.lora_manager)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    cache_dir: Path | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    kv_layer_scales: bool = False  # fp8: a scale per layer and KV head (jaxllm.attention.kv_cache)
    activation_quantization: str = "none"  # EngineConfig's, None already read as "none" there
    batch_invariant: bool = False  # EngineConfig's (its backends already resolved to cpu there)
    hybrid_kv_cache: bool = True
    async_scheduling: bool = False
    num_scheduler_steps: int = 1
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None
    # a vision-language model's encoder cache (jaxllm.worker.image_encoder): its slots, and
    # the images one step may encode
    encoder_cache_slots: int = 0
    max_images_per_step: int = 0
    # called before the backends are measured (never when a stored plan serves): the
    # engine waits there for the weights it loads on a thread
    before_measuring: Callable[[], object] | None = None


# why activation_quantization "auto" took what it did (the start-up line)
AUTO_WHY = {"bfloat16": "this CPU has AMX", "int16": "this CPU's kernels have integer dot products"}


class ModelRunner:
    def __init__(self, config: ModelConfig, params: ModelParams, runner_config: RunnerConfig) -> None:
        """`params` may be abstract (jax.ShapeDtypeStruct leaves): compiling and
        loading the buckets needs only shapes; `set_params` gives the weights before
        the first step. What the runner is built for: `runner_config` (RunnerConfig)."""
        rc = self.runner_config = runner_config
        block_size, max_model_len, max_num_seqs = rc.block_size, rc.max_model_len, rc.max_num_seqs
        speculative_config, lora_config, cache_dir = rc.speculative_config, rc.lora_config, rc.cache_dir
        tensor_parallel_size, async_scheduling = rc.tensor_parallel_size, rc.async_scheduling
        self.config = config
        self.async_scheduling = async_scheduling
        self.kv_groups = config.kv_cache_groups(rc.hybrid_kv_cache)
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pp = rc.pipeline_parallel_size
        self.stages = pipeline.StagePlan(config.num_layers, pp)
        self.mesh = (pipeline.make_mesh(pp, tensor_parallel_size) if pp > 1 else
                     parallel.make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None)
        if rc.batch_invariant and (config.vision is not None or any(map(config.is_moe, range(config.num_layers)))):
            raise ValueError("batch_invariant: not yet for vision-language or mixture-of-experts models")
        param_dtype = self.param_dtype = params.final_norm.dtype  # a float parameter whatever is quantized
        dtype = activation_dtype(param_dtype)  # of the hidden states
        self.kv_format = dataclasses.replace(kv_cache_format(rc.kv_cache_dtype, param_dtype),
                                             layer_scaled=rc.kv_layer_scales)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.shapes = StepShapes.make(rc.max_num_batched_tokens, max_num_seqs, speculative_config is not None,
                                      rc.num_scheduler_steps)
        self.speculative_config = speculative_config
        self.proposer = make_proposer(speculative_config)
        self.num_scheduler_steps = rc.num_scheduler_steps
        if jax.process_count() > 1:  # every process must run the same plan: no timings (they differ), no store
            cache_dir = None
        self._auto_activations = rc.activation_quantization == "auto"
        self.plan = self._make_plan(rc.attention_backend, rc.linear_backend, param_dtype, dtype, cache_dir,
                                    blocks_in_bf16=self._blocks_in_bf16(rc.activation_quantization, param_dtype),
                                    float32_steps=self._auto_activations,
                                    blocks_in_int16=self._auto_activations and self._blocks_in_int16(param_dtype))
        self.activation_quantization = self._activation_quantization(rc.activation_quantization, params)
        rank = 0 if lora_config is None else lora_config.max_lora_rank
        if rank and "pallas" in self.plan.backends("linear") and (rank < 16 or rank & (rank - 1)):
            raise ValueError(f"max_lora_rank: the pallas linear backend's LoRA kernels need a power of two >= 16, "
                             f"got {rank}")
        # the adapters in the activations' dtype: their products take the hidden states as they are
        self.lora = None if lora_config is None else LoRAManager(config, lora_config, dtype, self.mesh)
        self.images = None if config.vision is None else ImageEncoder(
            config.vision, rc.encoder_cache_slots, rc.max_images_per_step, dtype, param_dtype)
        self._given = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.weights = self._layout(params)
        self._tiled: dict[StepBackends, ModelParams] = {}  # weights_of
        self._asleep_weights = self._asleep_scales = None  # what sleep kept on the host
        self._start_kv_caches(rc.num_blocks)
        # Token ids per request row (for penalties); the extra last row takes padding.
        self.history = jnp.zeros((max_num_seqs + 1, max_model_len), jnp.int32)
        if self.mesh:
            self.history = jax.device_put(self.history, parallel.replicated(self.mesh))
        self.rope = model_rope_table(config, max_model_len)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_seq, self.kv_groups.num_groups)
        self.bitmask_width = bitmask_width(config.vocab_size)
        self.inputs = InputBuilder(self.input_batch, self.shapes, self.kv_groups, block_size=block_size,
                                   max_model_len=max_model_len, async_scheduling=async_scheduling,
                                   with_lora=self.lora is not None, bitmask_width=self.bitmask_width,
                                   num_scheduler_steps=rc.num_scheduler_steps,
                                   tokens_per_image=0 if config.vision is None else config.vision.tokens_per_image,
                                   image_blocks=rc.max_images_per_step if config.vision is not None
                                   and config.vision.bidirectional_images else 0)
        self._set_history_row = jax.jit(lambda h, row, tokens: h.at[row].set(tokens), donate_argnums=(0,))
        self.compilation = CompilationManager(self, cache_dir)
        self.stats = RunnerStats()

    def _blocks_in_bf16(self, requested: str, param_dtype) -> bool:
        """Whether the projections kept in blocks may multiply in bfloat16 though the
        model is float32 (activation_quantization bfloat16, or auto where it means that
        here): the plan then measures the kernel's bfloat16 tiles for them."""
        if self.config.quantization is None or jnp.dtype(param_dtype) != jnp.float32:
            return False
        return (auto_activations() if requested == "auto" else requested) == "bfloat16"

    def _blocks_in_int16(self, param_dtype) -> bool:
        """Whether activation_quantization auto means int16 for the projections kept in
        blocks here (a float32 model, kernels with integer dot products but no AMX): the
        plan then times them so, and where the kernels have vdpbf16ps, in bfloat16 from the
        same arrays too (BF16_STEP)."""
        return (self.config.quantization is not None and jnp.dtype(param_dtype) == jnp.float32
                and auto_activations() == "int16")

    def _make_plan(self, attention_backend: str, linear_backend: str, param_dtype, dtype,
                   cache_dir: Path | None, blocks_in_bf16: bool = False, float32_steps: bool = False,
                   blocks_in_int16: bool = False) -> BackendPlan:
        """The backends of each bucket: measured on one shard's shapes where `auto`
        leaves a choice, except over several processes (their timings would differ, and
        the plans must agree: the first candidate). `float32_steps`: kept blocks that
        auto put in bfloat16 may multiply in float32 at the buckets where that is faster;
        `blocks_in_int16`: kept blocks that auto puts in int16 may multiply in bfloat16."""
        attention = attention_candidates(attention_backend, head_dim=self.config.head_dim, dtype=dtype,
                                         cache_dtype=self.kv_format.dtype, block_size=self.block_size,
                                         heads=(self.config.num_heads, self.config.num_kv_heads))
        linear = linear_candidates(linear_backend, param_dtype, tensor_parallel=self.mesh is not None,
                                   quantized=self.config.quantization is not None)
        tiles = None  # measured where the kernels hold both bfloat16 paths
        if jax.process_count() > 1:
            attention, linear, tiles = attention[:1], linear[:1], [INT16_STEP if blocks_in_int16 else "dot"]
        return backend_plan(parallel.shard_config(self.config, self.tensor_parallel_size), param_dtype,
                            [(t, seq_bucket(self.max_num_seqs, t)) for t in self.shapes.token_counts], attention,
                            linear,
                            activation_dtype=dtype, block_size=self.block_size, max_model_len=self.max_model_len,
                            store_dir=store_directory(cache_dir), kv_format=self.kv_format, bf16_tiles=tiles,
                            before_measuring=self.runner_config.before_measuring, blocks_in_bf16=blocks_in_bf16,
                            float32_steps=float32_steps, blocks_in_int16=blocks_in_int16)

    def _activation_quantization(self, requested: str, params: ModelParams) -> str | None:
        """What the projections kept in blocks multiply (None: float): `requested`, or
        what "auto" means for these weights on this plan's backends."""
        if requested == "auto":
            return auto_activation_quantization(params, self.plan.backends("linear"), self.plan.head,
                                                self.param_dtype)
        if requested == "none":
            return None
        if "pallas" in self.plan.backends("linear"):
            raise ValueError("activation_quantization: not with linear_backend 'pallas' (its kernel multiplies "
                             "float inputs); use cpu or xla")
        return requested

    def _start_kv_caches(self, num_blocks: int) -> None:
        """The KV caches (2 GiB by default: a second of page faults) are zero-filled on
        a background thread while warm_up loads or compiles the buckets, which only need
        their shapes (`_abstract_caches`); the first use of `kv_caches` waits for them."""
        cfg = self.config
        kv_heads = parallel.cache_kv_heads(cfg, self.tensor_parallel_size)
        shardings = self._cache_shardings()
        if self.pipeline_parallel_size > 1:  # each stage's local slots, stacked by stage
            local = cache_shapes(self.kv_format, len(shardings), num_blocks, self.block_size, kv_heads, cfg.head_dim)
            self._abstract_caches = pipeline.staged_cache_shapes(local, self.pipeline_parallel_size, shardings[0])
        else:
            self._abstract_caches = cache_shapes(self.kv_format, self.kv_groups.group_size, num_blocks,
                                                 self.block_size, kv_heads, cfg.head_dim,
                                                 shardings[0] if shardings else None)
        self._kv_caches = None
        self._kv_caches_future = concurrent.futures.ThreadPoolExecutor(1, "kv-alloc").submit(
            allocate_kv_caches, self._abstract_caches)

    def set_kv_layer_scales(self, k: np.ndarray, v: np.ndarray) -> None:
        """A layer-scaled fp8 cache's scales (a checkpoint's, one per layer): each cache
        array (slot) takes the largest of its layers' (a hybrid cache's slot serves a
        layer of each group), for every KV head."""
        def scale(values: np.ndarray, layers: list[int], like: jax.Array) -> jax.Array:
            return jax.device_put(np.full(like.shape, values[layers].max(), np.float32), like.sharding)

        caches = list(self.kv_caches)
        for slot, cache in enumerate(caches):
            layers = [i for i in range(self.config.num_layers) if self.kv_groups.slot_of(i) == slot]
            caches[slot] = dataclasses.replace(cache, k_layer_scale=scale(k, layers, cache.k_layer_scale),
                                               v_layer_scale=scale(v, layers, cache.v_layer_scale))
        self.kv_caches = tuple(caches)

    def _cache_shardings(self) -> tuple[KVCache, ...] | None:
        """The KV caches' shardings over the mesh, per cache array (None: one device)."""
        if self.mesh is None:
            return None
        if self.pipeline_parallel_size > 1:
            slots = pipeline.cache_slots(self.stages, self.kv_groups).count
            return (pipeline.kv_cache_sharding(self.mesh, self.kv_format),) * slots
        return (parallel.kv_cache_sharding(self.mesh, self.kv_format),) * self.kv_groups.group_size

    def param_shardings(self) -> ModelParams:
        """The weights' shardings over the mesh (by stage, then by head)."""
        if self.pipeline_parallel_size > 1:
            return pipeline.param_shardings(self.config, self.mesh)
        return parallel.param_shardings(self.config, self.mesh)

    @property
    def kv_caches(self) -> tuple[KVCache, ...]:
        if self._kv_caches_future is not None:
            self._kv_caches = self._kv_caches_future.result()
            self._kv_caches_future = None
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: tuple[KVCache, ...]) -> None:
        self._kv_caches, self._kv_caches_future = caches, None

    def set_params(self, params: ModelParams | dict[str, ModelParams]) -> None:
        """The weights, as loaded (of exactly the shapes and dtypes the runner was built
        for) or as `layout_params` returned them."""
        if not isinstance(params, dict):
            params = {"cpu": params} if self.laid_out(params) else self.layout_params(params)
        elif set(params) != set(self.plan.backends("linear")):
            raise ValueError(f"set_params: laid-out weights for {sorted(params)}, the plan uses "
                             f"{self.plan.backends('linear')}")
        self.weights = params
        self._tiled = {}

    def weights_of(self, choice: StepBackends) -> ModelParams:
        """The weights a bucket's step takes: its linear backend's layout, its packed
        weights summing bfloat16 with the tiles the plan chose for it (the same
        arrays)."""
        if choice.bf16_tiles == "dot":
            return self.weights[choice.linear]
        if choice not in self._tiled:
            self._tiled[choice] = bf16_tiles(self.weights[choice.linear], choice.bf16_tiles)
        return self._tiled[choice]

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int) -> None:
        """Give the device memory back: the KV caches are freed; the weights are copied
        to host memory first (level 1) or dropped (level 2: new ones come with
        set_params); arrays the caller also holds stay valid (theirs to free). The
        executables stay: waking compiles nothing."""
        caches = self.kv_caches
        self._asleep_scales = jax.device_get([(c.k_layer_scale, c.v_layer_scale) for c in caches]) \
            if self.kv_format.layer_scaled else None  # (a checkpoint's, or calculated: kept with the weights)
        leaves, tree = jax.tree.flatten(self.weights)
        unique = {id(a): a for a in leaves}  # the layouts share arrays (norms, the embedding): kept shared
        self._asleep_weights = None
        if level == 1:
            host = {i: (np.asarray(jax.device_get(a)), a.sharding) for i, a in unique.items()}
            self._asleep_weights = (tree, [id(a) for a in leaves], host)
        for a in jax.tree.leaves(caches):  # the engine's own
            a.delete()
        # the weights are let go, not deleted: a trainer's arrays given to update_weights
        # are the very ones held (no copy), and stay the trainer's; the engine's own go
        # with their last reference
        self.weights, self._tiled, self._kv_caches = None, {}, None
        gc.collect()  # buffers held only by reference cycles go now, not at some later collection

    def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Back on the device: the weights a level-1 sleep kept, the KV caches zero-filled
        (their fp8 scales as they were)."""
        if weights and self.weights is None and self._asleep_weights is not None:
            tree, ids, host = self._asleep_weights
            placed = {i: jax.device_put(array, sharding) for i, (array, sharding) in host.items()}
            self.weights, self._asleep_weights = jax.tree.unflatten(tree, [placed[i] for i in ids]), None
        if kv_cache and self._kv_caches is None and self._kv_caches_future is None:
            caches = allocate_kv_caches(self._abstract_caches)
            if self._asleep_scales is not None:
                caches = tuple(dataclasses.replace(c, k_layer_scale=jax.device_put(k, c.k_layer_scale.sharding),
                                                   v_layer_scale=jax.device_put(v, c.v_layer_scale.sharding))
                               for c, (k, v) in zip(caches, self._asleep_scales))
            self.kv_caches = caches

    @property
    def asleep(self) -> tuple[bool, bool]:
        """(weights, KV caches) given back and not yet woken."""
        return self.weights is None, self._kv_caches is None and self._kv_caches_future is None

    def laid_out(self, params: ModelParams) -> bool:
        """Whether `params` are already the one layout this runner holds: the cpu
        backend's panels of float weights (jaxllm.models.linear.pack_params), which a
        trainer may keep as its own parameters; set_params then takes them as they are,
        with no copy."""
        if self.plan.backends("linear") != ["cpu"] or self.mesh is not None or self.activation_quantization \
                or jnp.dtype(self.param_dtype) != jnp.float32 or self.config.quantization is not None:
            return False
        return weights_mismatch(params, layout_params("cpu", self._given, pack_head=self.plan.head == "cpu")) is None

    def weights_mismatch(self, params: ModelParams) -> str | None:
        """Where `params` differs from the weights the steps were compiled for (None: fits)."""
        return weights_mismatch(params, self._given)

    def layout_params(self, params: ModelParams) -> dict[str, ModelParams]:
        """Loaded `params` checked against the shapes the step was compiled for and laid
        out for each linear backend the plan uses (packed for `cpu`). Touches no runner
        state: the engine calls it on its loading thread while the executables load."""
        mismatch = self.weights_mismatch(params)
        if mismatch is not None:
            raise ValueError(f"weights: {mismatch}")
        return self._layout(params)

    def _layout(self, params: ModelParams) -> dict[str, ModelParams]:
        """The weights in the layout of each linear backend some bucket uses (quantized
        ones multiplied as the model's dtype: `in_dtype`)."""
        params = in_dtype(params, self.param_dtype)
        if self.activation_quantization:
            params, self.quantized_projections = quantized_activations(params, self.activation_quantization)
            if not self.quantized_projections:
                raise ValueError(f"activation_quantization {self.activation_quantization!r}: the model has no "
                                 "projection kept in blocks of 32 "
                                 "inputs (Q4_0, Q4_1, Q8_0, int4); quantize it (quantization q4_1, q8_0, int4...) "
                                 "or leave activations in float")
        if self.pipeline_parallel_size > 1:  # plain weights only (linear_candidates)
            return {"xla": pipeline.place_params(self.config, params, self.mesh)}
        if self.mesh is not None:
            return {"xla": parallel.place_params(self.config, params, self.mesh)}
        return {b: layout_params(b, params, pack_head=self.plan.head == "cpu", activation_dtype=activation_dtype(
            self.param_dtype)) for b in self.plan.backends("linear")}

    def describe_weights(self) -> str:
        """The parameters' bytes per device as held (every layout the plan keeps), and
        their quantization."""
        leaves = jax.tree.leaves(self.weights)
        if self.mesh is not None and all(isinstance(leaf, jax.Array) for leaf in leaves):
            held = sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)  # the first device's share
        else:
            held = sum(param_bytes(p) for p in self.weights.values()) // max(1, self.tensor_parallel_size)
        cfg = self.config
        embed = f", embedding {cfg.embed_quantization}" if cfg.embed_quantization else ""
        acts = (f", {self.activation_quantization} activations into {self.quantized_projections} projections"
                + (f" (auto: {AUTO_WHY[self.activation_quantization]}; activation_quantization none: float)"
                   if self._auto_activations else "")
                if self.activation_quantization else "")
        where = ""
        if self.pipeline_parallel_size > 1:
            bounds = ", ".join(f"{a}-{b - 1}" for a, b in self.stages.bounds)
            where = f" a device; {self.pipeline_parallel_size} stages of layers {bounds}"
        elif self.mesh is not None:
            where = " a device"
        return f"{held / 2**20:.0f} MiB{where} ({_projection_formats(cfg)}{embed}{acts})"

    def describe_backends(self) -> str:
        head = f"; output projection {self.plan.describe_head()}" if "cpu" in self.plan.backends("linear") else ""
        return (f"attention {self.plan.describe('attention')}; linear {self.plan.describe('linear')}{head}"
                f"{self.plan.describe_tiles()}")

    def warm_up(self, progress: bool = True) -> float:
        """Load or compile every step shape (jaxllm.worker.compilation) while the KV
        caches are allocated; returns the seconds it took."""
        start = time.perf_counter()
        self.compilation.warm_up(progress)
        jax.block_until_ready(self.kv_caches)
        return time.perf_counter() - start

    @property
    def warmed_up(self) -> bool:
        return self.compilation.warmed_up

    @property
    def num_compilations_after_warmup(self) -> int:
        """Steps that compiled their shape after warm-up: a bug (logged)."""
        return self.compilation.num_compilations_after_warmup

    @property
    def num_loaded_executables(self) -> int:
        """Executables warm-up loaded from the store rather than compiled."""
        return self.compilation.num_loaded_executables

    def _lora_args(self, abstract: bool = False) -> tuple:
        """The step's adapter slots argument: none without LoRA."""
        if self.lora is None:
            return ()
        return (self.lora.abstract if abstract else self.lora.weights,)

    def step_extras(self, shape: StepShape, abstract: bool = False) -> tuple:
        """The arguments after the inputs of `shape`'s executable: the adapter slots
        (with LoRA), then a vision-language model's image table (a single step's: a
        decode loop reads no image)."""
        if self.images is None or shape.decode_steps > 1:
            return self._lora_args(abstract)
        table = self.images.table
        table = jax.ShapeDtypeStruct(table.shape, table.dtype) if abstract else table
        lora = self._lora_args(abstract) or (None,)  # the table is the argument after the adapter slots
        return (*lora, table)

    def set_vision_params(self, params) -> None:
        """A vision-language model's image side (jaxllm.models.vision_params)."""
        self.images.params = params

    def apply_block_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy the K/V of whole blocks (source, destination), all sources of a call read
        first; more copies than the largest bucket (forked beams of several KV cache
        groups) in calls of that many, in order (the scheduler lists forks' copies, whose
        sources may be handed out again this step, before admissions')."""
        largest = self.compilation.copy_buckets[-1]
        for start in range(0, len(copies), largest):
            chunk = copies[start:start + largest]
            c = smallest_at_least(self.compilation.copy_buckets, len(chunk))
            pairs = np.zeros((2, c), np.int32)
            pairs[:, :len(chunk)] = np.asarray(chunk, np.int32).reshape(-1, 2).T
            self.kv_caches = self.compilation.copy_executable(c)(self.kv_caches, pairs[0], pairs[1])

    @property
    def buckets(self) -> tuple[StepShape, ...]:
        """The single steps' shapes."""
        return self.shapes.single

    @property
    def loop_buckets(self) -> tuple[StepShape, ...]:
        """The multi-step decode loop's shapes (none without it)."""
        return self.shapes.loops

    # ---------------------------------------------------------------- state

    def _update_states(self, sched: SchedulerOutput) -> None:
        left, added = self.input_batch.update(sched)
        if self.lora is not None:
            for req_id in left:
                self.lora.release(req_id)
        if self.proposer is not None:
            self.proposer.remove_requests(left)
        for row, req in added:
            if self.lora is not None:
                self.input_batch.lora_slot[row] = self.lora.acquire(req.req_id, req.lora_request)
            if req.sampling_params.uses_penalties:  # prefix hits never pass through the step
                self.history = self._set_history_row(self.history, row, self.input_batch.token_ids[row])

    # --------------------------------------------------------------- execute

    def execute_model(self, sched: SchedulerOutput, bitmask: Int[np.ndarray, "R W"] | None = None,
                      ) -> ModelRunnerOutput:
        """Run one step; `bitmask`: the structured-output token bitmask of the step's
        sample rows (`num_scheduled_tokens`' order, a drafted request's 1 + drafts rows
        in turn; None: no row is constrained)."""
        return self.collect(self.dispatch(sched, bitmask))

    def dispatch(self, sched: SchedulerOutput, bitmask: Int[np.ndarray, "R W"] | None = None,
                 ) -> DispatchedStep | None:
        """Call one step without waiting for it (None: nothing scheduled). Under async
        scheduling the rows count its tokens at once (`_advance_rows`), so the next step
        can be dispatched before this one's ids are known: it reads them from the history."""
        self._update_states(sched)
        if sched.is_empty:
            return None
        t0 = time.perf_counter()
        if sched.block_copies:
            self.apply_block_copies(sched.block_copies)
        if sched.encoder_inputs:
            self.images.encode(sched.encoder_inputs)
        step = self.prepare_step(sched, bitmask)
        out = self._call(step)
        b = self.input_batch
        flight = DispatchedStep(step, out, t0, time.perf_counter(), b.logprobs[step.host.rows],
                                b.prompt_logprobs[step.host.rows], b.num_removed)  # copies (fancy indexing)
        if self.async_scheduling:
            self._advance_rows(step)
        return flight

    def _call(self, step: PreparedStep) -> StepOutput | LoopOutput:
        """Call the step's executable on its inputs packed into one buffer; returns
        without waiting. The buffer (and a constrained step's bitmask) is the step's one
        transfer, allowed here alone (the tests run the hot path under
        jax.transfer_guard("disallow")) and converted by the call itself, which costs
        less than an explicit jax.device_put (docs/bench-log/2026-11-22..29-cpu-serving.md)."""
        packed, separate = self.compilation.layout(step.shape).pack(step.inputs)
        with jax.transfer_guard_host_to_device("allow"):
            return self._run(step, packed, separate)

    def _run(self, step: PreparedStep, packed, separate: list) -> StepOutput | LoopOutput:
        """Run the step's executable on packed inputs (the caches and history it returns
        replace the donated ones)."""
        executable = self.compilation.get(step.shape)
        weights = self.weights_of(self.plan.for_bucket(step.shape.tokens))
        self.kv_caches, self.history, out = executable(weights, self.rope, self.kv_caches, self.history, packed,
                                                       *separate, *self.step_extras(step.shape))
        return out

    def time_step_alone(self, step: PreparedStep, reps: int) -> float:
        """The median seconds of `step`'s executable called back to back with its inputs
        already on the device: the device's share of a step (scripts/bench_host.py).
        Runs the step `reps` times over the live caches: for benchmarks only."""
        packed, separate = jax.device_put(self.compilation.layout(step.shape).pack(step.inputs))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(self._run(step, packed, separate))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def collect(self, flight: DispatchedStep | None) -> ModelRunnerOutput:
        """Wait for a dispatched step and record its results."""
        if flight is None:
            return ModelRunnerOutput([], [])
        step, out = flight.step, flight.out
        if isinstance(out, LoopOutput):
            with jax.transfer_guard_device_to_host("allow"):  # the loop's read-backs
                ids, counts, num_steps = jax.device_get((out.sampled.token_ids, out.num_tokens, out.num_steps))
            t2 = time.perf_counter()
            result = self._record_loop(flight, ids, counts[:len(step.host.rows)])
            self._account(step, flight.started, flight.dispatched, t2, int(num_steps))
            return result
        with jax.transfer_guard_device_to_host("allow"):  # the step's one read-back
            sampled = np.asarray(out.sampled.token_ids)[: len(step.host.logit_rows)]
        t2 = time.perf_counter()
        result = self._record_ids(flight, sampled) if self.async_scheduling else self._record(flight, sampled)
        self._account(step, flight.started, flight.dispatched, t2)
        return result

    def _record_loop(self, flight: DispatchedStep, ids: Int[np.ndarray, "K S"], counts: Int[np.ndarray, " N"]
                     ) -> ModelRunnerOutput:
        """Record a decode loop's tokens: row i's are ids[:counts[i], i]. Under async
        scheduling the rows counted them at dispatch (`_advance_rows`), and only the
        rows still holding their requests take their ids."""
        b, host = self.input_batch, flight.step.host
        n, width = len(host.rows), ids.shape[1]  # the step's rows; the bucket's sequences
        if self.async_scheduling:
            owned = self._owned(flight, np.arange(n))
            b.record_known(host.rows[owned], host.seq_lens[owned], ids[:, :n][:, owned], counts[owned])
        else:
            b.record_loop(host.rows, host.seq_lens, ids[:, :n], counts)
        tokens = [col[:c] for col, c in zip(ids[:, :n].T.tolist(), counts.tolist())]
        kept = ([i + width * np.arange(c) for i, c in enumerate(counts)] if flight.step.step_inputs.sampling.any_logprobs
                else None)  # sample rows of ids.reshape(-1), for the logprobs
        return self._results(flight, ids.reshape(-1), kept, tokens)

    def _owned(self, flight: DispatchedStep, idx: Int[np.ndarray, " N"]) -> Bool[np.ndarray, " N"]:
        """Which of the step's rows `idx` still hold the requests they held at dispatch."""
        b, step = self.input_batch, flight.step
        if b.num_removed == flight.num_removed:  # no request left: the rows are as they were
            return np.ones(len(idx), bool)
        return np.fromiter((b.row_of.get(step.req_ids[i]) == step.host.rows[i] for i in idx), bool, len(idx))

    def prepare_step(self, sched: SchedulerOutput, bitmask: Int[np.ndarray, "R W"] | None = None) -> PreparedStep:
        """The step's bucket-shaped inputs from the rows' host state (jaxllm.worker.input_builder)."""
        return self.inputs.prepare_step(sched, bitmask)

    def _verify(self, host: StepRows, sampled: Int[np.ndarray, " R"]) -> list[Int[np.ndarray, " N"]]:
        """Per row, the sample rows whose tokens it gains: none if it does not sample;
        else its drafts while the target's token at each position equals the draft
        there, then the target's token at the first that differs (or after the last).
        Each position sampled as a decode would have, so the tokens gained are those
        decoding would give, whatever the drafts (and a seeded request's the same)."""
        first = np.cumsum(host.num_drafts + 1) - host.num_drafts - 1
        if not host.num_drafts.any():
            return [first[i:i + 1] if ok else first[:0] for i, ok in enumerate(host.samples)]
        b, kept = self.input_batch, []
        for i, (row, k, ok) in enumerate(zip(host.rows, host.num_drafts, host.samples)):
            if not ok:
                kept.append(first[:0])
                continue
            start = b.num_tokens[row]
            differ = np.flatnonzero(sampled[first[i]:first[i] + k] != b.token_ids[row, start:start + k])
            accepted = differ[0] if differ.size else k
            kept.append(np.arange(first[i], first[i] + accepted + 1))
        return kept

    def _advance_rows(self, step: PreparedStep) -> None:
        """Async scheduling, at dispatch: the rows count the step's tokens now."""
        host = step.host
        self.input_batch.count_in_flight(host.rows, host.samples, host.seq_lens, host.decode_steps)

    def _record_ids(self, flight: DispatchedStep, sampled: np.ndarray) -> ModelRunnerOutput:
        """Async scheduling, at collect: the sampled ids into the rows that still hold
        their requests (counted at dispatch); the runner's output."""
        host = flight.step.host
        idx = np.flatnonzero(host.samples)  # no drafts: row i's one sample row is i
        owned = idx[self._owned(flight, idx)]
        self.input_batch.record_known(host.rows[owned], host.seq_lens[owned], sampled[None, owned],
                                      np.ones(len(owned), np.int32))
        return self._results(flight, sampled, self._verify(host, sampled))

    def _results(self, flight: DispatchedStep, sampled: np.ndarray, kept: list | None,
                 tokens: list[list[int]] | None = None) -> ModelRunnerOutput:
        """The runner's output: each row's kept tokens (`tokens`, or those of its sample
        rows `kept`, which the logprobs need), with the logprobs asked."""
        step, out, host = flight.step, flight.out, flight.step.host
        result = ModelRunnerOutput(step.req_ids, tokens if tokens is not None else [sampled[k].tolist() for k in kept])
        if step.step_inputs.sampling.any_logprobs:
            self._collect_logprobs(result, out, flight.logprobs, kept)
        if step.step_inputs.sampling.any_beam:
            self._collect_beam_candidates(result, out, host.rows, kept)
        if step.step_inputs.any_prompt_logprobs:
            self._collect_prompt_logprobs(result, out, flight.prompt_logprobs, host.qsl, host.targets)
        return result

    def _record(self, flight: DispatchedStep, sampled: np.ndarray) -> ModelRunnerOutput:
        """Advance the rows' host state by the step's results; the runner's output."""
        host = flight.step.host
        kept = self._verify(host, sampled)
        num_kept = np.fromiter(map(len, kept), np.int32, len(kept))
        last = sampled[[k[-1] for k, ok in zip(kept, host.samples) if ok]].astype(np.int32)
        self.input_batch.record_step(host.rows, host.samples, host.seq_lens, num_kept, last)
        result = self._results(flight, sampled, kept)
        self._propose(result)
        return result

    def _propose(self, result: ModelRunnerOutput) -> None:
        """Draft tokens for the next step of each request that gained tokens, while
        fewer requests run than `disable_by_batch_size`."""
        limit = None if self.proposer is None else self.speculative_config.disable_by_batch_size
        if self.proposer is None or (limit is not None and len(self.input_batch) >= limit):
            return
        gained = [r for r, tokens in zip(result.req_ids, result.sampled_token_ids) if tokens]
        result.spec_token_ids.update(self.proposer.propose_batch(self.input_batch, gained, self.max_model_len))

    def set_proposer(self, proposer) -> None:
        """The proposer of draft tokens (`propose_batch(input_batch, req_ids,
        max_model_len)`, `remove_requests(req_ids)`), for speculative decoding with a
        draft model."""
        if self.speculative_config is None:
            raise ValueError("set_proposer: the runner was built without a speculative_config")
        self.proposer = proposer

    def rewind(self, req_id: str, num_computed: int, tokens: Int[np.ndarray, " N"]) -> None:
        """A draft model's runner: the request's K/V counts as computed up to
        `num_computed` (the draft tokens it sampled after that are forgotten) and
        `tokens` follow there, as known."""
        b = self.input_batch
        row = b.row_of[req_id]
        b.num_computed_tokens[row] = num_computed
        b.token_ids[row, num_computed:num_computed + len(tokens)] = tokens
        b.num_tokens[row] = b.num_known[row] = num_computed + len(tokens)

    def _account(self, step: PreparedStep, t0: float, t1: float, t2: float, num_model_steps: int = 1) -> None:
        st = self.stats
        st.num_steps += 1
        st.num_model_steps += num_model_steps
        st.num_tokens += step.host.num_tokens
        st.num_padded_tokens += step.t
        st.num_seqs += len(step.host.rows)
        st.num_padded_seqs += step.s
        attn = step.step_inputs.attn
        attn = attn if isinstance(attn, tuple) else (attn,)
        st.num_common_prefix_steps += int(any(md.common_prefix_blocks > 0 for md in attn))
        key = (step.t, step.s) if step.shape.decode_steps == 1 else (step.t, step.s, step.shape.decode_steps)
        st.steps_per_bucket[key] = st.steps_per_bucket.get(key, 0) + 1
        st.seconds_per_bucket[key] = st.seconds_per_bucket.get(key, 0.0) + (t2 - t0)
        st.host_seconds += t1 - t0
        st.device_seconds += t2 - t1
        st.post_seconds += time.perf_counter() - t2

    def _collect_logprobs(self, result: ModelRunnerOutput, out: StepOutput | LoopOutput, ks, kept) -> None:
        """One logprob row per token a request gained (its sample rows `kept`; `ks`: the
        alternatives each row asked for, -1 for none)."""
        o = jax.device_get(out.sampled)
        if isinstance(out, LoopOutput):  # [K, S, ...] as K * S sample rows
            o = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), o)
        for req_id, k, idx in zip(result.req_ids, ks, kept):
            if k < 0 or not len(idx):
                continue
            result.logprobs[req_id] = LogprobsLists(
                token_ids=[[int(o.token_ids[j])] + o.top_token_ids[j, :k].tolist() for j in idx],
                logprobs=[[float(o.sampled_logprob[j])] + o.top_logprobs[j, :k].tolist() for j in idx],
                ranks=[int(o.sampled_rank[j]) for j in idx],
            )

    def _collect_beam_candidates(self, result: ModelRunnerOutput, out: StepOutput, rows, kept) -> None:
        """Each beam row that sampled: its best continuations, as many as its beam
        search ranks (jaxllm.core.beam_search)."""
        with jax.transfer_guard_device_to_host("allow"):
            ids, logprobs = jax.device_get((out.sampled.beam_token_ids, out.sampled.beam_logprobs))
        ks = self.input_batch.beam_candidates[rows]
        for req_id, k, idx in zip(result.req_ids, ks, kept):
            if k > 0 and len(idx):
                j = idx[-1]
                result.beam_candidates[req_id] = (ids[j, :k].tolist(), logprobs[j, :k].tolist())

    def _collect_prompt_logprobs(self, result: ModelRunnerOutput, out: StepOutput, ks, qsl, targets) -> None:
        o = jax.device_get(out.prompt_logprobs)
        for i, (req_id, k) in enumerate(zip(result.req_ids, ks)):
            idx = np.arange(qsl[i], qsl[i + 1])
            idx = idx[targets[idx] >= 0]
            if k < 0 or len(idx) == 0:
                continue
            result.prompt_logprobs[req_id] = LogprobsLists(
                token_ids=[[int(targets[j])] + o.top_token_ids[j, :k].tolist() for j in idx],
                logprobs=[[float(o.logprob[j])] + o.top_logprobs[j, :k].tolist() for j in idx],
                ranks=[int(o.rank[j]) for j in idx],
            )


def weights_mismatch(given: ModelParams, expected: ModelParams) -> str | None:
    """Where `given` differs from `expected`'s shapes and dtypes (the weights a runner's
    steps were compiled for): the first parameter's path with both; None when they agree."""
    g, g_tree = jax.tree_util.tree_flatten_with_path(given)
    e, e_tree = jax.tree_util.tree_flatten_with_path(expected)
    if g_tree != e_tree:
        return (f"not this model's parameter tree ({len(g)} arrays, the engine's {len(e)}): give the params of "
                "jaxllm.loaders.load_model for this model, or a mapping of its HF tensor names")
    for (path, a), (_, b) in zip(g, e):
        if tuple(a.shape) != tuple(b.shape) or jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
            return (f"{jax.tree_util.keystr(path)} is {jnp.dtype(a.dtype).name}{list(a.shape)}, the engine's "
                    f"{jnp.dtype(b.dtype).name}{list(b.shape)}")
    return None
