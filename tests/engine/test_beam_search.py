"""Beam search in the engine (jaxllm.core.beam_search) against transformers' beam search
on the same float32 weights: the same sequences in the same order, cum_logprob within
1e-4; beams share the prompt's blocks; no block leaks after completion or abort;
preemption recomputes a group to the same beams; bad requests refused before anything
is queued."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import transformers

from jaxllm import LLM
from jaxllm.sampling_params import BeamSearchParams, SamplingParams
from tests.support.llm import KV_BYTES_PER_BLOCK, LAZY, assert_no_leaks, make_llm

SLOW_CASES = ("mistral", "qwen2", "gemma3")
EOS = 2  # the test models' EOS
# (length_penalty, min_tokens) with a stop token inside the beams: three by default, three more slow
GRID = [(0.5, 0), (1.0, 3), (2.0, 0)]
MORE = [(0.5, 3), (1.0, 0), (2.0, 3)]


def hf_beams(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
             stops: tuple[int, ...] = (), min_tokens: int = 0) -> list[tuple[list[int], float]]:
    """transformers' beam search: the generated tokens of each returned sequence (cut
    after the stop token that ended it) and their summed logprob."""
    out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                      max_new_tokens=max_tokens, min_new_tokens=min_tokens, length_penalty=length_penalty,
                      eos_token_id=[EOS, *stops], pad_token_id=0)
    result = []
    for seq in out[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(seq) if t in (EOS, *stops)), len(seq))
        seq = seq[:end]
        with torch.no_grad():
            logprobs = hf(torch.tensor([prompt + seq])).logits[0].log_softmax(-1)
        result.append((seq, float(sum(logprobs[len(prompt) - 1 + i, t] for i, t in enumerate(seq)))))
    return result


def assert_same_as_hf(hf, llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> int:
    """The engine's beams are transformers'; returns how many ended by a stop token."""
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    stopped = 0
    for prompt, output in zip(prompts, outputs):
        want = hf_beams(hf, prompt, params.beam_width, params.max_tokens, params.length_penalty,
                        params.stop_token_ids, params.min_tokens)
        assert [s.output_token_ids for s in output.sequences] == [w[0] for w in want]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx([w[1] for w in want], abs=1e-4)
        assert all(s.tokens == prompt + s.output_token_ids for s in output.sequences)
        stopped += sum(s.finish_reason == "stop" for s in output.sequences)
    return stopped


def frequent_token(llm: LLM, prompts: list[list[int]]) -> int:
    """A token the beams often generate: a stop token that ends some of them."""
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(4, 10, ignore_eos=True))
    counts = collections.Counter(t for o in outs for s in o.sequences for t in s.output_token_ids[2:])
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(3, 500, n)] for n in (5, 40)]  # 40: a chunked prefill (32 a step)


@pytest.fixture(scope="module")
def llm(test_models_dir) -> LLM:
    return make_llm(test_models_dir)


@pytest.fixture(scope="module")
def hf(test_models_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float32)


def assert_stop_token_grid(hf, llm: LLM, prompts, grid) -> None:
    stop = frequent_token(llm, prompts)
    stopped = 0
    for length_penalty, min_tokens in grid:
        params = BeamSearchParams(4, 10, length_penalty=length_penalty, stop_token_ids=(stop,), min_tokens=min_tokens)
        stopped += assert_same_as_hf(hf, llm, prompts, params)
    assert stopped > 0  # the stop token did end beams
    assert_no_leaks(llm)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma3"])
def test_beams_are_transformers_beams(test_models_dir, arch, prompts, llm, hf):
    """Widths 1/2/4/8, length penalties 0.5/1/2, a stop token inside the beams (with
    min_tokens holding it back too): HF's sequences, order and scores."""
    if arch != "llama":
        llm = LLM(str(test_models_dir / arch), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                  attention_backend="cpu", progress=False, **LAZY)
        hf = transformers.AutoModelForCausalLM.from_pretrained(test_models_dir / arch, dtype=torch.float32)
    for width in (1, 2, 4, 8):
        assert_same_as_hf(hf, llm, prompts, BeamSearchParams(width, 10))
    assert_stop_token_grid(hf, llm, prompts, GRID)


@pytest.mark.slow
def test_more_length_penalties_with_min_tokens(llm, hf, prompts):
    assert_stop_token_grid(hf, llm, prompts, MORE)


def test_stop_strings_end_beams_as_in_transformers(test_models_dir, prompts, llm, hf):
    """A stop string ends the beam whose token completes it (transformers'
    StopStringCriteria: the sequence keeps that token); the returned text stops before
    it, or with it under include_stop_str_in_output."""
    tok = transformers.AutoTokenizer.from_pretrained(test_models_dir / "llama")
    free = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(4, 12, ignore_eos=True))
    text = free[1].sequences[1].output_text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isalpha())
    for include in (False, True):
        params = BeamSearchParams(4, 12, stop=(stop,), include_stop_str_in_output=include)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        stopped = 0
        for prompt, out in zip(prompts, outs):
            want = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, do_sample=False,
                               max_new_tokens=12, stop_strings=[stop], tokenizer=tok, eos_token_id=EOS,
                               pad_token_id=0)[:, len(prompt):].tolist()
            for seq, w in zip(out.sequences, want):
                n = len(seq.output_token_ids)  # transformers fills a finished sequence with EOS (pad_token_id 0 is falsy)
                assert seq.output_token_ids == w[:n] and all(t == EOS for t in w[n:])
                if seq.stop_reason == stop:
                    stopped += 1
                    assert seq.output_text.endswith(stop) if include else stop not in seq.output_text
        assert stopped
    assert_no_leaks(llm)


