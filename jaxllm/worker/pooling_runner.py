"""The model runner of a pooling engine (`runner="pooling"`): each step computes whole
prompts and returns one vector per request (or one per token), no sampling, no KV
cache kept between steps.

The scheduler hands it new requests only (a pooling request is admitted with its whole
prompt and finishes in that step). Their tokens go into one flat batch padded to a
token bucket (jaxllm.worker.buckets), compiled for every bucket at start-up (or loaded
from the executable store). An encoder's forward (jaxllm.models.bert) attends within
each sequence; a decoder served as an embedder (`--convert embed`: Qwen3-Embedding,
gte-Qwen2, e5-mistral's way) runs its family's forward (jaxllm.models.llama) through a
paged cache it holds for the step only, causal as in generation, and its final norm.
The step pools every token's hidden state on the device (`pool`: each sequence's mean,
first or last token, or every token for ALL); on the host each request's vector is cut
to its `dimensions` and L2-normalized where it asks (float32, as sentence-transformers'
Normalize).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import time
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from jaxllm.attention.backends import AttentionFn, attention_candidates, get_attention_fn
from jaxllm.attention.kv_cache import KVCache, allocate_kv_caches, cache_shapes, kv_cache_format
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.core.sched_output import NewRequestData, SchedulerOutput
from jaxllm.messages import ModelRunnerOutput, PooledData
from jaxllm.models import bert, llama
from jaxllm.models.bert_params import BertLayerParams, BertParams
from jaxllm.models.linear import layout_params, linear_candidates, pack_weight
from jaxllm.models.params import ModelParams
from jaxllm.models.rope import RopeTable, model_rope_table
from jaxllm.platform import CompileHook, activation_dtype
from jaxllm.pooling_params import PoolerConfig
from jaxllm.worker.buckets import seq_bucket, token_buckets
from jaxllm.worker.compilation import load_or_compile, shapes_and_dtypes
from jaxllm.worker.executable_cache import ExecutableStore, store_directory

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolingRunnerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    pooler: PoolerConfig
    linear_backend: str = "auto"
    attention_backend: str = "auto"  # auto: the faster of the cpu kernel and XLA's, measured with the linear backend
    block_size: int = 16  # the step cache's blocks
    cache_dir: Path | None = None  # the executable store's (jaxllm.worker.executable_cache); None: compiled each start


def pool(hidden: Float[Array, "T D"], seg: Int[Array, " T"], starts: Int[Array, " S"], lens: Int[Array, " S"],
         pooling_type: str) -> Float[Array, "S D"] | Float[Array, "T D"]:
    """Each sequence's vector from its tokens' hidden states (float32): the mean over
    its tokens, its first token's ([CLS]) or its last's; ALL: every token's."""
    h = hidden.astype(jnp.float32)
    if pooling_type == "ALL":
        return h
    if pooling_type == "CLS":
        return h[starts]
    if pooling_type == "LAST":
        return h[starts + jnp.maximum(lens, 1) - 1]
    sums = jax.ops.segment_sum(h, seg, num_segments=starts.shape[0] + 1)[:-1]  # the last segment: padding
    return sums / jnp.maximum(lens, 1)[:, None].astype(jnp.float32)


@typing.no_type_check  # a pytree of host arrays (numpy) or abstract ones
@struct.dataclass
class PoolingInputs:
    """One step's flat batch of whole sequences, padded to a bucket of T tokens and S
    sequence rows: each token's id, position (from 0 in its sequence) and sequence
    (`seg`; padding tokens in the index S of their own); each sequence's first token
    and length; and for attention through a paged cache kept for the step only (a
    decoder's, an encoder's on the cpu kernel), where each token's K/V goes and each
    sequence's blocks."""

    token_ids: Int[Array, " T"]
    positions: Int[Array, " T"]
    seg: Int[Array, " T"]
    starts: Int[Array, " S"]
    lens: Int[Array, " S"]
    query_start_loc: Int[Array, " S+1"]
    slots: Int[Array, " T"]
    block_tables: Int[Array, "S MB"]
    num_seqs: Int[Array, ""]
    num_tokens: Int[Array, ""]


def metadata(x: PoolingInputs) -> AttentionMetadata:
    """The step's attention metadata: each sequence's tokens new, its blocks its own."""
    return AttentionMetadata(slot_mapping=x.slots, block_tables=x.block_tables, seq_lens=x.lens,
                             query_start_loc=x.query_start_loc, num_seqs=x.num_seqs,
                             common_prefix_blocks=jnp.zeros((), jnp.int32))


