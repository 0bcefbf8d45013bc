"""Ragged paged-attention batches for the attention kernels' tests: random queries, a
shuffled paged cache and block tables, padding tokens and sequences."""

import jax.numpy as jnp
import numpy as np


def make_batch(rng, seqs, *, block_size, num_kv_heads, group, head_dim, pad_tokens=5, pad_seqs=2):
    """seqs: list of (q_len, kv_len). Returns the kernel arguments."""
    num_blocks = 1 + sum(-(-kv // block_size) for _, kv in seqs) + 3
    max_blocks = max(-(-kv // block_size) for _, kv in seqs) + 1
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(seqs) + pad_seqs, max_blocks), np.int32)
    for s, (_, kv) in enumerate(seqs):
        for b in range(-(-kv // block_size)):
            tables[s, b] = free.pop()
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    qsl = np.concatenate([qsl, [qsl[-1]] * pad_seqs]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in seqs] + [0] * pad_seqs, np.int32)
    t = int(qsl[-1]) + pad_tokens
    q = rng.standard_normal((t, num_kv_heads * group, head_dim)).astype(np.float32)
    k_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    args = (q, k_cache, v_cache, kv_lens, tables, qsl, np.int32(len(seqs)))
    return tuple(jnp.asarray(a) for a in args), int(qsl[len(seqs)])


def shared_prefix_batch(rng, prefix_blocks, seqs, *, block_size, num_kv_heads, group, head_dim):
    """Like make_batch, but every sequence's first `prefix_blocks` blocks are the same
    physical blocks (a shared system prompt): seqs are (q_len, kv_len) with kv_len -
    q_len >= prefix_blocks * block_size."""
    args, valid = make_batch(rng, seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                             head_dim=head_dim)
    tables = np.asarray(args[4]).copy()
    tables[: len(seqs), :prefix_blocks] = tables[0, :prefix_blocks]
    return (*args[:4], jnp.asarray(tables), *args[5:]), valid
