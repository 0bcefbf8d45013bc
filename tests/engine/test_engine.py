"""The engine end to end on a tiny test model: exact greedy results whatever the batch,
chunking, preemption or prefix caching; seeds; stop conditions; zero compilations
after warm-up; no leaked KV blocks; validation before anything is queued."""

import contextlib
import pathlib

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from jaxllm import LLM, SamplingParams
from jaxllm.messages import EngineCoreRequest
from jaxllm.worker.buckets import StepShape
from tests.support.llm import KV_BYTES_PER_BLOCK, LAZY, assert_no_leaks, make_llm


def workload(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, 500, int(rng.integers(3, 100)))] for _ in range(n)]
    lengths = [int(rng.integers(1, 40)) for _ in range(n)]
    return prompts, lengths


@pytest.fixture(scope="module")
def pressured(test_models_dir):
    """Budget of 32 tokens (chunked prefill) and a 24-block pool (preemption)."""
    return make_llm(test_models_dir, kv_cache_memory=25 * KV_BYTES_PER_BLOCK)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_batch_invariance_and_hf_exactness(pressured, test_models_dir):
    prompts, lengths = workload(24)
    batched = pressured.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    core = pressured.llm_engine.core
    assert core.scheduler.num_preemptions > 0  # the pool was too small for everyone at once
    assert_no_leaks(pressured)

    # each prompt whole in one step, one sequence, single decode steps: another path than the batch's, and 7 step
    # shapes to compile, not 10
    alone = make_llm(test_models_dir, max_num_batched_tokens=128, max_num_seqs=1, num_scheduler_steps=1)
    hf = AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float32).eval()
    for prompt, n, out in zip(prompts, lengths, batched):
        got = out.outputs[0].token_ids
        assert len(got) == n and out.outputs[0].finish_reason == "length"
        assert alone.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0].token_ids == got
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        assert got == expected
    assert_no_leaks(alone)


def test_prefix_caching_hits_and_identical_output(test_models_dir):
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(3, 500, 70)]  # 4 full blocks of 16, then 6 tokens
    first, second = shared + [5, 6, 7], shared + [9, 10]  # the 6 reach `second` as a copy of first's block
    outputs = {}
    for caching in (True, False):
        llm = make_llm(test_models_dir, enable_prefix_caching=caching)
        a = llm.generate([first], greedy(12), use_tqdm=False)[0]
        b = llm.generate([second], greedy(12), use_tqdm=False)[0]
        assert a.num_cached_tokens == 0
        assert b.num_cached_tokens == (70 if caching else 0)
        outputs[caching] = (a.outputs[0].token_ids, b.outputs[0].token_ids)
        assert_no_leaks(llm)
    assert outputs[True] == outputs[False]


def test_common_prefix_of_the_whole_batch_gives_identical_output(test_models_dir):
    """Requests sharing a 112-token prefix, batched: the runner tells the attention that
    every sequence's first blocks are the same (the cpu backend then attends to them
    once for all), and each output is what the request gives alone without caching."""
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(3, 500, 112)]
    prompts = [shared + [int(t) for t in rng.integers(3, 500, k)] for k in (3, 9, 17, 30)]
    llm = make_llm(test_models_dir, max_num_batched_tokens=128, attention_backend="cpu")  # the one using the hint
    batched = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert llm.llm_engine.core.runner.stats.num_common_prefix_steps > 0
    assert_no_leaks(llm)
    alone = make_llm(test_models_dir, enable_prefix_caching=False)
    for prompt, out in zip(prompts, batched):
        assert alone.generate([prompt], greedy(20), use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_n_siblings_share_prompt_blocks(test_models_dir):
    llm = make_llm(test_models_dir)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 500, 50)]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    stats = llm.llm_engine.core.kv_cache_manager.prefix_cache_stats
    assert stats.hits == 2 * 48  # children 1 and 2 reuse child 0's three full prompt blocks
    assert_no_leaks(llm)