def encoder_step(params: BertParams, caches: tuple[KVCache, ...] | None, x: PoolingInputs, *, cfg: ModelConfig,
                 pooling_type: str, max_len: int
                 ) -> tuple[Float[Array, "S D"] | Float[Array, "T D"], tuple[KVCache, ...] | None]:
    """One step of an encoder: its last hidden states, pooled (the step caches of the
    `cpu` attention kernel, or None: XLA's)."""
    hidden, caches = bert.forward(params, cfg, x.token_ids, x.positions, jnp.zeros_like(x.token_ids), x.seg,
                                  x.num_tokens, max_len, caches, None if caches is None else metadata(x))
    return pool(hidden, x.seg, x.starts, x.lens, pooling_type), caches


def decoder_step(params: ModelParams, rope: RopeTable, caches: tuple[KVCache, ...], x: PoolingInputs, *,
                 cfg: ModelConfig, attention_fn: AttentionFn, pooling_type: str
                 ) -> tuple[Float[Array, "S D"] | Float[Array, "T D"], tuple[KVCache, ...]]:
    """One step of a decoder served as an embedder: every prompt prefilled through the
    family's forward (causal attention through the step's own cache blocks), its
    final-normed hidden states pooled (as transformers' `AutoModel` gives them)."""
    hidden, caches = llama.forward_hidden(params, rope, caches, x.token_ids, x.positions, metadata(x), cfg=cfg,
                                          attention_fn=attention_fn)
    normed = llama.rms_norm(hidden, params.final_norm, cfg.rms_norm_eps, cfg.norm_offset)
    return pool(normed, x.seg, x.starts, x.lens, pooling_type), caches


def pack_bert(params: BertParams) -> BertParams:
    """The encoder's projections packed for the `cpu` linear backend (abstract params too)."""
    def pack_layer(lp: BertLayerParams) -> BertLayerParams:
        return lp.replace(**{name: pack_weight(getattr(lp, name)) for name in ("wqkv", "wo", "w_in", "w_out")})

    return params.replace(layers=tuple(pack_layer(lp) for lp in params.layers))


def layout(params: BertParams | ModelParams, backend: str) -> BertParams | ModelParams:
    """A pooling model's weights as `backend` multiplies them: a decoder's without its
    output projection (nothing is sampled; a tied table stays the lookups' table)."""
    if isinstance(params, BertParams):
        return pack_bert(params) if backend == "cpu" else params
    return layout_params(backend, params.replace(lm_head=None), pack_head=False)


