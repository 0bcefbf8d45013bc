"""Drive the model forward over the paged KV cache by hand, the way the model runner
does, for tests: sequences with shuffled, non-contiguous block tables; steps that mix
prefill chunks and decodes; padding tokens and padding sequences in every step."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.attention import AttentionMetadata, allocate_kv_caches
from jaxllm.attention.kv_cache import cache_shapes, kv_cache_format
from jaxllm.attention.metadata import common_prefix_blocks
from jaxllm.attention.xla import ragged_paged_attention_xla
from jaxllm.config import ModelConfig
from jaxllm.models.llama import OutputRows
from jaxllm.models.pipeline import model_functions
from jaxllm.models.rope import model_rope_table


@functools.lru_cache(maxsize=64)
def make_forward(cfg: ModelConfig, attention_fn, mesh=None):
    """The model's forward jitted for the tests (the engine's step does the same inside
    its one executable, with sampling): fn(params, kv_caches, input_ids, positions, md,
    logits_indices, num_logits, every) -> (float32 logits of those rows, caches); the caches
    donated. `every`: the last layer runs every row (the engine's path for prompt
    logprobs), else logits_indices' alone (its path otherwise: llama.forward_rows). With
    a `mesh`, tensor-parallel over it (jaxllm.models.parallel). One per configuration,
    so the drivers of a test module share its compilations (their steps are padded to
    a few shapes: `_bucket`)."""
    rope = model_rope_table(cfg, cfg.max_position_embeddings)
    forward, logits = model_functions(cfg, attention_fn, mesh)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def fn(params, kv_caches, input_ids, positions, md, logits_indices, num_logits, every):
        out = OutputRows(logits_indices, num_logits, every)
        hidden, kv_caches = forward(params, rope, kv_caches, input_ids, positions, md, out)
        return logits(params, hidden.rows, cfg), kv_caches

    return fn


def _bucket(n: int, least: int) -> int:
    """The size a step's `n` rows are padded to: a power of two (at least `least`) up to
    64, then a multiple of 64."""
    return max(least, 1 << (n - 1).bit_length()) if n <= 64 else -(-n // 64) * 64


@dataclasses.dataclass
class Sequence:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int = 0


class PagedDriver:
    """Owns a paged KV cache; hands out blocks in a shuffled order (block 0 is the
    null block that padding writes into)."""

    def __init__(self, cfg: ModelConfig, params, *, block_size: int = 8, num_blocks: int = 64,
                 max_blocks_per_seq: int = 16, attention_fn=ragged_paged_attention_xla, seed: int = 0,
                 cache_dtype=None, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                 every_row: bool = False, pipeline_parallel_size: int = 1):
        """`cache_dtype`: the activations' dtype (default: the params'), the KV cache's
        where `kv_cache_dtype` (a KV_CACHE_DTYPES name) is auto. `every_row`: the last
        layer runs every token's row (make_forward's `every`). `tensor_parallel_size`
        > 1: over a mesh of that many devices, the params (as loaded) laid out and
        sharded for it, the caches by KV head. `pipeline_parallel_size` > 1: over a
        (stage, model) mesh (jaxllm.models.pipeline), each stage's layers and caches on
        its devices."""
        self.cfg, self.params, self.block_size = cfg, params, block_size
        self.max_blocks_per_seq, self.every_row = max_blocks_per_seq, every_row
        scaled = kv_cache_dtype == "fp8-scaled"  # fp8 with calculated scales per layer (calculate_kv_scales)
        fmt = kv_cache_format("fp8" if scaled else kv_cache_dtype, cache_dtype or params.final_norm.dtype)
        fmt = dataclasses.replace(fmt, layer_scaled=scaled)
        self.caches = allocate_kv_caches(cache_shapes(fmt, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                                      cfg.head_dim))
        self.free_blocks = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        mesh = None
        if pipeline_parallel_size > 1:
            from jaxllm.models import parallel, pipeline

            plan = pipeline.check_pipeline_parallel(cfg, pipeline_parallel_size, tensor_parallel_size)
            mesh = pipeline.make_mesh(pipeline_parallel_size, tensor_parallel_size)
            self.params = pipeline.place_params(cfg, params, mesh)
            heads = parallel.cache_kv_heads(cfg, tensor_parallel_size)
            slots = pipeline.cache_slots(plan, cfg.kv_cache_groups(hybrid=False))
            local = cache_shapes(fmt, slots.count, num_blocks, block_size, heads, cfg.head_dim)
            abstract = pipeline.staged_cache_shapes(local, pipeline_parallel_size, pipeline.kv_cache_sharding(mesh, fmt))
            self.caches = allocate_kv_caches(abstract)
        elif tensor_parallel_size > 1:
            from jaxllm.models import parallel

            parallel.check_tensor_parallel(cfg, tensor_parallel_size)
            mesh = parallel.make_mesh(tensor_parallel_size)
            self.params = parallel.place_params(cfg, params, mesh)
            heads = parallel.cache_kv_heads(cfg, tensor_parallel_size)  # KV heads replicated if fewer than shards
            sharding = parallel.kv_cache_sharding(mesh, fmt)
            self.caches = allocate_kv_caches(cache_shapes(fmt, cfg.num_layers, num_blocks, block_size, heads,
                                                          cfg.head_dim, sharding))
        self.forward = make_forward(cfg, attention_fn, mesh)

    def new_sequence(self, token_ids: list[int]) -> Sequence:
        return Sequence(list(token_ids), [])

    def step(self, work: list[tuple[Sequence, int]], pad_tokens: int = 3, pad_seqs: int = 1,
             all_logits: bool = False) -> list[np.ndarray]:
        """Run one ragged step: for each (sequence, n), its next n tokens. Returns, per
        sequence, the logits of its last token ([V]) or of all n tokens ([n, V])."""
        ids, pos, slots, qsl, seq_lens, tables, logit_rows = [], [], [], [0], [], [], []
        for seq, n in work:
            start = seq.num_computed
            while len(seq.block_ids) * self.block_size < start + n:
                seq.block_ids.append(int(self.free_blocks.pop()))
            p = np.arange(start, start + n)
            ids += seq.token_ids[start:start + n]
            pos += list(p)
            slots += [seq.block_ids[i // self.block_size] * self.block_size + i % self.block_size for i in p]
            rows = range(qsl[-1], qsl[-1] + n)
            logit_rows += list(rows) if all_logits else [rows[-1]]
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids + [0] * (self.max_blocks_per_seq - len(seq.block_ids)))
            seq.num_computed += n
        # padding (at least pad_tokens / pad_seqs, up to a power of two, as the engine's
        # buckets do): tokens write into the null block, sequences have no tokens
        pad_tokens = _bucket(len(ids) + pad_tokens, 8) - len(ids)
        pad_seqs = _bucket(len(work) + pad_seqs, 4) - len(work)
        ids += [0] * pad_tokens
        pos += [0] * pad_tokens
        slots += [i % self.block_size for i in range(pad_tokens)]
        num_logits = len(logit_rows)
        logit_rows += [0] * (_bucket(num_logits, 8) - num_logits)
        for _ in range(pad_seqs):
            qsl.append(qsl[-1])
            seq_lens.append(0)
            tables.append([0] * self.max_blocks_per_seq)
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots, jnp.int32),
            block_tables=jnp.asarray(tables, jnp.int32),
            seq_lens=jnp.asarray(seq_lens, jnp.int32),
            query_start_loc=jnp.asarray(qsl, jnp.int32),
            num_seqs=jnp.asarray(len(work), jnp.int32),
            common_prefix_blocks=jnp.asarray(common_prefix_blocks(
                np.asarray(tables[:len(work)]), np.asarray(seq_lens[:len(work)]) - np.diff(qsl[:len(work) + 1]),
                self.block_size), jnp.int32),
        )
        logits, self.caches = self.forward(
            self.params, self.caches, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32), md,
            jnp.asarray(logit_rows, jnp.int32), jnp.asarray(num_logits, jnp.int32), jnp.asarray(self.every_row),
        )
        logits = np.asarray(logits)[:num_logits]
        out, row = [], 0
        for _, n in work:
            k = n if all_logits else 1
            out.append(logits[row:row + k] if all_logits else logits[row])
            row += k
        return out

    def prompt_logits(self, token_ids: list[int], chunks: list[int]) -> np.ndarray:
        """Logits of every prompt position, computing the prompt in the given chunks."""
        assert sum(chunks) == len(token_ids)
        seq = self.new_sequence(token_ids)
        return np.concatenate([self.step([(seq, n)], all_logits=True)[0] for n in chunks])

    def greedy(self, prompt: list[int], max_new_tokens: int, chunk: int | None = None) -> list[int]:
        seq = self.new_sequence(prompt)
        chunk = chunk or len(prompt)
        while seq.num_computed < len(prompt):
            n = min(chunk, len(prompt) - seq.num_computed)
            logits = self.step([(seq, n)])[0]
        out = []
        for _ in range(max_new_tokens):
            out.append(int(np.argmax(logits)))
            seq.token_ids.append(out[-1])
            logits = self.step([(seq, 1)])[0]
        return out
