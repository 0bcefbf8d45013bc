"""allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's sampling fields)
through the engine, against HF's float64 logits with the same masks applied greedily."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxllm import SamplingParams
from jaxllm.core.token_filter import TokenFilter
from jaxllm.structured_output.manager import token_filter_mask
from tests.support.llm import assert_no_leaks, make_llm


def test_mask_bits():
    f = TokenFilter(allowed=(1, 33, 40), bad_words=((40,), (5, 6, 33)))
    width = 2

    def allowed(output):
        words = token_filter_mask(f, output, width).view(np.uint32)
        return [t for t in range(64) if words[t // 32] >> (t % 32) & 1]

    assert allowed([]) == [1, 33]  # 40 is a bad word of one token
    assert allowed([7, 5, 6]) == [1]  # ... 5, 6 then 33 would complete one
    assert allowed([5, 6, 7]) == [1, 33]
    assert token_filter_mask(TokenFilter(None, ((3,),)), [], 1).view(np.uint32)[0] == 0xFFFFFFFF ^ (1 << 3)
    assert TokenFilter.of(SamplingParams()) is None


def masked_greedy(hf, prompt: list[int], n: int, allowed=None, bad: list[list[int]] = ()) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].numpy()
        keep = np.zeros(logits.shape[0], bool) if allowed is not None else np.ones(logits.shape[0], bool)
        if allowed is not None:
            keep[allowed] = True
        for w in bad:
            if len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]:
                keep[w[-1]] = False
        out.append(int(np.argmax(np.where(keep, logits, -np.inf))))
        seq.append(out[-1])
    return out


@pytest.fixture(scope="module")
def hf(test_models_dir):
    return AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float64).eval()


@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_filters_equal_masked_greedy(test_models_dir, hf, async_scheduling):
    """Each filter, batched with unfiltered requests (chunked prompts, both scheduling
    modes), gives HF's greedy tokens under the same mask; a bad word of several tokens
    is masked only after its first ones."""
    llm = make_llm(test_models_dir, async_scheduling=async_scheduling)
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "Once upon a time there was a little", "1, 2, 3, 4, 5,"]
    ids = [tok.encode(p) for p in prompts]
    n = 12
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                                                   ignore_eos=True), use_tqdm=False)]
    allowed = sorted(set(plain[0][::2]) | set(ids[1][:5]))
    bad = [tok.decode(plain[1][2:4]), tok.decode(plain[2][:1])]
    bad_ids = llm.llm_engine.input_processor.bad_words_token_ids(bad)
    assert any(len(w) > 1 for w in bad_ids)
    cases = [dict(allowed_token_ids=allowed), dict(bad_words=bad), dict(allowed_token_ids=allowed, bad_words=bad)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **c) for c in cases]
    outs = llm.generate(prompts * 2, params + [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)] * 3,
                        use_tqdm=False)
    for prompt, case, out in zip(ids, cases, outs):
        want = masked_greedy(hf, prompt, n, case.get("allowed_token_ids"), bad_ids if "bad_words" in case else ())
        assert out.outputs[0].token_ids == want, case
    assert [o.outputs[0].token_ids for o in outs[3:]] == plain
    assert sum(o.outputs[0].token_ids != p for o, p in zip(outs, plain)) >= 2  # the filters mattered
    assert_no_leaks(llm)


def test_truncate_prompt_tokens_keeps_the_end(test_models_dir):
    llm = make_llm(test_models_dir)
    prompt = list(range(5, 105))
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=30, **greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-30:]
    assert cut.outputs[0].token_ids == llm.generate([prompt[-30:]], SamplingParams(**greedy),
                                                    use_tqdm=False)[0].outputs[0].token_ids
    whole = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt  # fits: nothing cut
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens: 256 leaves no room"):
        llm.generate([prompt], SamplingParams(truncate_prompt_tokens=256, **greedy), use_tqdm=False)


@pytest.mark.parametrize("fields, match", [
    (dict(allowed_token_ids=[]), "allowed_token_ids: must be a non-empty list"),
    (dict(allowed_token_ids=[1, "a"]), "allowed_token_ids: must be an integer"),
    (dict(bad_words=["ok", " "]), "bad_words: must be non-empty strings"),
    (dict(bad_words=["x"], use_beam_search=True, temperature=0), "bad_words: is not supported with use_beam_search"),
])
def test_bad_filters_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)