def test_seeded_sampling_is_batch_independent(pressured):
    prompts, _ = workload(6, seed=3)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = pressured.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    together = pressured.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    again = pressured.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together == again
    other_seed = pressured.generate([prompts[0]], params.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone
    assert_no_leaks(pressured)


def test_stop_conditions(pressured):
    tok = pressured.get_tokenizer()
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 500, 20)]
    reference = pressured.generate([prompt], greedy(30), use_tqdm=False)[0].outputs[0]
    ids, text = reference.token_ids, reference.text

    # stop token id: ends at its first occurrence, the token is kept in token_ids
    stop_id = ids[7]
    first = ids.index(stop_id)
    out = pressured.generate([prompt], greedy(30, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id

    # min_tokens: the stop token cannot end it (nor be sampled) before 10 outputs
    out = pressured.generate([prompt], SamplingParams(temperature=0, max_tokens=30, min_tokens=10,
                                                      stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 10 and stop_id not in out.token_ids[:9]

    # a stop string spanning a token boundary: the text ends right before it
    pieces = [tok.decode([t]) for t in ids]
    j = next(j for j in range(3, len(ids) - 1) if pieces[j] and pieces[j + 1] and pieces[j].isprintable()
             and pieces[j + 1].isprintable())
    stop = pieces[j][-1:] + pieces[j + 1][:1]
    out = pressured.generate([prompt], greedy(30, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]

    # EOS ends a request unless ignore_eos
    eos = tok.eos_token_id
    out = pressured.generate([prompt], SamplingParams(temperature=0, max_tokens=30, logit_bias={eos: 100}),
                             use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    out = pressured.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                      logit_bias={eos: 100}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"
    assert_no_leaks(pressured)


def test_max_tokens_default_and_model_len(test_models_dir):
    llm = make_llm(test_models_dir, max_model_len=64, max_num_seqs=1)  # one sequence: 6 step shapes, not 8
    prompt = list(range(3, 53))  # 50 tokens: 14 left
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 14 and out[0].outputs[0].finish_reason == "length"
    out = llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 14  # max_tokens=16 is capped by the model length
    assert_no_leaks(llm)


def test_logprobs_and_prompt_logprobs_match_the_model(test_models_dir):
    llm = make_llm(test_models_dir)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 500, 40)]
    out = llm.generate([prompt], greedy(4, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float32).eval()
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert abs(entry[prompt[p]].logprob - ref[p - 1, prompt[p]]) < 1e-4
        assert set(np.argsort(-ref[p - 1])[:2]) <= set(entry)
    for i, token in enumerate(out.outputs[0].token_ids):
        row = ref[len(prompt) - 1 + i]
        entry = out.outputs[0].logprobs[i]
        assert entry[token].rank == 1 and abs(entry[token].logprob - row[token]) < 1e-4
        assert set(np.argsort(-row)[:3]) <= set(entry) and len(entry) == 3
    assert abs(out.outputs[0].cumulative_logprob - sum(ref[len(prompt) - 1 + i, t] for i, t in
                                                       enumerate(out.outputs[0].token_ids))) < 1e-3
    assert_no_leaks(llm)


def test_validation_happens_before_anything_is_queued(pressured):
    good = [3, 4, 5]
    cases = [
        ([good, []], SamplingParams(), r"^prompt: must not be empty \(request 1 of 2\)"),
        ([good, [3, 10**6]], SamplingParams(), r"^prompt: token id 1000000 is out of range"),
        ([good, list(range(3, 300))], SamplingParams(), r"context length is 256 tokens.*297 tokens.*\(request 1 of 2\)"),
        ([good], SamplingParams(logit_bias={10**6: 1.0}), r"^logit_bias: token id 1000000.*\(request 0 of 1\)"),
    ]
    core = pressured.llm_engine.core
    for prompts, params, message in cases:
        with pytest.raises(ValueError, match=message) as frontend:
            pressured.generate(prompts, params, use_tqdm=False)
        assert not pressured.llm_engine.has_unfinished_requests()
        # the core, given the same requests without the frontend, refuses them in the same words
        reqs = [EngineCoreRequest(f"direct-{i}", p, params, None, 0.0) for i, p in enumerate(prompts)]
        with pytest.raises(ValueError) as direct:
            core.add_requests(reqs)
        assert str(direct.value) == str(frontend.value).rsplit(" (request", 1)[0]
        assert not core.has_unfinished_requests()
    with pytest.raises(ValueError, match="temperature: must be non-negative"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p: must be in"):
        SamplingParams(top_p=0)
    # one rule offline and on the server (whose completions allow 0 with echo): nothing
    # generated only where the prompt is scored
    with pytest.raises(ValueError, match="max_tokens: 0 generates nothing: it is only valid with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    assert_no_leaks(pressured)


def test_engine_options_are_checked_at_start_up(test_models_dir):
    with pytest.raises(ValueError, match=r"max_model_len: 256 tokens do not fit in the KV cache \(14 blocks of 16 tokens = 224 tokens"):
        make_llm(test_models_dir, kv_cache_memory=15 * KV_BYTES_PER_BLOCK)
    with pytest.raises(ValueError, match="max_model_len: 4096 exceeds the model's context length 1024"):
        make_llm(test_models_dir, max_model_len=4096)
    with pytest.raises(ValueError, match="block_size: must be a power of two"):
        make_llm(test_models_dir, block_size=12)
    with pytest.raises(ValueError, match="kv_cache_memory: cannot parse"):
        make_llm(test_models_dir, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="attention_backend: unknown 'cuda'"):
        make_llm(test_models_dir, attention_backend="cuda")


def test_evicted_prefix_is_recomputed_correctly(test_models_dir):
    """A prefix whose cached blocks were evicted by other requests is recomputed, and
    the output is the same as with caching off."""
    rng = np.random.default_rng(6)
    shared = [int(t) for t in rng.integers(3, 500, 64)]
    fillers = [[int(t) for t in rng.integers(3, 500, 150)] for _ in range(3)]
    second = shared + [11, 12]
    expected = make_llm(test_models_dir, enable_prefix_caching=False).generate([second], greedy(10), use_tqdm=False)
    llm = make_llm(test_models_dir, kv_cache_memory=20 * KV_BYTES_PER_BLOCK)
    llm.generate([shared + [9]], greedy(4), use_tqdm=False)
    hit = llm.generate([shared + [10]], greedy(4), use_tqdm=False)[0]
    assert hit.num_cached_tokens == 64  # cached while nothing else needed the blocks
    llm.generate(fillers, greedy(8), use_tqdm=False)  # 19 usable blocks: the shared prefix is evicted
    out = llm.generate([second], greedy(10), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_import_prints_nothing():
    import subprocess
    import sys

    code = "import jaxllm, jax; from jaxllm import LLM, SamplingParams; jax.devices()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr == "" and result.stdout == ""


def test_token_buckets():
    from jaxllm.worker.buckets import seq_bucket, token_buckets

    assert token_buckets(512) == [1, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(2048) == [1, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(100) == [1, 4, 8, 16, 32, 64, 100]  # the budget itself is always a bucket
    assert token_buckets(3) == [1, 3]
    assert token_buckets(512, speculative=True)[:4] == [1, 2, 4, 8]  # a lone decode with one draft
    assert seq_bucket(64, 16) == 16 and seq_bucket(64, 512) == 64


def hf_logprobs(test_models_dir, seq):
    hf = AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1).numpy()


def test_prompt_logprobs_once_each_under_preemption(pressured, test_models_dir):
    """A request preempted mid-prompt or after it is recomputed, but each prompt
    position is scored once: as many entries as prompt tokens, each the model's."""
    rng = np.random.default_rng(17)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (3, 150, 40, 90, 7, 120, 64, 33, 100, 12)]
    before = pressured.llm_engine.core.scheduler.num_preemptions
    params = [greedy(20, logprobs=1, prompt_logprobs=1, n=2 if i == 3 else 1) for i in range(len(prompts))]
    outs = pressured.generate(prompts, params, use_tqdm=False)
    assert pressured.llm_engine.core.scheduler.num_preemptions > before
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids) == 20
        ref = hf_logprobs(test_models_dir, prompt + out.outputs[0].token_ids)
        got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
        np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-3)
        sampled = out.outputs[0]
        got = [e[t].logprob for e, t in zip(sampled.logprobs, sampled.token_ids)]
        np.testing.assert_allclose(got, ref[len(prompt) - 1 + np.arange(20), sampled.token_ids], atol=2e-3)
    assert_no_leaks(pressured)


def test_scoring_reuses_a_cached_context(test_models_dir):
    """lm-eval's multiple choice: one context, several continuations, max_tokens=0. The
    context's KV and its prompt logprobs come from the cache to the token (all but its
    last token, whose position scores the continuation: 3 full blocks, then 4 tokens
    copied from the first choice's fourth block); the scores equal an uncached run's
    and the model's."""
    rng = np.random.default_rng(3)
    context = [int(t) for t in rng.integers(3, 500, 53)]  # 3 full blocks
    prompts = [context + [int(t) for t in rng.integers(3, 500, k)] for k in (1, 4, 2, 7)]
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    cached = make_llm(test_models_dir)
    first = cached.generate([prompts[0]], score, use_tqdm=False)
    rest = [cached.generate([p], score, use_tqdm=False)[0] for p in prompts[1:]]
    assert [o.num_cached_tokens for o in rest] == [52, 52, 52]
    # all at once (lm-eval sends a question's choices together): the later ones wait a
    # step for the first one's scores instead of computing the context again
    context2 = [int(t) for t in rng.integers(3, 500, 53)]
    together = [context2 + p[53:] for p in prompts]
    stats = cached.llm_engine.core.runner.stats
    computed_before = stats.num_tokens
    at_once = cached.generate(together, score, use_tqdm=False)
    assert [o.num_cached_tokens for o in at_once] == [0, 52, 52, 52]
    assert stats.num_tokens - computed_before == 54 + (57 - 52) + (55 - 52) + (60 - 52)
    plain = make_llm(test_models_dir, enable_prefix_caching=False).generate(prompts + together, score,
                                                                             use_tqdm=False)
    for prompt, got, want in zip(prompts + together, first + rest + at_once, plain):
        assert got.outputs[0].token_ids == [] and got.outputs[0].text == ""
        assert got.outputs[0].finish_reason == "length"
        assert len(got.prompt_logprobs) == len(prompt)
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert list(g) == list(w)  # same scored token, same top 2 in order
            np.testing.assert_allclose([x.logprob for x in g.values()], [x.logprob for x in w.values()], atol=5e-5)  # other step shapes
            assert [x.rank for x in g.values()] == [x.rank for x in w.values()]
        ref = hf_logprobs(test_models_dir, prompt)
        got_lp = [got.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
        np.testing.assert_allclose(got_lp, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    assert_no_leaks(cached)


def test_partly_shared_prompts_under_pressure_equal_an_uncached_run(pressured, test_models_dir):
    """Prompts sharing contexts of every length (inside a block, across blocks), some
    scoring their prompt, some generating, in a pool small enough to preempt and to hand
    out the blocks others copy from: every token and prompt logprob equals a run without
    prefix caching."""
    rng = np.random.default_rng(11)
    contexts = [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 16, 23, 41)]
    prompts, params = [], []
    for i in range(20):
        context = contexts[i % len(contexts)]
        prompts.append(context[:int(rng.integers(len(context) // 2, len(context) + 1))]
                       + [int(t) for t in rng.integers(3, 500, int(rng.integers(1, 6)))])
        params.append(SamplingParams(max_tokens=int(i % 3 == 0), prompt_logprobs=1, temperature=0) if i % 2
                      else greedy(int(rng.integers(20, 60))))
    core = pressured.llm_engine.core
    preemptions, copies = core.scheduler.num_preemptions, []
    apply = core.runner.apply_block_copies
    core.runner.apply_block_copies = lambda pairs: (copies.extend(pairs), apply(pairs))
    try:
        cached = pressured.generate(prompts, params, use_tqdm=False)
    finally:
        core.runner.apply_block_copies = apply
    assert copies and core.scheduler.num_preemptions > preemptions  # both paths were taken
    plain = make_llm(test_models_dir, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    for got, want in zip(cached, plain):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
        for g, w in zip((got.prompt_logprobs or [])[1:], (want.prompt_logprobs or [])[1:]):
            assert list(g) == list(w)
            np.testing.assert_allclose([x.logprob for x in g.values()], [x.logprob for x in w.values()], atol=5e-5)
    assert_no_leaks(pressured)


def penalized_greedy(test_models_dir, prompt, n, repetition_penalty=1.0, frequency_penalty=0.0,
                     presence_penalty=0.0) -> list[int]:
    """The penalties' rule step by step in numpy over HF's float64 logits: repetition
    over prompt and output tokens (divide positive logits, multiply negative ones),
    frequency by output count, presence by output presence; then greedy."""
    hf = AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float64).eval()
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].numpy()
        counts = np.bincount(out, minlength=logits.shape[0]).astype(np.float64)
        seen = counts > 0
        seen[prompt] = True
        logits = np.where(seen, np.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty), logits)
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0)
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out


def test_penalties_and_min_p_through_the_engine(test_models_dir):
    """Penalties in the whole engine (the token history on device, chunked prompts),
    batched with requests that use none, equal the numpy rule; min_p=1 samples only the
    most likely token, so at temperature 1 it is greedy."""
    llm = make_llm(test_models_dir)
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, 60, n)] for n in (9, 40, 17, 45)]  # small ids: repeats
    cases = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.5)]
    n = 16
    outs = llm.generate(prompts + prompts, [greedy(n, **c) for c in cases] + [greedy(n)] * len(prompts),
                        use_tqdm=False)
    changed = 0
    for prompt, case, out, plain in zip(prompts, cases, outs, outs[len(prompts):]):
        want = penalized_greedy(test_models_dir, prompt, n, **case)
        assert out.outputs[0].token_ids == want, case
        assert plain.outputs[0].token_ids == penalized_greedy(test_models_dir, prompt, n)
        changed += want != plain.outputs[0].token_ids
    assert changed >= 3  # the penalties mattered
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=n, ignore_eos=True, seed=1),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in outs[len(prompts):]]
    assert_no_leaks(llm)