@pytest.mark.parametrize("prompt_len", [200, pytest.param(1000, marks=pytest.mark.slow)])
def test_beams_share_the_prompt_blocks_and_free_them(test_models_dir, llm, prompt_len):
    """Four beams of a long prompt (1,000 tokens in the slow run) hold its blocks once:
    after the first fork the pool holds the prompt's full blocks and one partial block
    per beam; after the search, and after an abort mid-way, nothing."""
    if prompt_len > 200:
        llm = make_llm(test_models_dir, max_model_len=1024, kv_cache_memory=400 * KV_BYTES_PER_BLOCK)
    engine, kv = llm.llm_engine, llm.llm_engine.core.kv_cache_manager
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 500, prompt_len)]
    params = BeamSearchParams(4, 8, ignore_eos=True).to_sampling_params()
    engine.add_requests([("a", {"prompt_token_ids": prompt}, params)])
    group = engine.core.scheduler.beam_groups["a"]
    while len(group.beams) == 1:
        engine.step()
    num_full, partial = divmod(prompt_len, 16)
    assert partial and len(group.beams) == 4
    assert kv.num_used_blocks == num_full + 4  # not 4 x the prompt's
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 1 and len(outputs[0].outputs) == 4
    assert_no_leaks(llm)
    engine.add_requests([("b", {"prompt_token_ids": prompt}, params)])
    while len(engine.core.scheduler.beam_groups["b"].beams) == 1:
        engine.step()
    engine.step()
    aborted = engine.abort_requests(["b"])
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"]
    while engine.has_unfinished_requests():  # the step in flight (async scheduling)
        assert engine.step() == []
    assert_no_leaks(llm)


@pytest.mark.slow  # (15 s: the default run's budget) beams against HF's by default above; preemption's recompute: tests/engine
def test_preempted_beams_recompute_to_the_same_beams(test_models_dir, prompts, hf):
    """A pool too small for every group at once preempts whole groups; the beams are
    those of an engine that never preempts (and transformers'), alone and among sampled
    requests sharing their steps."""
    # three groups at once, where two fit; single decode steps (a beam never runs a decode loop): no loops to compile
    llm = make_llm(test_models_dir, kv_cache_memory=24 * KV_BYTES_PER_BLOCK, async_scheduling=False,
                   max_model_len=128, max_num_seqs=12, num_scheduler_steps=1)
    many = prompts + [p[::-1] for p in prompts]
    params = BeamSearchParams(4, 32)
    assert_same_as_hf(hf, llm, many, params)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    # the same beam searches among sampled requests (n = 2, min_tokens) in the same steps
    alone = [[s.output_token_ids for s in o.sequences] for o in llm.beam_search(
        [{"prompt_token_ids": p} for p in many], params)]
    engine = llm.llm_engine
    engine.add_requests([(f"b{i}", {"prompt_token_ids": p}, params.to_sampling_params()) for i, p in enumerate(many)]
                        + [(f"s{i}", {"prompt_token_ids": p}, SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=24,
                                                                           min_tokens=3)) for i, p in enumerate(many)])
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert [[c.token_ids for c in done[f"b{i}"].outputs] for i in range(len(many))] == alone
    assert all(len(done[f"s{i}"].outputs) == 2 for i in range(len(many)))
    assert_no_leaks(llm)


def test_bad_beam_requests_are_refused_before_anything_is_queued(llm):
    bad = [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=17, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
    ]
    for fields, name in bad:
        with pytest.raises(ValueError, match=f"^{name}:"):
            llm.beam_search("hi", BeamSearchParams(**fields))
    with pytest.raises(ValueError, match="^n: a beam width of 9 needs 9 sequences"):  # max_num_seqs 8
        llm.beam_search(["hi", "there"], BeamSearchParams(9, 4))
    for fields, name in [(dict(logprobs=2), "logprobs"), (dict(presence_penalty=1.0), "presence_penalty"),
                         (dict(structured_outputs={"regex": "a+"}), "structured_outputs"), (dict(top_p=0.5), "top_p")]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            SamplingParams(n=2, use_beam_search=True, temperature=0, **fields)
    with pytest.raises(ValueError, match="^length_penalty:"):
        SamplingParams(length_penalty=2.0)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_beam_search_takes_text_and_conversations(llm):
    """A prompt as text, token ids or a conversation (the chat template's render), in
    the order given; `tokens` and `text` are the whole sequence, as in vLLM."""
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "hello"}]
    params = BeamSearchParams(2, 4, ignore_eos=True)
    text, ids, chat = llm.beam_search(["one two", [5, 6, 7], conversation], params)
    rendered = llm.llm_engine.input_processor.render_chat(conversation)
    for out, prompt_ids in ((text, tok.encode("one two")), (ids, [5, 6, 7]),
                            (chat, tok.encode(rendered, add_special_tokens=False))):
        want = llm.beam_search([{"prompt_token_ids": prompt_ids}], params)[0]
        assert [s.output_token_ids for s in out.sequences] == [s.output_token_ids for s in want.sequences]
        assert all(s.tokens[:len(prompt_ids)] == prompt_ids for s in out.sequences)
    assert text.sequences[0].text == "one two" + text.sequences[0].output_text
    # generate takes one {"prompt_token_ids": ...} prompt alone too (the same check of one prompt)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    assert [o.outputs[0].token_ids for o in llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7]], greedy, use_tqdm=False)]
    assert_no_leaks(llm)
