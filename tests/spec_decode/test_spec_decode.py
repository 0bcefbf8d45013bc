"""Speculative decoding's pieces so far (issue 22): the configuration, validated in one
place, and the n-gram proposer against a brute-force oracle."""

import json
import re
from collections import Counter

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm import LLM
from jaxllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.kv_cache_groups import kv_cache_groups
from jaxllm.messages import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram_proposer import NgramProposer
from tests.support.llm import LAZY


def test_config_defaults_follow_vllm():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}').prompt_lookup_max == 5
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
                                 "disable_by_batch_size": 8})
    assert (c.model, c.disable_by_batch_size) == ("/m", 8)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle", "num_speculative_tokens": 4}, "method 'eagle' is not supported; choose one of ngram"),
    ({"method": "ngram"}, "are required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown field.*lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "short_match_tokens": 3}, r"short_match_tokens \(3\) exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "short_match_tokens": 0}, "short_match_tokens must be a"),
    ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "short_match_tokens": 1}, "'ngram' only"),
    ("{not json", "not JSON"),
    ([1, 2], "expected an object"),
])
def test_config_refusals_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def oracle(tokens: list[int], min_n: int, max_n: int, k: int, short_k: int | None = None) -> list[int]:
    """The definition, by brute force: longest n first, latest earlier occurrence; a
    match shorter than max_n proposes short_k tokens."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                follow = tokens[i + n:]
                count = k if n == max_n or short_k is None else short_k
                return [follow[j % len(follow)] for j in range(count)]
    return []


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(2, 4, 3)
    assert p.propose(np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 7, 8, 2, 3, 4])).tolist() == [7, 8, 2]
    assert p.propose(np.array([5, 6, 5, 6])).tolist() == [5, 6, 5]  # near the end: the period repeats
    assert p.propose(np.array([1, 2, 3])).tolist() == []  # no earlier bigram
    assert NgramProposer(1, 1, 2).propose(np.array([7, 1, 7])).tolist() == [1, 7]
    assert NgramProposer(2, 3, 4).propose(np.array([4, 9, 9, 9])).tolist() == [9, 9, 9, 9]  # a run
    # short_match_tokens: a match shorter than max_n proposes fewer
    short = NgramProposer(1, 3, 5, short_k=2)
    assert short.propose(np.array([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])).tolist() == [4, 5, 6, 7, 1]  # 3 tokens matched
    assert short.propose(np.array([8, 2, 3, 4, 5, 6, 7, 1, 2, 3])).tolist() == [4, 5]  # 2 tokens matched
    assert short.propose(np.array([9, 9, 3, 4, 5, 6, 7, 1, 2, 3])).tolist() == [4, 5]  # 1 token


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 5), short=st.one_of(st.none(), st.integers(1, 5)))
def test_ngram_matches_the_brute_force_definition(tokens, min_n, extra, k, short):
    short = None if short is None else min(short, k)
    got = NgramProposer(min_n, min_n + extra, k, short).propose(np.array(tokens, np.int32))
    assert got.tolist() == oracle(tokens, min_n, min_n + extra, k, short)


# ---- the scheduler's bookkeeping across rejections --------------------------------------


class FakeRunner:
    """Plays the model runner for the scheduler: keeps each request's block tables as
    the scheduler outputs give them, "writes" each computed position's K/V as (group,
    the tokens up to it: real ones, then the step's drafts) and, before each step,
    checks that every position the step's queries read (every earlier one in a full
    group, the window's in a sliding one) holds the request's real tokens. Each
    sampling row accepts a random number of its drafts, gains a token that differs
    from the next draft, and proposes random drafts."""

    def __init__(self, scheduler: Scheduler, windows, block_size: int, k: int, rng) -> None:
        self.scheduler, self.windows, self.bs, self.k, self.rng = scheduler, windows, block_size, k, rng
        self.tables: dict[str, list[list[int]]] = {}
        self.kv: dict[int, list] = {}
        self.num_accepted = self.num_rejected = 0

    def execute(self, sched) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.tables.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        for cached in sched.scheduled_cached_reqs:
            for table, ids in zip(self.tables[cached.req_id], cached.new_block_ids):
                table += ids
        for src, dst in sched.block_copies:
            self.kv[dst] = list(self.kv.get(src, [None] * self.bs))
        result = ModelRunnerOutput([], [])
        for req_id, n in sched.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            drafts = sched.scheduled_spec_decode_tokens.get(req_id, [])
            start = request.num_computed_tokens - n
            self._check_reads(req_id, request.all_token_ids, start)
            self._write(req_id, request.all_token_ids + drafts, start, n)
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(self._verify(request, drafts) if request.samples_this_step else [])
            proposal = self.rng.integers(0, 4, int(self.rng.integers(0, self.k + 1))).tolist()
            if result.sampled_token_ids[-1] and proposal:
                result.spec_token_ids[req_id] = proposal
        return result

    def _verify(self, request: Request, drafts: list[int]) -> list[int]:
        accepted = int(self.rng.integers(0, len(drafts) + 1))
        token = int(self.rng.integers(0, 4))
        if accepted < len(drafts) and token == drafts[accepted]:
            token = (token + 1) % 4  # a rejection: the target's token differs from the draft
        self.num_accepted += accepted
        self.num_rejected += len(drafts) - accepted
        return drafts[:accepted] + [token]

    def _check_reads(self, req_id: str, tokens: list[int], start: int) -> None:
        for g, window in enumerate(self.windows):
            for pos in range(0 if window is None else max(start - window + 1, 0), start):
                block = self.tables[req_id][g][pos // self.bs]
                assert block != 0, (req_id, g, pos)
                assert self.kv[block][pos % self.bs] == (g, tuple(tokens[:pos + 1])), (req_id, g, pos)

    def _write(self, req_id: str, tokens: list[int], start: int, n: int) -> None:
        for g in range(len(self.windows)):
            for pos in range(start, start + n):
                block = self.tables[req_id][g][pos // self.bs]
                self.kv.setdefault(block, [None] * self.bs)[pos % self.bs] = (g, tuple(tokens[:pos + 1]))


@pytest.mark.parametrize("windows", [(None,), (None, 5, 5)], ids=["full", "hybrid"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_rejected_drafts_leave_no_stale_kv_and_no_leak(windows, seed):
    """Random acceptance lengths through the real scheduler and KV cache managers, with
    chunked prefill (a budget of 7 tokens cuts drafts short), preemption (a 24-block
    pool; 40 shared by three groups) and prefix caching (prompts repeating earlier requests' prompts and outputs):
    no step reads a position that does not hold the request's real token, counts stay
    consistent, and every block comes back."""
    rng = np.random.default_rng(seed)
    bs, k = 2, 3
    if len(windows) == 1:
        kv = KVCacheManager(24, bs, enable_caching=True, chunk=7)
    else:
        kv = HybridKVCacheManager(40, bs, kv_cache_groups(list(windows)), chunk=7, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=7, max_model_len=40)
    runner = FakeRunner(scheduler, windows, bs, k, rng)
    finished: list[list[int]] = [[1, 2, 3, 1, 2]]
    for step in range(150):
        if step < 100 and rng.random() < 0.3:
            base = finished[int(rng.integers(len(finished)))]
            prompt = base[:int(rng.integers(1, len(base) + 1))] + rng.integers(0, 4, int(rng.integers(0, 4))).tolist()
            max_tokens = int(rng.integers(1, 12))
            scheduler.add_request(Request(f"r{step}", prompt[:24], max_tokens=max_tokens,
                                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        sched = scheduler.schedule()
        outputs = scheduler.update_from_output(sched, runner.execute(sched)).outputs
        gained = {out.request_id for out in outputs if out.new_token_ids}
        for request in scheduler.running:
            assert request.num_computed_tokens <= request.num_tokens
            assert len(request.spec_token_ids) <= min(k, request.max_kv_tokens - request.num_tokens)
            if request.request_id in gained:  # all but the token just gained is computed
                assert request.num_computed_tokens == request.num_tokens - 1
        finished += [r.all_token_ids for r in scheduler.requests.values() if r.num_output_tokens > 2][:1]
    while scheduler.has_unfinished_requests():
        sched = scheduler.schedule()
        scheduler.update_from_output(sched, runner.execute(sched))
    assert kv.num_used_blocks == 0
    stats = scheduler.make_stats().spec_decoding
    assert stats.num_accepted_tokens == runner.num_accepted
    assert stats.num_draft_tokens == runner.num_accepted + runner.num_rejected


# ---- through LLM: exactly the outputs of decoding without speculation ---------------------

KV_BYTES_PER_BLOCK = 16 * 2 * 2 * 64 * 4  # the llama test model: block_size x (K,V) x layers x kv_size x float32
# short_match_tokens: drafts of 1 and 3 tokens (the accounting is the same either way)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "short_match_tokens": 1}


def make_llm(test_models_dir, **options):
    """Budget of 32 tokens (chunked prefill, drafts cut short) and a 24-block pool (preemption)."""
    config = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16,
                  kv_cache_memory=25 * KV_BYTES_PER_BLOCK, attention_backend="cpu", linear_backend="cpu",
                  progress=False, **LAZY)  # nothing measured at start-up
    return LLM(str(test_models_dir / "llama"), **(config | options))


@pytest.fixture(scope="module")
def engines(test_models_dir):
    """The oracle without speculation, by single decode steps as a speculating engine decodes (the same tokens as
    with decode loops; none to compile), and the n-gram engine."""
    return make_llm(test_models_dir, num_scheduler_steps=1), make_llm(test_models_dir, speculative_config=NGRAM)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts repeating a short random pattern (so lookup finds matches), some with a
    shared start (prefix cache hits)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 500, 40).tolist()
    prompts = []
    for i in range(n):
        pattern = rng.integers(3, 500, int(rng.integers(3, 9))).tolist()
        prompts.append((shared if i % 3 == 0 else []) + (pattern * 12)[:int(rng.integers(10, 80))])
    return prompts


def run(llm: LLM, prompts, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.core
    assert not core.has_unfinished_requests() and core.kv_cache_manager.num_used_blocks == 0
    assert core.runner.num_compilations_after_warmup == 0
    return outputs


def test_greedy_outputs_identical_with_chunking_preemption_and_prefix_hits(engines):
    base, spec = engines
    prompts = repetitive_prompts(16, 0)
    lengths = np.random.default_rng(1).integers(4, 60, len(prompts)).tolist()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lengths]
    expected = run(base, prompts, params)
    core = spec.llm_engine.core
    before = core.scheduler.num_preemptions
    got = run(spec, prompts, params)
    for e, g, n in zip(expected, got, lengths):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids and len(g.outputs[0].token_ids) == n
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)],
                                   [lp[t].logprob for lp, t in zip(e.outputs[0].logprobs, e.outputs[0].token_ids)],
                                   atol=1e-5)
    stats = core.scheduler.spec_stats
    assert core.scheduler.num_preemptions > before  # the pool was too small for every request at once
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were accepted and rejected
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens and len(stats.accepted_per_pos) == 3
    assert sum(o.num_cached_tokens for o in got) > 0


def test_seeded_sampling_and_stop_conditions_identical(engines):
    """Temperature, top-k/top-p, penalties, min_tokens, stop ids and stop strings: each
    position drawn with its own uniform as without drafts, so seeded outputs agree."""
    base, spec = engines
    prompts = repetitive_prompts(12, 2)
    tok = base.get_tokenizer()
    reference = run(base, prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = reference[0].outputs[0].text
    params = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=40, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.5, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                       max_tokens=40, seed=8, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[reference[0].outputs[0].token_ids[3]]),
        SamplingParams(temperature=0, max_tokens=40, stop=[text[9:12]] if len(text) > 12 else None, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tok.eos_token_id, 300]),
        SamplingParams(temperature=1.0, min_p=0.05, max_tokens=25, seed=9, ignore_eos=True),
    ] * 2
    expected, got = run(base, prompts, params), run(spec, prompts, params)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (e.outputs[0].finish_reason,
                                                                           e.outputs[0].stop_reason)
        assert (g.outputs[0].logprobs is None) == (e.outputs[0].logprobs is None)
        if g.outputs[0].logprobs is not None:
            assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)


def test_structured_outputs_speculate_and_stay_identical(engines):
    """Requests under a regex or a JSON schema get drafts too (the drafts the grammar
    accepts; each drafted position sampled under the grammar's mask after the drafts
    before it): greedy and seeded outputs are those without speculation, each matches
    its constraint, and drafts of constrained requests are accepted."""
    import json
    import re

    import jsonschema

    from jaxllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                        "minItems": 4, "maxItems": 12}},
              "required": ["tags"], "additionalProperties": False}
    regex = "(abc |de ){4,16}x"
    prompts = repetitive_prompts(8, 4)
    params = [SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 0.8, seed=i,
                             structured_outputs=StructuredOutputsParams(regex=regex) if i % 4 < 2 else
                             StructuredOutputsParams(json=schema, disable_any_whitespace=True))
              for i in range(len(prompts))]
    base, spec = engines
    before = spec.llm_engine.core.scheduler.spec_stats
    want, got = run(base, prompts, params), run(spec, prompts, params)
    for p, a, b in zip(params, want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason == "stop"
        text = b.outputs[0].text
        if p.structured_outputs.regex:
            assert re.fullmatch(regex, text), text
        else:
            jsonschema.validate(json.loads(text), schema)
    stats = spec.llm_engine.core.scheduler.spec_stats
    assert stats.num_accepted_tokens - before.num_accepted_tokens > 20


def test_disable_by_batch_size(engines, test_models_dir):
    """Drafts only while fewer requests run than `disable_by_batch_size`: four requests
    start together (none drafted), the long one speculates once the short ones are done."""
    base, _ = engines
    spec = make_llm(test_models_dir, speculative_config=NGRAM | {"disable_by_batch_size": 3})
    runner = spec.llm_engine.core.runner
    held_when_proposing = []
    propose = runner.proposer.propose_batch
    runner.proposer.propose_batch = lambda batch, *a: held_when_proposing.append(len(batch)) or propose(batch, *a)
    prompts = repetitive_prompts(4, 6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (60, 6, 6, 6)]
    got = run(spec, prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in run(base, prompts, params)]
    assert held_when_proposing and max(held_when_proposing) < 3
    assert spec.llm_engine.core.scheduler.spec_stats.num_drafts > 0


def test_sampled_distribution_matches_the_target(engines):
    """Different draws (seeds 0.. without speculation, 10000.. with): the second and
    third tokens (the third sampled at the first draft's position when the lookup
    proposed drafts after the first token and the second accepted one) have the same
    joint distribution with and without speculation (chi-square, bins of too few
    draws pooled). The seeded test above is the sharp one: the same seed gives the
    same tokens."""
    base, spec = engines
    prompt = [17, 230, 45] * 4
    # more of the mass on the prompt's tokens (lookup finds each, the target agrees more often)
    params = dict(temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias=dict.fromkeys(prompt, 2.0))
    stats = spec.llm_engine.core.scheduler.spec_stats
    drafts_before, accepted_before = stats.num_drafts, (stats.accepted_per_pos or (0,))[0]
    n = 400
    counts = []
    for llm, first_seed in ((base, 0), (spec, 10000)):
        outs = run(llm, [prompt] * n, [SamplingParams(seed=first_seed + i, **params) for i in range(n)])
        counts.append(Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs))
    stats = spec.llm_engine.core.scheduler.spec_stats
    assert stats.num_drafts - drafts_before > n / 2 and stats.accepted_per_pos[0] - accepted_before > n / 10
    assert counts[0] != counts[1]  # different draws
    tokens = sorted(set(counts[0]) | set(counts[1]))
    table = np.array([[c[t] for t in tokens] for c in counts])
    common = table.sum(axis=0) >= 10
    table = np.concatenate([table[:, common], table[:, ~common].sum(axis=1, keepdims=True)], axis=1)
    assert table.shape[1] >= 8, table  # a spread distribution
    assert scipy.stats.chi2_contingency(table).pvalue > 1e-3, (table, stats)


# all slow (the 15-minute budget): by default the fake runner's property test drives the hybrid manager
@pytest.mark.parametrize("attention", [pytest.param("cpu", marks=pytest.mark.slow),
                                       pytest.param("xla", marks=pytest.mark.slow),
                                       pytest.param("pallas", marks=pytest.mark.slow)])
def test_greedy_identical_under_the_hybrid_cache(test_models_dir, attention):
    """The Gemma-3-shaped test model (a sliding layer of window 12, blocks of 4): drafted
    rows are queries of several tokens in both groups' tables, and a sliding group
    frees blocks while rejected drafts roll back; the tokens equal decoding without
    speculation. Attention `pallas` runs in interpret mode."""
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], list(range(40, 60)) * 2]
    params = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)
    outputs = []
    for spec in (None, NGRAM):
        llm = LLM(str(test_models_dir / "gemma3"), max_model_len=160, max_num_seqs=2, max_num_batched_tokens=32,
                  block_size=4, kv_cache_memory="96KiB", attention_backend=attention, linear_backend="xla",
                  speculative_config=spec, progress=False, **LAZY)
        outputs.append([o.outputs[0].token_ids for o in run(llm, prompts, params)])
    assert outputs[0] == outputs[1]
    assert llm.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_cli_flag_and_metrics():
    """`--speculative-config '{...}'` parses into the engine's config (errors name the
    field); the Prometheus counters follow the core's running totals."""
    import argparse

    from jaxllm.engine.config import add_cli_args, from_cli_args
    from jaxllm.messages import SchedulerStats, SpecDecodingStats
    from jaxllm.metrics import EngineMetrics

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = from_cli_args(parser.parse_args(["--speculative-config", json.dumps(NGRAM)]))
    assert config.speculative_config == SpeculativeConfig(**NGRAM)
    assert from_cli_args(parser.parse_args([])).speculative_config is None
    with pytest.raises(ValueError, match="speculative_config: num_speculative_tokens must be a positive"):
        from_cli_args(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']))

    metrics = EngineMetrics("m", 16, 256)
    totals = SpecDecodingStats().observe(3, 2).observe(2, 0)
    metrics.observe_stats(SchedulerStats(spec_decoding=totals))
    metrics.observe_stats(SchedulerStats(spec_decoding=totals.observe(3, 3)))
    text = metrics.render().decode()
    for name, value in [("num_drafts_total", 3), ("num_draft_tokens_total", 8), ("num_accepted_tokens_total", 5)]:
        assert f'vllm:spec_decode_{name}{{engine="0",model_name="m"}} {value}.0' in text
    for position, value in enumerate([2, 2, 1]):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{position}"}} '
                f'{value}.0') in text
    assert totals.observe(3, 3).mean_acceptance_length == 1 + 5 / 3


