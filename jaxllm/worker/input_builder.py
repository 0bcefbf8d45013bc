"""A step's inputs from the runner's host state: numpy only, nothing compiled.

`InputBuilder.prepare_step` turns a SchedulerOutput into the flat ragged batch of the
scheduled rows (`StepRows`: token ids, positions, slots, query_start_loc, seq_lens,
sample rows, drafts, the decode loop's steps) and pads it to its step shape
(`pad_inputs` -> StepInputs, or LoopInputs for several decode steps): what the model
runner packs and hands to the executable of that shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, Int

from jaxllm.attention.image_blocks import ImageBlocks
from jaxllm.attention.metadata import AttentionMetadata, common_prefix_blocks
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.worker.buckets import StepShape, StepShapes
from jaxllm.worker.decode_loop import DecodeLimits, LoopInputs
from jaxllm.worker.input_batch import BIAS_WIDTH, STOP_WIDTH, InputBatch
from jaxllm.worker.step import StepInputs


def pad(a: np.ndarray, n: int, value=0) -> np.ndarray:
    """`a` followed by `n` copies of `value`."""
    return np.concatenate([a, np.full(n, value, a.dtype)]) if n else a



@dataclasses.dataclass(frozen=True)
class StepRows:
    """One step's scheduled rows and tokens on the host, before padding to a bucket:
    what `InputBuilder.pad_inputs` turns into StepInputs (S rows, T tokens)."""

    rows: Int[np.ndarray, " S"]  # the input batch's row of each scheduled request
    input_ids: Int[np.ndarray, " T"]
    positions: Int[np.ndarray, " T"]
    tok_rows: Int[np.ndarray, " T"]  # the row each token belongs to
    slots: Int[np.ndarray, "G T"]  # KV cache slot each token's K/V goes to, per KV cache group
    qsl: Int[np.ndarray, " S+1"]  # query_start_loc: row i's tokens are qsl[i]:qsl[i + 1]
    seq_lens: Int[np.ndarray, " S"]  # tokens of each row whose K/V exists after the step
    targets: Int[np.ndarray, " T"]  # the prompt token each position scores, -1 for none
    samples: Bool[np.ndarray, " S"]  # which rows sample a token this step
    num_drafts: Int[np.ndarray, " S"]  # draft tokens each row verifies (its last ones)
    # sample rows: one per row, and one per draft (each position of a drafted row samples)
    logit_rows: Int[np.ndarray, " R"]  # the token whose logits each sample row takes
    sample_seq: Int[np.ndarray, " R"]  # the row (0..S-1) each sample row belongs to
    output_index: Int[np.ndarray, " R"]  # which output token each sample row draws (its uniform)
    # structured outputs: each sample row's allowed tokens as bits (all ones where
    # unconstrained); None when no row is constrained
    token_bitmask: Int[np.ndarray, "R W"] | None = None
    lora_slots: Int[np.ndarray, " T"] | None = None  # each token's adapter slot (0: none); None without LoRA
    # tokens whose ids the host does not know yet (async scheduling: sampled by the step in
    # flight); None: every id is known
    from_history: Bool[np.ndarray, " T"] | None = None
    # several decode steps in one call: the steps each row may take (the KV slots the
    # scheduler gave it); None: one step
    decode_steps: Int[np.ndarray, " S"] | None = None
    image_rows: Int[np.ndarray, " T"] | None = None  # a vision-language model's: each token's image table row
    image_blocks: Int[np.ndarray, "5 B"] | None = None  # Gemma 3's: ImageBlocks' fields, one row each

    @classmethod
    def empty(cls, num_kv_groups: int = 1) -> StepRows:
        """No rows: pads to a whole bucket of padding (for compiling)."""
        i = np.zeros(0, np.int32)
        return cls(i, i, i, i, np.zeros((num_kv_groups, 0), np.int32), np.zeros(1, np.int32), i, i,
                   np.zeros(0, bool), i, i, i, i)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclasses.dataclass
class PreparedStep:
    """One step's device inputs and the host-side facts needed to record its results."""

    req_ids: list[str]
    host: StepRows
    shape: StepShape
    inputs: StepInputs | LoopInputs  # LoopInputs where the shape runs several decode steps

    @property
    def step_inputs(self) -> StepInputs:
        """The (first) step's inputs."""
        return self.inputs.step if isinstance(self.inputs, LoopInputs) else self.inputs

    @property
    def t(self) -> int:
        return self.shape.tokens

    @property
    def s(self) -> int:
        return self.shape.seqs