@pytest.mark.slow  # 17 s, the default run's budget: test_warm_restart_loads_every_executable covers one engine's cache
def test_two_engines_in_one_process_keep_their_own_compilation_cache(test_models_dir, tmp_path):
    import jaxllm.platform

    small = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, kv_cache_memory=8 * KV_BYTES_PER_BLOCK,
                 num_scheduler_steps=1)  # three step shapes, no decode loops: each engine compiles them
    first = make_llm(test_models_dir, compilation_cache_dir=str(tmp_path / "a"), **small)
    make_llm(test_models_dir, compilation_cache_dir=str(tmp_path / "b"), **small)
    for name in ("a", "b"):
        assert list((tmp_path / name / "jaxllm-executables").rglob("*")), name
    assert first.llm_engine.core.runner.compilation._copy_store.directory == tmp_path / "a" / "jaxllm-executables"
    assert not [k for k, v in vars(jaxllm.platform).items() if k.startswith("_") and isinstance(v, pathlib.Path)]


def test_an_engine_without_warm_up_compiles_on_first_use(test_models_dir):
    """`warm_up=False` (`--no-warm-up`; the test engines' default, tests/support/llm.py) steps
    as a warmed-up engine does: each bucket is compiled when first called, the others
    never; warm-up compiles every one."""
    from jaxllm.engine.config import EngineConfig
    from jaxllm.engine.core import EngineCore

    small = dict(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=8, kv_cache_memory=8 * KV_BYTES_PER_BLOCK,
                 num_scheduler_steps=1)
    warm = make_llm(test_models_dir, warm_up=True, **small)
    expected = warm.generate([[5, 6, 7, 8, 9]], greedy(5), use_tqdm=False)[0]
    assert set(warm.llm_engine.core.runner.compilation._compiled) == set(warm.llm_engine.core.runner.buckets)
    core = EngineCore(EngineConfig(model=str(test_models_dir / "llama"), attention_backend="cpu",
                                   linear_backend="cpu", warm_up=False, **small), progress=False)
    assert not core.runner.compilation._compiled and core.warmup_seconds == 0
    compiled_within = []  # what each compile the core was told of added (watch_compiles)

    @contextlib.contextmanager
    def watching():
        before = set(core.runner.compilation._compiled)
        yield
        compiled_within.append(set(core.runner.compilation._compiled) - before)

    core.watch_compiles(watching)
    core.add_requests([EngineCoreRequest("r", [5, 6, 7, 8, 9], greedy(5), None, 0.0)])
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step().outputs for t in out.new_token_ids]
    assert tokens == expected.outputs[0].token_ids
    # the 5-token prompt in one step of bucket 8, then lone decodes (1); bucket 4 never compiled
    assert [shape.tokens for shape in core.runner.buckets] == [1, 4, 8]
    assert sorted(shape.tokens for shape in core.runner.compilation._compiled) == [1, 8]
    assert [[shape.tokens for shape in added] for added in compiled_within] == [[8], [1]]
    assert core.runner.num_compilations_after_warmup == 0
    core.close()