class PoolingRunner:
    def __init__(self, cfg: ModelConfig, params: BertParams | ModelParams, rc: PoolingRunnerConfig) -> None:
        """`params` as loaded (or abstract: warm_up or set_params gives the weights)."""
        self.config, self.rc = cfg, rc
        float_leaf = params.embed_norm if isinstance(params, BertParams) else params.final_norm
        self.dtype = float_leaf.dtype
        self.token_buckets = token_buckets(rc.max_num_batched_tokens)
        self.max_len = min(rc.max_model_len, rc.max_num_batched_tokens)
        linears = linear_candidates(rc.linear_backend, self.dtype, quantized=cfg.quantization is not None)
        attentions = attention_candidates(rc.attention_backend, head_dim=cfg.head_dim,
                                          dtype=activation_dtype(self.dtype),
                                          cache_dtype=kv_cache_format("auto", self.dtype).dtype,
                                          heads=(cfg.num_heads, cfg.num_kv_heads), block_size=rc.block_size)
        self.plans = [Plan(a, linear) for a in attentions for linear in linears]  # the candidates, preferred first
        self.plan = self.plans[0]
        self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.params = None if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct) else params
        self._compiled: dict[tuple[Plan, int], object] = {}
        # entered around each compile at first use, as the generating runner's (jaxllm.worker.compilation)
        self.while_compiling: CompileHook = contextlib.nullcontext
        self.measured: dict[Plan, float] = {}  # seconds per step of the largest bucket, by plan (auto)
        self.num_loaded_executables = 0
        self.lora = None  # no adapters on pooling models
        self._caches = {a: _StepCache.make(cfg, rc, self.dtype, a) for a in attentions}

    @property
    def step_cache(self) -> _StepCache:
        return self._caches[self.plan.attention]

    @property
    def backend(self) -> str:
        """The linear backend the steps run."""
        return self.plan.linear

    # ----------------------------------------------------------------- weights

    def layout_params(self, params, backend: str | None = None):
        return layout(params, backend or self.backend)

    def set_params(self, params) -> None:
        """The loaded weights, as loaded (laid out here for the chosen backend)."""
        self.params = self.layout_params(params)

    def describe_backends(self) -> str:
        timed = ", ".join(f"{p.attention}/{p.linear} {t * 1e3:.1f} ms" for p, t in self.measured.items())
        why = f" (the largest step, attention/linear: {timed})" if timed else " (measured on an earlier start)" if len(
            self.plans) > 1 else ""
        return f"{self.plan}{why}; {self.num_loaded_executables} executables loaded"

    # ------------------------------------------------------------- compilation

    def _store(self, plan: Plan | str) -> ExecutableStore:
        """Where the executables of `plan` are kept (or a record, by name), keyed by what
        they are compiled from."""
        abstract = self.layout_params(self._abstract, plan.linear if isinstance(plan, Plan) else "")
        return ExecutableStore(store_directory(self.rc.cache_dir), "pooling_step", self.config, plan,
                               self.rc.pooler.pooling_type, self.max_len, self.rc.max_num_seqs, self.rc.block_size,
                               shapes_and_dtypes(abstract), jax.tree.structure(abstract),
                               devices=[jax.local_devices()[0]])

    def _executable(self, plan: Plan, tokens: int):
        """The executable of bucket `tokens` (loaded from the store, else compiled and stored)."""
        key = (plan, tokens)
        if key not in self._compiled:
            seqs = seq_bucket(self.rc.max_num_seqs, tokens)
            inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._inputs([], tokens))
            params = self.layout_params(self._abstract, plan.linear)
            kind = self.rc.pooler.pooling_type
            c = self._caches[plan.attention]
            if self.config.is_encoder:
                step = functools.partial(encoder_step, cfg=self.config, pooling_type=kind, max_len=self.max_len)
                lower = lambda: jax.jit(step, donate_argnums=(1,)).trace(params, c.abstract_caches, inputs).lower()
            else:
                step = functools.partial(decoder_step, cfg=self.config, attention_fn=get_attention_fn(c.attention),
                                         pooling_type=kind)
                lower = lambda: jax.jit(step, donate_argnums=(2,)).trace(params, c.rope, c.abstract_caches,
                                                                         inputs).lower()
            with self.while_compiling():
                self._compiled[key], loaded = load_or_compile(self._store(plan), f"t{tokens}-s{seqs}", lower)
            self.num_loaded_executables += loaded
        return self._compiled[key]

    def warm_up(self, loaded=None, compile_buckets: bool = True) -> float:
        """Load or compile every bucket (two at a time; with `compile_buckets` False,
        each at its first step instead); where `auto` leaves several attention or
        linear backends (a CPU: the C++ kernels and XLA), first the fastest pair on the
        largest bucket, measured once and kept with the executables. `loaded`: the
        weights (for the measurement) when they were not given at construction.
        Returns seconds."""
        start = time.perf_counter()
        loaded = loaded if loaded is not None else self.params
        if len(self.plans) > 1 and loaded is not None:
            record = self._store("plan of " + " ".join(map(str, self.plans)))
            stored = {str(p): p for p in self.plans}.get(record.load_text("plan") or "")
            self.plan = stored or self._measure(loaded)
            record.save_text("plan", str(self.plan))
        if compile_buckets:
            with concurrent.futures.ThreadPoolExecutor(2) as pool_:
                list(pool_.map(lambda t: self._executable(self.plan, t), self.token_buckets))
        self._compiled = {k: v for k, v in self._compiled.items() if k[0] == self.plan}
        self._caches = {self.plan.attention: self.step_cache}  # the others' memory freed
        if loaded is not None:
            self.params = self.layout_params(loaded)
        return time.perf_counter() - start

    def _measure(self, loaded) -> Plan:
        """The fastest plan on the largest bucket full of maximal sequences."""
        tokens = self.token_buckets[-1]
        n = max(1, tokens // self.max_len)
        inputs = self._inputs([[1] * min(self.max_len, tokens // n)] * n, tokens)
        for plan in self.plans:
            params, run = self.layout_params(loaded, plan.linear), self._executable(plan, tokens)
            times = []
            for _ in range(4):  # the first call warms up
                t = time.perf_counter()
                jax.block_until_ready(self._call(run, params, inputs, self._caches[plan.attention]))
                times.append(time.perf_counter() - t)
            self.measured[plan] = min(times[1:])
        return min(self.measured, key=self.measured.get)

    # -------------------------------------------------------------------- step

    def _inputs(self, sequences: list[list[int]], tokens: int) -> PoolingInputs:
        """The step's PoolingInputs (numpy) for `sequences`, padded to `tokens`; a
        sequences each take whole blocks of the step cache, one after the
        other from block 1 (block 0 takes the padding tokens' writes)."""
        seqs, n = seq_bucket(self.rc.max_num_seqs, tokens), len(sequences)
        lens = np.zeros(seqs, np.int32)
        lens[:n] = [len(s) for s in sequences]
        query_start_loc = np.zeros(seqs + 1, np.int32)
        query_start_loc[1:] = np.cumsum(lens)
        starts = query_start_loc[:-1].copy()
        total = int(query_start_loc[-1])
        token_ids = np.zeros(tokens, np.int32)
        token_ids[:total] = np.concatenate(sequences) if sequences else []
        seg = np.full(tokens, seqs, np.int32)  # padding: a segment of its own
        seg[:total] = np.repeat(np.arange(n, dtype=np.int32), lens[:n])
        positions = np.zeros(tokens, np.int32)
        positions[:total] = np.arange(total, dtype=np.int32) - np.repeat(starts[:n], lens[:n])
        bs = self.rc.block_size
        blocks = -(-lens // bs)
        first_block = 1 + np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int32)
        table_width = -(-self.max_len // bs)
        block_tables = np.zeros((seqs, table_width), np.int32)
        columns = np.arange(table_width, dtype=np.int32)
        block_tables[:] = np.where(columns[None, :] < blocks[:, None], first_block[:, None] + columns[None, :], 0)
        slots = np.zeros(tokens, np.int32)
        slots[:total] = block_tables[seg[:total], positions[:total] // bs] * bs + positions[:total] % bs
        return PoolingInputs(token_ids, positions, seg, starts, lens, query_start_loc, slots, block_tables,
                             np.int32(n), np.int32(total))

    def _call(self, run, params, inputs: PoolingInputs, cache: _StepCache | None = None):
        """Run an executable; the step cache comes back (donated) for the next."""
        c = cache or self.step_cache
        if self.config.is_encoder:
            out, c.caches = run(params, c.caches, inputs)
        else:
            out, c.caches = run(params, c.rope, c.caches, inputs)
        return out

    def execute_model(self, sched: SchedulerOutput, bitmask=None) -> ModelRunnerOutput:
        """Pool the step's requests (all new, each with its whole prompt)."""
        if sched.scheduled_cached_reqs:
            raise RuntimeError("pooling runner: a request continued from an earlier step (pooling requests are "
                               "computed whole in one step)")
        reqs = sched.scheduled_new_reqs
        if not reqs:
            return ModelRunnerOutput([], [])
        total = sum(len(r.token_ids) for r in reqs)
        tokens = next(b for b in self.token_buckets if b >= total)
        inputs = self._inputs([r.token_ids for r in reqs], tokens)
        out = np.asarray(self._call(self._executable(self.plan, tokens), self.params, inputs))
        every_token = self.rc.pooler.pooling_type == "ALL"
        pooled = {r.req_id: self._finish(r, out[start:start + n] if every_token else out[i])
                  for i, (r, start, n) in enumerate(zip(reqs, inputs.starts, inputs.lens, strict=False))}
        return ModelRunnerOutput([r.req_id for r in reqs], [[] for _ in reqs], pooled=pooled)

    def _finish(self, req: NewRequestData, vec: np.ndarray) -> PooledData:
        """A request's vector(s) as it asks: cut to `dimensions`, L2-normalized (as
        torch's F.normalize: divided by max(norm, 1e-12))."""
        params, pooler = req.pooling_params, self.rc.pooler
        if params.dimensions is not None:
            vec = vec[..., :params.dimensions]
        if params.normalizes(pooler):
            vec = vec / np.maximum(np.linalg.norm(vec, axis=-1, keepdims=True), np.float32(1e-12))
        vec = np.ascontiguousarray(vec, np.float32)
        return PooledData(list(vec.shape), vec.tobytes())


class Plan(typing.NamedTuple):
    """The backends a pooling step runs: its attention and its projections."""

    attention: str
    linear: str

    def __str__(self) -> str:
        return f"attention {self.attention}, linear {self.linear}"


@dataclasses.dataclass
class _StepCache:
    """What the steps keep between them: the attention backend, a decoder's RoPE
    table, and the paged KV cache of one step's tokens (blocks for the budget, a partial
    block per sequence, the null block; donated and handed back each step), which an
    encoder needs only for the `cpu` kernel (XLA's segment_attention reads K/V as they
    are computed: None)."""

    attention: str
    rope: RopeTable | None
    abstract_caches: tuple[KVCache, ...] | None
    caches: tuple[KVCache, ...] | None

    @classmethod
    def make(cls, cfg: ModelConfig, rc: PoolingRunnerConfig, dtype, attention: str) -> _StepCache:
        fmt = kv_cache_format("auto", dtype)
        if cfg.is_encoder and attention != "cpu":
            return cls(attention, None, None, None)
        num_blocks = 1 + -(-rc.max_num_batched_tokens // rc.block_size) + rc.max_num_seqs
        abstract = cache_shapes(fmt, cfg.num_layers, num_blocks, rc.block_size, cfg.num_kv_heads, cfg.head_dim)
        rope = None if cfg.is_encoder else model_rope_table(cfg, min(rc.max_model_len, rc.max_num_batched_tokens))
        return cls(attention, rope, abstract, allocate_kv_caches(abstract))