class InputBuilder:
    def __init__(self, batch: InputBatch, shapes: StepShapes, kv_groups: KVCacheGroups, *, block_size: int,
                 max_model_len: int, async_scheduling: bool, with_lora: bool, bitmask_width: int,
                 num_scheduler_steps: int, tokens_per_image: int = 0, image_blocks: int = 0) -> None:
        """Inputs from `batch`'s rows, padded to `shapes`; `async_scheduling`: tokens
        sampled by a step in flight are read on the device (`StepRows.from_history`);
        `with_lora`: each token's adapter slot; `bitmask_width`: words of a
        structured-output token bitmask row; `tokens_per_image`: a vision-language
        model's (each image token's row in the image table, `StepRows.image_rows`);
        `image_blocks`: where its images attend both ways (Gemma 3), the most images a
        step computes (`StepRows.image_blocks`)."""
        self.input_batch, self.shapes, self.kv_groups = batch, shapes, kv_groups
        self.block_size, self.max_model_len = block_size, max_model_len
        self.max_num_seqs, self.max_blocks_per_seq = batch.max_num_seqs, batch.block_table.shape[-1]
        self.async_scheduling, self.with_lora = async_scheduling, with_lora
        self.bitmask_width, self.num_scheduler_steps = bitmask_width, num_scheduler_steps
        self.tokens_per_image, self.num_image_blocks = tokens_per_image, image_blocks
        # an all-allowed bitmask per sample-row bucket, kept on the device: steps with no
        # constrained row pass it without a transfer
        self._free_bitmasks: dict[int, jax.Array] = {}

    def prepare_step(self, sched: SchedulerOutput, bitmask: Int[np.ndarray, "R W"] | None = None) -> PreparedStep:
        """The bucket-shaped inputs of a step, from the rows' host state (numpy only).
        A row with k draft tokens (written after its known tokens) samples at its last
        k + 1 positions."""
        b = self.input_batch
        req_ids = list(sched.num_scheduled_tokens)
        rows = np.fromiter((b.row_of[r] for r in req_ids), np.int32, len(req_ids))
        n = np.fromiter(sched.num_scheduled_tokens.values(), np.int32, len(req_ids))
        num_drafts = self._write_drafts(req_ids, rows, sched.scheduled_spec_decode_tokens)
        start = b.num_computed_tokens[rows]
        qsl = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(n, out=qsl[1:])
        num_tokens = int(qsl[-1])
        tok_rows = np.repeat(rows, n)
        positions = (np.repeat(start - qsl[:-1], n) + np.arange(num_tokens)).astype(np.int32)
        input_ids = b.token_ids[tok_rows, positions]
        from_history = positions >= b.num_known[tok_rows] if self.async_scheduling else None  # sampled in flight
        slots = b.block_table[:, tok_rows, positions // self.block_size] * self.block_size + positions % self.block_size
        seq_lens = (start + n).astype(np.int32)
        samples = seq_lens >= b.num_tokens[rows]
        next_pos = np.minimum(positions + 1, self.max_model_len - 1)
        scored = ((b.prompt_logprobs[tok_rows] >= 0) & (positions + 1 < b.num_prompt_tokens[tok_rows])
                  & (positions >= b.prompt_scored[tok_rows]))
        targets = np.where(scored, b.token_ids[tok_rows, next_pos], -1).astype(np.int32)
        per_row = num_drafts + 1
        sample_seq = np.repeat(np.arange(len(rows), dtype=np.int32), per_row)
        offset = (np.arange(len(sample_seq)) - np.repeat(np.cumsum(per_row) - per_row, per_row)).astype(np.int32)
        logit_rows = np.maximum(np.repeat(qsl[1:] - per_row, per_row) + offset, 0).astype(np.int32)
        output_index = ((b.num_tokens[rows] - b.num_prompt_tokens[rows])[sample_seq] + offset).astype(np.int32)

        host = StepRows(rows=rows, input_ids=input_ids, positions=positions, tok_rows=tok_rows,
                        slots=slots.astype(np.int32), qsl=qsl, seq_lens=seq_lens, targets=targets,
                        samples=samples, num_drafts=num_drafts, logit_rows=logit_rows, sample_seq=sample_seq,
                        output_index=output_index, token_bitmask=bitmask,
                        lora_slots=None if not self.with_lora else b.lora_slot[tok_rows],
                        from_history=from_history if from_history is not None and from_history.any() else None,
                        decode_steps=self._decode_steps(req_ids, sched),
                        image_rows=self._image_rows(req_ids, qsl, positions, sched),
                        image_blocks=self._image_blocks(req_ids, qsl, positions, sched))
        shape = self.shapes.for_step(num_tokens, len(rows), len(logit_rows), 1 if host.decode_steps is None else
                                self.num_scheduler_steps)
        return PreparedStep(req_ids, host, shape, self.pad_inputs(shape, host))

    def _image_rows(self, req_ids: list[str], qsl: Int[np.ndarray, " Q"], positions: Int[np.ndarray, " T"],
                    sched: SchedulerOutput) -> Int[np.ndarray, " T"] | None:
        """Each token's row in the image table: an image token's (its image's slot, its
        place in the image), -1 for the others; None for a text model."""
        if not self.tokens_per_image:
            return None
        rows = np.full(len(positions), -1, np.int32)
        for i, req_id in enumerate(req_ids):
            for offset, length, slot in sched.image_slots.get(req_id, ()):
                pos = positions[qsl[i]:qsl[i + 1]]
                inside = (pos >= offset) & (pos < offset + length)
                rows[qsl[i]:qsl[i + 1]] = np.where(inside, slot * self.tokens_per_image + pos - offset,
                                                   rows[qsl[i]:qsl[i + 1]])
        return rows

    def _image_blocks(self, req_ids: list[str], qsl: Int[np.ndarray, " Q"], positions: Int[np.ndarray, " T"],
                      sched: SchedulerOutput) -> Int[np.ndarray, "5 B"] | None:
        """Per image whose tokens the step computes (Gemma 3's, which attend both ways):
        the row and position of its first one this step, their count, the image's end,
        the sequence; rows of ImageBlocks' fields. None where images are causal."""
        if not self.num_image_blocks:
            return None
        blocks = np.zeros((5, self.num_image_blocks), np.int32)
        g = 0
        for i, req_id in enumerate(req_ids):
            if qsl[i] == qsl[i + 1]:
                continue
            first, stop = positions[qsl[i]], positions[qsl[i + 1] - 1] + 1
            for offset, length, _ in sched.image_slots.get(req_id, ()):
                lo, hi = max(offset, first), min(offset + length, stop)
                if lo < hi:
                    blocks[:, g] = (qsl[i] + lo - first, lo, hi - lo, offset + length, i)
                    g += 1
        return blocks

    def _decode_steps(self, req_ids: list[str], sched: SchedulerOutput) -> Int[np.ndarray, " S"] | None:
        """The steps each row takes where the scheduler hands over several (None: one)."""
        if not sched.decode_steps:
            return None
        if sched.num_steps > self.num_scheduler_steps:
            raise ValueError(f"{sched.num_steps} decode steps scheduled; the runner was compiled for "
                             f"num_scheduler_steps={self.num_scheduler_steps}")
        return np.fromiter((sched.decode_steps[r] for r in req_ids), np.int32, len(req_ids))

    def _write_drafts(self, req_ids: list[str], rows: Int[np.ndarray, " S"], drafts: dict[str, list[int]]
                      ) -> Int[np.ndarray, " S"]:
        """Write each row's draft tokens after its known tokens (where its inputs are
        read from); how many each row has."""
        num_drafts = np.zeros(len(rows), np.int32)
        if drafts:
            b = self.input_batch
            for i, req_id in enumerate(req_ids):
                tokens = drafts.get(req_id)
                if tokens:
                    row = rows[i]
                    b.token_ids[row, b.num_tokens[row]:b.num_tokens[row] + len(tokens)] = tokens
                    num_drafts[i] = len(tokens)
        return num_drafts


    def pad_inputs(self, shape: StepShape, host: StepRows) -> StepInputs | LoopInputs:
        """Bucket-shaped inputs from the real rows (with the decode loop's limits where
        the shape runs several steps); padding writes to the null block, reads nothing,
        and samples greedily (discarded)."""
        step = self._pad_step_inputs(*shape[:3], host)
        if shape.decode_steps == 1:
            return step
        return LoopInputs(step, self._decode_limits(shape.seqs, host))

    def _decode_limits(self, s: int, host: StepRows) -> DecodeLimits:
        """What ends each row's decode loop: its steps, stop tokens and min_tokens."""
        b, n = self.input_batch, len(host.rows)
        steps = np.zeros(0, np.int32) if host.decode_steps is None else host.decode_steps
        stops = np.full((s, STOP_WIDTH), -1, np.int32)
        stops[:n] = b.stop_token_ids[host.rows]
        return DecodeLimits(max_steps=pad(steps, s - len(steps)), stop_token_ids=stops,
                            min_tokens=pad(b.min_tokens[host.rows], s - n),
                            num_steps=np.int32(steps.max(initial=0)))

    def _pad_step_inputs(self, t: int, s: int, r: int, host: StepRows) -> StepInputs:
        """Bucket-shaped StepInputs from the real rows."""
        pad_t = t - host.num_tokens
        targets = pad(host.targets, pad_t, -1)
        return StepInputs(
            input_ids=pad(host.input_ids, pad_t),
            positions=pad(host.positions, pad_t),
            history_rows=pad(host.tok_rows, pad_t, self.max_num_seqs),
            from_history=pad(np.zeros(host.num_tokens, bool) if host.from_history is None else host.from_history,
                              pad_t, False),
            attn=self._attention_metadata(t, s, host),
            logits_indices=pad(host.logit_rows, r - len(host.logit_rows)),
            sampled_history_rows=pad(self._sampled_history_rows(host), r - len(host.logit_rows), self.max_num_seqs),
            num_logit_rows=np.int32(len(host.logit_rows)),
            sampling=self._sampling_metadata(r, host),
            prompt_logprob_targets=targets,
            any_prompt_logprobs=np.bool_((targets >= 0).any()),
            lora_slots=None if not self.with_lora else pad(
                np.zeros(0, np.int32) if host.lora_slots is None else host.lora_slots, pad_t),
            image_rows=None if not self.tokens_per_image else pad(
                np.zeros(0, np.int32) if host.image_rows is None else host.image_rows, pad_t, -1),
            image_blocks=None if not self.num_image_blocks else ImageBlocks(*(
                np.zeros((5, self.num_image_blocks), np.int32) if host.image_blocks is None else host.image_blocks)),
        )

    def _sampled_history_rows(self, host: StepRows) -> Int[np.ndarray, " R"]:
        """Where each sample row's token goes in the history (at its next position):
        under async scheduling its row where it samples (the next step may read it
        there), else the unused row (nothing read there)."""
        unused = np.full(len(host.logit_rows), self.max_num_seqs, np.int32)
        if not self.async_scheduling:
            return unused
        return np.where(host.samples[host.sample_seq], host.rows[host.sample_seq], unused).astype(np.int32)

    def _attention_metadata(self, t: int, s: int, host: StepRows
                            ) -> AttentionMetadata | tuple[AttentionMetadata, ...]:
        """The step's attention metadata; with several KV cache groups, one per group
        (their block tables and slots; a sliding group's table keeps ids of blocks
        freed behind its window, which its layers never read, and gets no shared-prefix
        hint)."""
        rows, qsl, seq_lens = host.rows, host.qsl, host.seq_lens
        n_seq = len(rows)
        mds = []
        for g, window in enumerate(self.kv_groups.windows):
            tables = np.zeros((s, self.max_blocks_per_seq), np.int32)
            tables[:n_seq] = self.input_batch.block_table[g, rows]
            shared = 0 if window is not None or not n_seq else common_prefix_blocks(
                tables[:n_seq], seq_lens - np.diff(qsl), self.block_size)
            mds.append(AttentionMetadata(
                slot_mapping=pad(host.slots[g], t - host.num_tokens, 0),  # padding tokens write into the null block
                block_tables=tables,
                seq_lens=pad(seq_lens, s - n_seq),
                query_start_loc=pad(qsl, s - n_seq, qsl[-1]),
                num_seqs=np.int32(n_seq),
                common_prefix_blocks=np.int32(shared),
            ))
        return mds[0] if len(mds) == 1 else tuple(mds)

    def _sampling_metadata(self, r: int, host: StepRows) -> SamplingMetadata:
        """Per sample row (padded to `r`): its sequence's parameters, and the output
        index and known tokens of the position it samples."""
        b, rows = self.input_batch, host.rows[host.sample_seq]
        num_rows, s = len(rows), r
        pad_s = s - num_rows

        def gather(column, fill):
            return pad(column[rows], pad_s, fill)

        real = np.zeros(s, bool)
        real[:num_rows] = host.samples[host.sample_seq]
        temperature = gather(b.temperature, 0.0)
        sampling_rows = real & (temperature > 0)
        top_k, top_p, min_p = gather(b.top_k, 0), gather(b.top_p, 1.0), gather(b.min_p, 0.0)
        presence, frequency = gather(b.presence_penalty, 0.0), gather(b.frequency_penalty, 0.0)
        repetition = gather(b.repetition_penalty, 1.0)
        bias_ids = np.zeros((s, BIAS_WIDTH), np.int32)
        bias_values = np.zeros((s, BIAS_WIDTH), np.float32)
        bias_ids[:num_rows], bias_values[:num_rows] = b.bias_token_ids[rows], b.bias_values[rows]
        seeds = np.zeros((s, 2), np.uint32)
        seeds[:num_rows] = b.seeds[rows]
        return SamplingMetadata(
            token_bitmask=self._bitmask(s, host.token_bitmask),
            any_token_bitmask=np.bool_(host.token_bitmask is not None),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            seeds=seeds,
            output_index=pad(host.output_index, pad_s),
            bias_token_ids=bias_ids,
            bias_values=bias_values,
            history_rows=pad(rows, pad_s, self.max_num_seqs),
            num_prompt_tokens=gather(b.num_prompt_tokens, 0),
            num_known_tokens=pad(host.positions[host.logit_rows] + 1, pad_s),
            all_greedy=np.bool_(not sampling_rows.any()),
            any_top_k_top_p=np.bool_((sampling_rows & ((top_k > 0) | (top_p < 1))).any()),
            any_min_p=np.bool_((sampling_rows & (min_p > 0)).any()),
            any_penalties=np.bool_((real & ((presence != 0) | (frequency != 0) | (repetition != 1.0))).any()),
            any_logprobs=np.bool_((real & (gather(b.logprobs, -1) >= 0)).any()),
            any_logit_bias=np.bool_((bias_values != 0).any()),
            any_beam=np.bool_((real & (gather(b.beam_candidates, 0) > 0)).any()),
        )

    def _bitmask(self, s: int, rows: np.ndarray | None):
        """The step's [s, W] token bitmask: the rows' own padded with all-allowed ones."""
        if rows is None:
            if s not in self._free_bitmasks:
                self._free_bitmasks[s] = jnp.full((s, self.bitmask_width), -1, jnp.int32)
            return self._free_bitmasks[s]
        mask = np.full((s, self.bitmask_width), -1, np.int32)
        mask[: len(rows)] = rows
        return mask