@pytest.mark.slow
def test_server_speculates_as_configured(test_models_dir, tmp_path):
    """`python -m jaxllm.serve --speculative-config '{...}'` (vLLM's form): completions,
    streamed and not, are token for token those of an engine without speculation, and
    /metrics counts the drafts."""
    import httpx

    from tests.support.server import API_KEY, Server

    prompts = repetitive_prompts(3, 5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = LLM(str(test_models_dir / "llama"), max_model_len=256, progress=False, **LAZY)
    expected = [o.outputs[0].text for o in reference.generate(prompts, params, use_tqdm=False)]
    server = Server(test_models_dir / "llama", tmp_path, "--speculative-config", json.dumps(NGRAM), measure=True)
    try:
        client = server.client()
        for prompt, want in zip(prompts, expected):
            r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=40,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == want and r.usage.completion_tokens == 40
        stream = client.completions.create(model=r.model, prompt=prompts[0], max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]
        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        values = {name: float(value) for name, value in
                  re.findall(r"^(vllm:spec_decode_\w+?)(?:_total)?\{[^}]*\} (\S+)$", text, re.M)}
        assert values["vllm:spec_decode_num_draft_tokens"] >= values["vllm:spec_decode_num_accepted_tokens"] > 0
        assert values["vllm:spec_decode_num_drafts"] > 0
    finally:
        server.stop()


# ---- the draft-model proposer ------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A one-layer random llama with the test models' tokenizer: another model, the same vocabulary."""
    import make_test_model

    out = tmp_path_factory.mktemp("draft")
    make_test_model.write_model(out, "llama", seed=1, layers=1)
    return out / "llama"


def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("draft", [pytest.param("other", marks=pytest.mark.slow), "target"])
def test_draft_model_outputs_identical(engines, test_models_dir, draft_dir, draft):
    """Greedy and seeded outputs with a draft model equal those without, through
    chunked prefill (a 32-token budget), preemption (the draft's K/V takes its share
    of the pool's memory: 26 blocks of both) and prefix hits. A random other model is rarely right;
    the target as its own draft is right every time (greedy)."""
    base, _ = engines
    path = draft_dir if draft == "other" else test_models_dir / "llama"
    spec = make_llm(test_models_dir, kv_cache_memory=40 * KV_BYTES_PER_BLOCK, speculative_config=draft_config(path))
    prompts = repetitive_prompts(12, 3)
    lengths = np.random.default_rng(4).integers(4, 50, len(prompts)).tolist()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(lengths)]
    expected, got = run(base, prompts, params), run(spec, prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    core = spec.llm_engine.core
    stats, drafter = core.scheduler.spec_stats, core.runner.proposer
    assert core.scheduler.num_preemptions > 0 and sum(o.num_cached_tokens for o in got) > 0
    assert drafter.runner.num_compilations_after_warmup == 0
    core.step()  # delivers the finished ids: the drafter lets go of every request
    assert drafter.manager.num_used_blocks == 0 and not drafter.requests
    if draft == "target":
        assert stats.num_drafts > 50
        assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens  # the sampled rows reject some
    else:
        assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_draft_model_refusals(test_models_dir):
    from jaxllm.loaders import default_model_path

    with pytest.raises(ValueError, match=r"the draft model's vocabulary \(49152 tokens\) differs from the target's"):
        make_llm(test_models_dir, speculative_config=draft_config(default_model_path()))
    with pytest.raises(ValueError, match="needs `model`"):
        make_llm(test_models_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
