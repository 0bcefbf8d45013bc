"""The attention metadata of one engine step: where each token's K/V goes and which
cache blocks each sequence reads. Built on the host (numpy) by the model runner, padded
to the step's bucket shapes, and passed into the jitted step as one pytree."""

from __future__ import annotations

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

    slot_mapping: Int[Array, "T"]  # block_id * block_size + offset, per new token
    block_tables: Int[Array, "S B"]  # physical block ids, per sequence
    seq_lens: Int[Array, "S"]  # tokens in cache after this step, per sequence
    query_start_loc: Int[Array, "S1"]  # S + 1 offsets into the flat token batch
    num_seqs: Int[Array, ""]  # real (unpadded) sequences
