"""The attention metadata of one engine step: where each token's K/V goes and which
cache blocks each sequence reads. Built on the host (numpy) by the model runner, padded
to the step's bucket shapes, and passed into the jitted step as one pytree."""

from __future__ import annotations

import numpy as np
from flax import struct
from jaxtyping import Array, Int


@struct.dataclass
class AttentionMetadata:
    """A flat ragged batch of T tokens from S sequences (both padded to buckets).

    Sequence s owns tokens query_start_loc[s] : query_start_loc[s+1] of the flat batch;
    they are its last q_len positions, so token i of sequence s sits at absolute
    position seq_lens[s] - q_len + i and attends causally to positions 0 .. that one.
    Padding sequences have q_len 0 and seq_len 0; padding tokens write into the null
    block (slot_mapping points there) and their outputs are never read.
    """

    slot_mapping: Int[Array, " T"]  # block_id * block_size + offset, per new token
    block_tables: Int[Array, "S MB"]  # physical block ids, per sequence
    seq_lens: Int[Array, " S"]  # tokens in cache after this step, per sequence
    query_start_loc: Int[Array, " S+1"]  # S + 1 offsets into the flat token batch
    num_seqs: Int[Array, ""]  # real (unpadded) sequences
    # A hint (0: none): the first common_prefix_blocks columns of every real sequence's
    # block table are the same blocks, all computed before this step. A backend may
    # attend to them once for all queries (the cpu backend does; vLLM calls this cascade
    # attention); the others ignore it.
    common_prefix_blocks: Int[Array, ""]

    @property
    def num_tokens(self) -> Int[Array, ""]:
        """The step's real tokens (the rest of T pads its bucket): the row count the
        packed projections multiply."""
        return self.query_start_loc[self.num_seqs]


def common_prefix_blocks(block_tables: np.ndarray, num_computed: np.ndarray, block_size: int) -> int:
    """The leading block-table columns every row of `block_tables` shares, within the
    blocks each sequence had fully in cache before the step (num_computed tokens):
    the AttentionMetadata hint, computed on the host. 0 for fewer than 2 sequences."""
    if len(block_tables) < 2:
        return 0
    limit = int(num_computed.min()) // block_size
    if limit <= 0:
        return 0
    same = (block_tables[:, :limit] == block_tables[0, :limit]).all(axis=0)
    return limit if same.all() else int(same.argmin())
