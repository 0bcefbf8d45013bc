"""The model runner of a pooling engine (`runner="pooling"`): each step computes whole
prompts and returns one vector per request (or one per token), no sampling, no KV
cache kept.

The scheduler hands it new requests only (a pooling request is admitted with its whole
prompt and finishes in that step). Their tokens go into one flat batch padded to a
token bucket (jaxllm.worker.buckets), compiled for every bucket at start-up; the
encoder's forward (jaxllm.models.bert) gives every token's hidden state and the step
pools them on the device (`pool`: each sequence's mean, first or last token, or every
token for ALL). On the host each request's vector is cut to its `dimensions` and
L2-normalized where it asks (float32, as sentence-transformers' Normalize).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.config import ModelConfig
from jaxllm.core.sched_output import NewRequestData, SchedulerOutput
from jaxllm.messages import ModelRunnerOutput, PooledData
from jaxllm.models import bert
from jaxllm.models.bert_params import BertLayerParams, BertParams
from jaxllm.models.linear import linear_candidates, pack_weight
from jaxllm.pooling_params import PoolerConfig
from jaxllm.worker.buckets import seq_bucket, token_buckets
from jaxllm.worker.compilation import CompilationManager, shapes_and_dtypes
from jaxllm.worker.executable_cache import ExecutableStore, store_directory

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolingRunnerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    pooler: PoolerConfig
    linear_backend: str = "auto"
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


def pooling_step(params: BertParams, token_ids: Int[Array, " T"], positions: Int[Array, " T"],
                 seg: Int[Array, " T"], starts: Int[Array, " S"], lens: Int[Array, " S"], num_tokens: Int[Array, ""],
                 *, cfg: ModelConfig, pooling_type: str, max_len: int) -> Float[Array, "S D"] | Float[Array, "T D"]:
    """One step: the encoder over a flat batch of whole sequences, pooled."""
    hidden = bert.forward(params, cfg, token_ids, positions, jnp.zeros_like(token_ids), seg, num_tokens, max_len)
    return pool(hidden, seg, starts, lens, pooling_type)


def pack_bert(params: BertParams) -> BertParams:
    """The encoder's projections packed for the `cpu` linear backend (abstract params too)."""
    def pack_layer(lp: BertLayerParams) -> BertLayerParams:
        return lp.replace(**{name: pack_weight(getattr(lp, name)) for name in ("wqkv", "wo", "w_in", "w_out")})

    return params.replace(layers=tuple(pack_layer(lp) for lp in params.layers))


@dataclasses.dataclass
class _StepArrays:
    token_ids: np.ndarray
    positions: np.ndarray
    seg: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    num_tokens: int