def test_warm_restart_loads_every_executable(test_models_dir, tmp_path):
    """A second process with the same compilation cache compiles nothing: every step
    executable comes from the store, and the tokens are the same."""
    import json
    import subprocess
    import sys

    code = f"""
import json
from jaxllm import LLM, SamplingParams
llm = LLM({str(test_models_dir / "llama")!r}, max_model_len=128, max_num_seqs=1, max_num_batched_tokens=4,
          kv_cache_memory={32 * KV_BYTES_PER_BLOCK}, compilation_cache_dir={str(tmp_path)!r}, progress=False,
          attention_backend="cpu", linear_backend="cpu")  # nothing measured: the test is of the executables
runner = llm.llm_engine.core.runner
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
print(json.dumps({{"buckets": len(runner.buckets) + len(runner.loop_buckets), "loaded": runner.num_loaded_executables,
                  "after_warmup": runner.num_compilations_after_warmup, "tokens": out.outputs[0].token_ids}}))
"""
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    # 2 token counts (1 and 4: few to compile), one decode loop's too
    assert first["loaded"] == 0 and first["buckets"] == 3
    assert second["loaded"] == second["buckets"] == 3  # compiled: buckets - loaded = 0
    assert first["after_warmup"] == second["after_warmup"] == 0
    assert second["tokens"] == first["tokens"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_leaves_no_unwritten_blocks_in_the_prefix_cache(test_models_dir, async_scheduling):
    """Blocks enter the prefix cache when a step is scheduled, before it writes them. If
    the step fails, they must leave again: the same prompt afterwards computes its KV
    (no hit on blocks that were never written) and gets the model's tokens."""
    llm = make_llm(test_models_dir, async_scheduling=async_scheduling)
    prompt = [int(t) for t in np.random.default_rng(9).integers(3, 500, 40)]  # the first step: 2 full blocks
    runner = llm.llm_engine.core.runner

    def fail(sched, bitmask=None):
        raise RuntimeError("injected step failure")

    runner.dispatch = fail  # both step loops call it (execute_model: dispatch, then collect)
    with pytest.raises(RuntimeError, match="injected step failure"):
        llm.generate([prompt, prompt[:20]], greedy(5), use_tqdm=False)
    del runner.dispatch  # the class's again
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([prompt], greedy(5), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    fresh = make_llm(test_models_dir, enable_prefix_caching=False).generate([prompt], greedy(5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert_no_leaks(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", pytest.param("bfloat16", marks=pytest.mark.slow),
                                            pytest.param("fp8", marks=pytest.mark.slow),
                                            pytest.param("fp8-scaled", marks=pytest.mark.slow)])  # (fp8's scales
# in the default run: tests/kernels/test_kv_cache_dtypes.py)
def test_quantized_kv_cache_through_the_engine(pressured, test_models_dir, kv_cache_dtype):
    """kv_cache_dtype: the same kv_cache_memory holds more blocks (bfloat16 2x; int8
    hd + 4 bytes a row against 4 hd); with prefix caching, chunking and preemption the
    outputs equal an uncached run of the same format exactly, and stay close to float32
    (the mean difference of the prompt tokens' logprobs and the greedy continuations
    equal to float32's, per format: fp8 without a scale is the coarsest; fp8-scaled is
    fp8 with calculate_kv_scales)."""
    scaled = kv_cache_dtype == "fp8-scaled"
    options = dict(kv_cache_dtype="fp8", calculate_kv_scales=True) if scaled else dict(kv_cache_dtype=kv_cache_dtype)
    rng = np.random.default_rng(5)
    context = [int(t) for t in rng.integers(3, 500, 40)]
    prompts = [context[:int(rng.integers(20, 41))] + [int(t) for t in rng.integers(3, 500, 3)] for _ in range(8)]
    params = [SamplingParams(max_tokens=24, prompt_logprobs=1, temperature=0, ignore_eos=True)] * len(prompts)
    llm = make_llm(test_models_dir, kv_cache_memory=25 * KV_BYTES_PER_BLOCK, **options)
    core = llm.llm_engine.core
    ratio = {"int8": 4 * 32 / (32 + 4), "bfloat16": 2, "fp8": 4, "fp8-scaled": 4}[kv_cache_dtype]  # head_dim 32
    assert core.cache.num_blocks == int(25 * ratio)
    why = "as asked; scales calculated from the first batch" if scaled else "as asked"
    assert f"KV cache ({core.runner.kv_format.name}, {why})" in core.describe()
    cached = llm.generate(prompts, params, use_tqdm=False)
    plain = make_llm(test_models_dir, kv_cache_memory=25 * KV_BYTES_PER_BLOCK, enable_prefix_caching=False,
                     **options).generate(prompts, params, use_tqdm=False)
    if scaled:
        assert all((np.asarray(c.k_layer_scale) > 0).all() for c in core.runner.kv_caches)
    exact = pressured.generate(prompts, params, use_tqdm=False)
    same, diffs = 0, []
    for got, want, f32 in zip(cached, plain, exact):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for g, w, e in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], f32.prompt_logprobs[1:]):
            np.testing.assert_allclose([x.logprob for x in g.values()], [x.logprob for x in w.values()], atol=5e-5)
            diffs.append(abs(next(iter(g.values())).logprob - next(iter(e.values())).logprob))
        same += got.outputs[0].token_ids == f32.outputs[0].token_ids
    # measured: bfloat16 mean 0.019 (7 of 8 continuations equal), int8 0.076 (5), fp8 0.38 (2), fp8-scaled 0.375
    # (0: fp8's 3 mantissa bits round alike at any scale; this model's K/V are far from saturating)
    assert np.mean(diffs) < {"bfloat16": 0.04, "int8": 0.15, "fp8": 0.6, "fp8-scaled": 0.6}[kv_cache_dtype]
    assert same >= {"bfloat16": 6, "int8": 4, "fp8": 1, "fp8-scaled": 0}[kv_cache_dtype]
    assert_no_leaks(llm)


def scaled_checkpoint(test_models_dir, tmp_path, drop: str | None = None):
    """The llama test model with fp8 KV cache scales per layer (near what its first batch
    calculates: K up to ~3.6, V ~3), the `drop` tensor left out."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "scaled"
    shutil.copytree(test_models_dir / "llama", folder, dirs_exist_ok=True)
    tensors = load_file(folder / "model.safetensors")
    layers = sum(name.endswith("self_attn.q_proj.weight") for name in tensors)
    k, v = np.linspace(0.018, 0.02, layers, dtype=np.float32), np.linspace(0.03, 0.034, layers, dtype=np.float32)
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(k[i])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(v[i])
    tensors.pop(drop, None)
    save_file(tensors, folder / "model.safetensors")
    return folder, k, v


@pytest.mark.slow  # (18 s: the default run's budget) the scales' folding by default: tests/kernels/test_kv_cache_dtypes.py
def test_fp8_kv_cache_reads_a_checkpoints_scales(test_models_dir, tmp_path):
    """A checkpoint's model.layers.{i}.self_attn.k_scale / v_scale (vLLM reads them) scale
    an fp8 cache, each layer's own, for every KV head, and its outputs stay near a
    float32 cache's; a checkpoint with them for some layers only is refused by name."""
    folder, k, v = scaled_checkpoint(test_models_dir, tmp_path)
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory="1MiB",
              kv_cache_dtype="fp8", attention_backend="cpu", linear_backend="cpu", progress=False, **LAZY)
    core = llm.llm_engine.core
    assert "the checkpoint's scales" in core.describe()
    np.testing.assert_array_equal([np.asarray(c.k_layer_scale) for c in core.runner.kv_caches], np.repeat(k[:, None], 2, 1))
    np.testing.assert_array_equal([np.asarray(c.v_layer_scale) for c in core.runner.kv_caches], np.repeat(v[:, None], 2, 1))
    prompt = [[int(t) for t in np.random.default_rng(1).integers(3, 500, 30)]]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got = llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]
    exact = make_llm(test_models_dir).generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]
    diffs = [abs(next(iter(g.values())).logprob - next(iter(e.values())).logprob) for g, e in zip(got, exact)]
    assert np.mean(diffs) < 0.6  # fp8's rounding (the unscaled cache's on this model: 0.38)
    np.testing.assert_array_equal(np.asarray(core.runner.kv_caches[0].k_layer_scale), [k[0]] * 2)  # kept
    last = f"model.layers.{len(k) - 1}.self_attn.v_scale"
    folder, _, _ = scaled_checkpoint(test_models_dir, tmp_path, drop=last)
    with pytest.raises(Exception, match=f"{last} is missing"):
        LLM(str(folder), max_model_len=256, kv_cache_dtype="fp8", progress=False)


