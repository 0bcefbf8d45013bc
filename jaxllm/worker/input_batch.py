"""The model runner's persistent, host-side (numpy) state of the requests it holds.

Each request owns one row from admission until it finishes or is preempted: its
known token ids, its block table and its sampling parameters. A step gathers the rows
of the scheduled requests with vectorized numpy, so preparing a step costs O(tokens +
requests), not O(max_model_len) per request.
"""

from __future__ import annotations

import numpy as np

from jaxllm.core.sched_output import NewRequestData, SchedulerOutput
from jaxllm.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

# logit_bias entries, then -inf entries for EOS and stop token ids while below min_tokens
BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + 1
# stop tokens per row a multi-step decode loop checks on the device (EOS first, then the
# first stop_token_ids; the host checks them all: jaxllm.worker.decode_loop)
STOP_WIDTH = 8


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int, num_kv_groups: int = 1) -> None:
        r = max_num_seqs
        self.max_num_seqs = max_num_seqs
        self.row_of: dict[str, int] = {}
        self.num_removed = 0  # requests removed so far (a row may hold another request since)
        self.free_rows = list(range(r - 1, -1, -1))
        self.token_ids = np.zeros((r, max_model_len), np.int32)
        self.num_tokens = np.zeros(r, np.int32)  # prompt + sampled so far (with a step in flight's tokens)
        # of those, the tokens whose ids are here: all but the tokens of a step in flight (async scheduling)
        self.num_known = np.zeros(r, np.int32)
        self.num_prompt_tokens = np.zeros(r, np.int32)
        self.num_computed_tokens = np.zeros(r, np.int32)  # KV in the cache, before the step
        self.block_table = np.zeros((num_kv_groups, r, max_blocks_per_seq), np.int32)  # per KV cache group
        self.num_blocks = np.zeros((num_kv_groups, r), np.int32)
        # sampling parameters
        self.temperature = np.zeros(r, np.float32)
        self.top_k = np.zeros(r, np.int32)
        self.top_p = np.ones(r, np.float32)
        self.min_p = np.zeros(r, np.float32)
        self.presence_penalty = np.zeros(r, np.float32)
        self.frequency_penalty = np.zeros(r, np.float32)
        self.repetition_penalty = np.ones(r, np.float32)
        self.seeds = np.zeros((r, 2), np.uint32)
        self.bias_token_ids = np.zeros((r, BIAS_WIDTH), np.int32)
        self.bias_values = np.zeros((r, BIAS_WIDTH), np.float32)
        self.num_user_bias = np.zeros(r, np.int32)
        self.min_tokens = np.zeros(r, np.int32)
        self.stop_token_ids = np.full((r, STOP_WIDTH), -1, np.int32)  # -1: none
        self.logprobs = np.full(r, -1, np.int32)  # -1: not requested
        self.prompt_logprobs = np.full(r, -1, np.int32)
        self.prompt_scored = np.zeros(r, np.int32)  # prompt positions scored already (by the scheduler's count)
        self.lora_slot = np.zeros(r, np.int32)  # the adapter's device slot (0: none; jaxllm.worker.lora_manager)
        self.beam_candidates = np.zeros(r, np.int32)  # beam search: continuations ranked per step (0: none)

    def __len__(self) -> int:
        return len(self.row_of)

    def add_request(self, req: NewRequestData) -> int:
        row = self.free_rows.pop()
        self.row_of[req.req_id] = row
        n = len(req.token_ids)
        self.token_ids[row, :n] = req.token_ids
        self.num_tokens[row] = self.num_known[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.num_blocks[:, row] = 0
        self.block_table[:, row] = 0  # no block ids of the row's last request past its own
        self.append_blocks(row, req.block_ids)

        p = req.sampling_params
        self.temperature[row] = 0.0 if p.is_greedy else p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.seeds[row] = (req.seed & 0xFFFFFFFF, (req.seed >> 32) & 0xFFFFFFFF)
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.prompt_scored[row] = req.num_prompt_scored
        self.min_tokens[row] = p.min_tokens
        self.beam_candidates[row] = p.num_beam_candidates

        self.bias_token_ids[row] = 0
        self.bias_values[row] = 0.0
        bias = p.logit_bias or {}
        k = len(bias)
        self.bias_token_ids[row, :k] = list(bias.keys())
        self.bias_values[row, :k] = list(bias.values())
        self.num_user_bias[row] = k
        stops = list(p.stop_token_ids)
        if req.eos_token_id is not None and not p.ignore_eos:
            stops.append(req.eos_token_id)
        self.bias_token_ids[row, k:k + len(stops)] = stops
        self._suppress_stops(row, len(stops))
        first = stops[-1:] + stops[:STOP_WIDTH - 1] if len(stops) > STOP_WIDTH else stops  # EOS (last) kept
        self.stop_token_ids[row] = -1
        self.stop_token_ids[row, :len(first)] = first
        return row

    def _suppress_stops(self, row: int, num_stops: int) -> None:
        """-inf on the stop tokens while the request is below min_tokens."""
        k = self.num_user_bias[row]
        below = self.num_tokens[row] - self.num_prompt_tokens[row] < self.min_tokens[row]
        self.bias_values[row, k:k + num_stops] = float("-inf") if below else 0.0

    def remove_request(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)
            self.num_removed += 1

    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Append blocks to the row's tables, one list per KV cache group."""
        for g, ids in enumerate(block_ids):
            start = self.num_blocks[g, row]
            self.block_table[g, row, start:start + len(ids)] = ids
            self.num_blocks[g, row] = start + len(ids)

    def update(self, sched: SchedulerOutput) -> tuple[set[str], list[tuple[int, NewRequestData]]]:
        """A schedule's changes to the rows: its finished and preempted requests leave,
        its new ones take rows, its running ones gain their new blocks. The ids that
        left and the new (row, request) pairs, for the runner's own per-request state."""
        left = sched.finished_req_ids | sched.preempted_req_ids
        for req_id in left:
            self.remove_request(req_id)
        added = [(self.add_request(req), req) for req in sched.scheduled_new_reqs]
        for req in sched.scheduled_cached_reqs:
            row = self.row_of[req.req_id]
            self.append_blocks(row, req.new_block_ids)
            if req.last_token_id is not None:  # a beam's chosen token, in place of its sampled one
                self.token_ids[row, self.num_tokens[row] - 1] = req.last_token_id
        return left, added

    def count_in_flight(self, rows: np.ndarray, samples: np.ndarray, seq_lens: np.ndarray,
                        steps: np.ndarray | None) -> None:
        """Async scheduling, at a step's dispatch: each sampling row counts its token (a
        decode loop's row its `steps`) before the ids are known (num_known stays
        behind); min_tokens counts them. `rows`, `samples`, `seq_lens`: the step's."""
        sampling = rows[samples]
        num_before = self.num_tokens[sampling] - self.num_prompt_tokens[sampling]
        self.num_tokens[sampling] += 1 if steps is None else steps[samples]
        self.lift_min_tokens(sampling, num_before)
        self.num_computed_tokens[rows] = np.where(samples, self.num_tokens[rows] - 1, seq_lens)

    def record_known(self, rows: np.ndarray, starts: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        """Async scheduling, at a step's collect: the ids counted at dispatch, row i's
        `ids[:counts[i], i]` from position `starts[i]`."""
        self._write_tokens(rows, starts, ids, counts)
        self.num_known[rows] = starts + counts

    def record_step(self, rows: np.ndarray, samples: np.ndarray, seq_lens: np.ndarray, num_kept: np.ndarray,
                    last_tokens: np.ndarray) -> None:
        """A synchronous step's results: each sampling row gains its `num_kept` tokens
        (accepted drafts, already in token_ids, then `last_tokens`); a row's K/V is
        computed up to its latest token (a rejected draft's is to be overwritten)."""
        sampling = rows[samples]
        num_before = self.num_tokens[sampling] - self.num_prompt_tokens[sampling]
        self.num_tokens[sampling] += num_kept[samples] - 1
        self.append_sampled(sampling, last_tokens, num_before)
        self.num_computed_tokens[rows] = np.where(samples, self.num_tokens[rows] - 1, seq_lens)

    def record_loop(self, rows: np.ndarray, seq_lens: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        """A synchronous decode loop's results: row i gains `ids[:counts[i], i]`."""
        num_before = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        self._write_tokens(rows, seq_lens, ids, counts)
        self.num_tokens[rows] = self.num_known[rows] = seq_lens + counts
        self.lift_min_tokens(rows, num_before)
        self.num_computed_tokens[rows] = self.num_tokens[rows] - 1

    def _write_tokens(self, rows: np.ndarray, starts: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        """token_ids[rows[i], starts[i] + j] = ids[j, i] for j < counts[i]."""
        j = np.arange(ids.shape[0])[:, None]
        mask = j < counts
        self.token_ids[np.broadcast_to(rows, ids.shape)[mask], (starts + j)[mask]] = ids[mask]

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray, num_before: np.ndarray | None = None) -> None:
        """Record sampled tokens (one per row) and lift min_tokens suppression once met
        (`num_before`: each row's outputs before the step, where it gained accepted
        draft tokens too)."""
        if num_before is None:
            num_before = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        self.num_known[rows] = self.num_tokens[rows]
        self.lift_min_tokens(rows, num_before)

    def lift_min_tokens(self, rows: np.ndarray, num_before: np.ndarray) -> None:
        """Stop tokens allowed again in the rows whose outputs reached min_tokens, from
        `num_before` outputs (num_tokens counts them)."""
        num_outputs = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        met = (num_outputs >= self.min_tokens[rows]) & (num_before < self.min_tokens[rows])
        for row in rows[met]:
            k = self.num_user_bias[row]
            self.bias_values[row, k:] = 0.0