class PoolingRunner:
    def __init__(self, cfg: ModelConfig, params: BertParams, rc: PoolingRunnerConfig) -> None:
        """`params` as loaded (or abstract: set_params gives the weights later)."""
        if not cfg.is_encoder:
            raise ValueError(f"runner pooling: {cfg.architecture} is a decoder; serving decoders as embedders is not "
                             "built yet (encoders: BertModel)")
        self.config, self.rc = cfg, rc
        self.dtype = jax.tree.leaves(params)[0].dtype
        self.token_buckets = token_buckets(rc.max_num_batched_tokens)
        self.max_len = min(rc.max_model_len, rc.max_num_batched_tokens)
        self.backends = linear_candidates(rc.linear_backend, self.dtype)
        self.backend = self.backends[0]
        self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.params = None if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct) else params
        self._compiled: dict[tuple[str, int], object] = {}
        self.measured: dict[str, float] = {}  # seconds per step of the largest bucket, by backend (auto)
        self.num_loaded_executables = 0
        self.lora = None  # no adapters on pooling models

    # ----------------------------------------------------------------- weights

    def layout_params(self, params: BertParams, backend: str | None = None) -> BertParams:
        return pack_bert(params) if (backend or self.backend) == "cpu" else params

    def set_params(self, params: BertParams) -> None:
        """The loaded weights, as loaded (laid out here for the chosen backend)."""
        self._loaded = params
        self.params = self.layout_params(params)

    def describe_backends(self) -> str:
        timed = ", ".join(f"{b} {t * 1e3:.1f} ms" for b, t in self.measured.items())
        why = f" (the largest step: {timed})" if timed else " (measured on an earlier start)" if len(
            self.backends) > 1 else ""
        return f"linear {self.backend}{why}; {self.num_loaded_executables} executables loaded"

    # ------------------------------------------------------------- compilation

    def _store(self, backend: str) -> ExecutableStore:
        """Where the executables of `backend` are kept, keyed by what they are compiled from."""
        abstract = self.layout_params(self._abstract, backend)
        return ExecutableStore(store_directory(self.rc.cache_dir), "pooling_step", self.config, backend,
                               self.rc.pooler.pooling_type, self.max_len, self.rc.max_num_seqs,
                               shapes_and_dtypes(abstract), jax.tree.structure(abstract),
                               devices=[jax.local_devices()[0]])

    def _executable(self, backend: str, tokens: int):
        """The executable of bucket `tokens` (loaded from the store, else compiled and stored)."""
        key = (backend, tokens)
        if key not in self._compiled:
            seqs = seq_bucket(self.rc.max_num_seqs, tokens)
            step = functools.partial(pooling_step, cfg=self.config, pooling_type=self.rc.pooler.pooling_type,
                                     max_len=self.max_len)
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
            abstract = self.layout_params(self._abstract, backend)
            lower = lambda: jax.jit(step).trace(abstract, i32(tokens), i32(tokens), i32(tokens), i32(seqs), i32(seqs),
                                                i32()).lower()
            self._compiled[key], loaded = CompilationManager._load_or_compile(self._store(backend), f"t{tokens}-s{seqs}",
                                                                              lower)
            self.num_loaded_executables += loaded
        return self._compiled[key]

    def warm_up(self, loaded: BertParams | None = None) -> float:
        """Load or compile every bucket (two at a time); with two linear backends
        (`auto` on a CPU) first the faster of them on the largest bucket, measured once
        and kept with the executables. `loaded`: the weights (for the measurement) when
        they were not given at construction. Returns seconds."""
        start = time.perf_counter()
        loaded = loaded if loaded is not None else self.params
        if len(self.backends) > 1 and loaded is not None:
            plan_store = self._store("+".join(self.backends))  # the candidates' measurement
            plan = plan_store.load_text("backend")
            self.backend = plan if plan in self.backends else self._measure(loaded)
            plan_store.save_text("backend", self.backend)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda t: self._executable(self.backend, t), self.token_buckets))
        self._compiled = {k: v for k, v in self._compiled.items() if k[0] == self.backend}
        if loaded is not None:
            self.params = self.layout_params(loaded)
        return time.perf_counter() - start

    def _measure(self, loaded: BertParams) -> str:
        """The faster backend on the largest bucket full of maximal sequences."""
        tokens = self.token_buckets[-1]
        n = max(1, tokens // self.max_len)
        arrays = self._arrays([[101] * (tokens // n)] * n, tokens)
        for backend in self.backends:
            params, run = self.layout_params(loaded, backend), self._executable(backend, tokens)
            jax.block_until_ready(self._call(run, params, arrays))
            times = []
            for _ in range(3):
                t = time.perf_counter()
                jax.block_until_ready(self._call(run, params, arrays))
                times.append(time.perf_counter() - t)
            self.measured[backend] = min(times)
        return min(self.measured, key=self.measured.get)

    # -------------------------------------------------------------------- step

    def _arrays(self, sequences: list[list[int]], tokens: int) -> _StepArrays:
        seqs = seq_bucket(self.rc.max_num_seqs, tokens)
        lens = np.zeros(seqs, np.int32)
        lens[:len(sequences)] = [len(s) for s in sequences]
        starts = np.zeros(seqs, np.int32)
        starts[1:len(sequences)] = np.cumsum(lens[:len(sequences) - 1])
        n = int(lens.sum())
        token_ids = np.zeros(tokens, np.int32)
        token_ids[:n] = np.concatenate(sequences) if sequences else []
        seg = np.full(tokens, seqs, np.int32)  # padding: a segment of its own
        seg[:n] = np.repeat(np.arange(len(sequences), dtype=np.int32), lens[:len(sequences)])
        positions = np.zeros(tokens, np.int32)
        positions[:n] = np.arange(n, dtype=np.int32) - np.repeat(starts[:len(sequences)], lens[:len(sequences)])
        return _StepArrays(token_ids, positions, seg, starts, lens, n)

    @staticmethod
    def _call(run, params, a: _StepArrays):
        return run(params, a.token_ids, a.positions, a.seg, a.starts, a.lens, np.int32(a.num_tokens))

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
        arrays = self._arrays([r.token_ids for r in reqs], tokens)
        out = np.asarray(self._call(self._executable(self.backend, tokens), self.params, arrays))
        every_token = self.rc.pooler.pooling_type == "ALL"
        pooled = {r.req_id: self._finish(r, out[start:start + n] if every_token else out[i])
                  for i, (r, start, n) in enumerate(zip(reqs, arrays.starts, arrays.lens, strict=False))}
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