@pytest.mark.slow  # two more engines
def test_checkpoint_scales_give_way(test_models_dir, tmp_path):
    """calculate_kv_scales replaces a checkpoint's scales (the start-up line says so);
    a cache of another format does not read them."""
    folder, _, _ = scaled_checkpoint(test_models_dir, tmp_path)
    options = dict(max_model_len=256, kv_cache_memory="1MiB", attention_backend="cpu", linear_backend="cpu",
                   progress=False)
    again = LLM(str(folder), kv_cache_dtype="fp8", calculate_kv_scales=True, **options).llm_engine.core
    assert "scales calculated from the first batch (in place of the checkpoint's)" in again.describe()
    assert LLM(str(folder), kv_cache_dtype="int8", **options).llm_engine.core.runner.kv_caches[0].k_layer_scale is None


@pytest.mark.parametrize("name", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)])  # (the default run's budget)
def test_a_one_token_step_writes_the_kv_cache_in_place(test_models_dir, name):
    """A step of one token (one sequence decoding) writes its K/V into the caches in
    place: its executable copies no cache array. XLA turns a one-row scatter into a
    dynamic-update-slice, which copied whole cache arrays every such step: ~0.7 ms a
    token for SmolLM2, seconds a token for Gemma 3, whose layer groups share arrays
    (jaxllm.attention.kv_cache.write_kv_cache writes a lone row as two). Nor the token
    history, which it copied twice (worker.step.set_tokens: the same, and the history
    read only after its update). The same holds for the multi-step decode loop's
    executable, whose while loop carries the caches and history."""
    import re

    import jax

    llm = LLM(str(test_models_dir / name), max_model_len=128, max_num_seqs=1, max_num_batched_tokens=32,
              attention_backend="cpu", progress=False, **LAZY)
    runner = llm.llm_engine.core.runner
    shapes = {tuple(a.shape) for a in jax.tree.leaves(runner.kv_caches)}
    shapes |= {(s[0] * s[1], *s[2:]) for s in shapes}  # the flat [slots, ...] view the write scatters into
    shapes.add(tuple(runner.history.shape))
    assert runner.kv_groups.num_groups == (2 if name == "gemma3" else 1)
    for shape in [StepShape(1, 1, 1), *runner.loop_buckets]:  # a step, and the decode loop's
        hlo = runner.compilation.get(shape).as_text()
        copied = {tuple(map(int, dims.split(","))) for dims in re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} copy\(",
                                                                        hlo)}
        assert not copied & shapes, shape
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_profile_reads_the_step_by_name(test_models_dir):
    """The model's parts are named scopes (jax.named_scope), so a profile or an HLO dump
    of a step reads layer{i}/qkv_proj, /rope, /kv_write, /attention, /o_proj, /mlp and
    logits."""
    import re

    runner = make_llm(test_models_dir).llm_engine.core.runner
    text = runner.compilation.get(runner.buckets[0]).as_text()
    names = set(re.findall(r'op_name="([^"]*)"', text))
    for layer in ("layer0", "layer1"):  # layer1, the last, runs its o_proj and mlp on the sample rows (a cond)
        for part in ("qkv_proj", "rope", "kv_write", "attention", "o_proj", "mlp"):
            assert any(re.search(rf"\b{layer}/(.*/)?{part}/", name) for name in names), (layer, part)
    assert any("logits/" in name for name in names)
