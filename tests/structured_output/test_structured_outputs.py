"""Structured outputs through the engine on a tiny test model: every output matches its
JSON schema, regex, choice or grammar; greedy constrained tokens are HF's argmax over
what the grammar allows; unconstrained requests are unaffected; preemption and n > 1
keep each request's matcher right; bad constraints fail before anything is queued."""

import json
import re

import bench_structured
import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams
from tests.support.llm import KV_BYTES_PER_BLOCK, LAZY, assert_no_leaks, make_llm

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "boolean"}},
        "required": ["x", "y"], "additionalProperties": False},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
     "required": ["point", "code"], "additionalProperties": False},
]
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term){0,2}
term ::= num | "(" num ("*" | "/") num ")"
num ::= [1-9] [0-9]{0,2}
"""
ARITHMETIC_RE = re.compile(r"(?:[1-9][0-9]{0,2}|\([1-9][0-9]{0,2}[*/][1-9][0-9]{0,2}\))"
                           r"(?:[+-](?:[1-9][0-9]{0,2}|\([1-9][0-9]{0,2}[*/][1-9][0-9]{0,2}\))){0,2}")


@pytest.fixture(scope="module")
def llm(test_models_dir):
    return make_llm(test_models_dir)


def constrained(max_tokens=96, temperature=0.9, seed=0, **constraint):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_outputs_match_their_constraints(llm):
    """Seeded samples of JSON schemas (nested objects, enums in bounded arrays, numbers
    with bounds, string patterns), a regex, a choice and an EBNF grammar, all in one
    batch: each finishes by EOS where its grammar ends, and matches."""
    params = [constrained(seed=i, json=SCHEMAS[i % 3], disable_any_whitespace=True) for i in range(9)]
    params += [constrained(seed=i, regex=r"[a-c]{2,4}-[0-9]{2}") for i in range(3)]
    params += [constrained(seed=i, choice=["red", "green", "blue or grey"]) for i in range(3)]
    params += [constrained(seed=i, grammar=ARITHMETIC) for i in range(3)]
    outs = llm.generate(["the prompt"] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        kind = params[i].structured_outputs.kind
        if kind == "json":
            jsonschema.validate(json.loads(c.text), SCHEMAS[i % 3])
        elif kind == "regex":
            assert re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", c.text), c.text
        elif kind == "choice":
            assert c.text in ("red", "green", "blue or grey")
        else:
            assert ARITHMETIC_RE.fullmatch(c.text), c.text
    assert_no_leaks(llm)


def hf_constrained_greedy(test_models_dir, prompt_ids, grammar_text, n):
    """Greedy decoding of the HF model over the tokens llguidance allows at each step."""
    from transformers import AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(test_models_dir / "llama", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(test_models_dir / "llama")
    vocab = hf.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=vocab), grammar_text)
    ids, out = list(prompt_ids), []
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    for _ in range(n):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        allowed = ((mask[0][:, None] >> np.arange(32)) & 1).reshape(-1)[:vocab].astype(bool)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
        token = int(np.flatnonzero(allowed)[np.argmax(logits[allowed])])
        out.append(token)
        if token == tok.eos_token_id:
            break
        assert matcher.consume_token(token)
        ids.append(token)
    return out


@pytest.mark.parametrize("constraint", [dict(regex=r"(ab|cd)[0-9]{3}x"),
                                        dict(json=SCHEMAS[0], disable_any_whitespace=True)])
def test_greedy_constrained_tokens_are_hf_argmax_over_allowed(llm, test_models_dir, constraint):
    prompt = [5, 77, 301, 42, 9]
    params = constrained(temperature=0, max_tokens=40, **constraint)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    want = hf_constrained_greedy(test_models_dir, prompt, params.structured_outputs.grammar_text(), 40)
    eos = llm.llm_engine.tokenizer.eos_token_id
    assert got.token_ids == [t for t in want if t != eos] or got.token_ids == want


def test_unconstrained_requests_are_unaffected(llm):
    """Greedy unconstrained requests give the same tokens with constrained ones in the
    batch as alone; no compilation after warm-up."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 500, int(rng.integers(4, 40)))] for _ in range(6)]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed_params = [plain, constrained(regex="[xyz]{5}"), plain, constrained(json=SCHEMAS[1]), plain,
                    constrained(choice=["one", "two"]), plain, plain]
    mixed_prompts = [prompts[0], prompts[1], prompts[1], prompts[2], prompts[2], prompts[3], prompts[3], prompts[4]]
    mixed = llm.generate(mixed_prompts + [prompts[5]], mixed_params + [plain], use_tqdm=False)
    got = [mixed[i].outputs[0].token_ids for i in (0, 2, 4, 6, 7, 8)]
    assert got == alone
    assert_no_leaks(llm)


def test_preemption_and_n_keep_each_matcher_right(test_models_dir):
    """Under a pool that preempts, constrained greedy requests give what they give
    alone (a resumed request continues its matcher); n = 3 samples each match."""
    pressured = make_llm(test_models_dir, kv_cache_memory=17 * KV_BYTES_PER_BLOCK)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, int(rng.integers(30, 60)))] for _ in range(6)]
    params = [constrained(temperature=0, max_tokens=120, regex=r"[a-z ]{60,80}\.") for _ in prompts]
    batched = pressured.generate(prompts, params, use_tqdm=False)
    assert pressured.llm_engine.core.scheduler.num_preemptions > 0
    for prompt, p, out in zip(prompts, params, batched):
        alone = pressured.generate([prompt], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(r"[a-z ]{60,80}\.", out.outputs[0].text)
    three = pressured.generate(["x"], constrained(seed=4, regex=r"[0-9]{3}", max_tokens=10).clone(n=3),
                               use_tqdm=False)[0]
    assert len(three.outputs) == 3 and all(re.fullmatch("[0-9]{3}", c.text) for c in three.outputs)
    assert_no_leaks(pressured)


def test_truncated_output_reports_length(llm):
    out = llm.generate(["p"], constrained(max_tokens=3, regex=r"[a-z]{30}"), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and re.fullmatch("[a-z]*", out.text)


@pytest.mark.parametrize("constraint,words", [
    (dict(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= ("), "structured_outputs.grammar"),
])
def test_bad_constraints_fail_before_anything_is_queued(llm, constraint, words):
    ok = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate(["a", "b"], [ok, SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))],
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(["a"], ok, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_grammar_the_core_cannot_compile_aborts_only_its_request(llm, monkeypatch):
    """Past the frontend's check, a compile failure in the core (say, tokenizer-specific)
    finishes that request with `abort`; the others in the batch run to the end."""
    manager = llm.llm_engine.core.structured_outputs

    def fail(grammar):
        raise ValueError("injected compile failure")

    monkeypatch.setattr(manager, "matcher_for", fail)
    ok = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["a", "b"], [ok, constrained(regex="[0-9]+")], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 5
    assert outs[1].outputs[0].finish_reason == "abort" and outs[1].outputs[0].token_ids == []
    assert_no_leaks(llm)


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


# ------------------------------------------------- the real model: SmolLM2-135M-Instruct
# The real model in the slow run (41 s even for 2 schemas: the default run's 15-minute budget);
# the matchers on the test model by default above
@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 100])
def test_smollm2_json_schemas_validate(count):
    """Seeded requests over as many varied schemas on the real model, sampled at
    temperature 0.7, whitespace allowed: every output parses and validates."""
    schemas = bench_structured.schemas(count, seed=0)
    # no backend measuring, few buckets: the 15-minute budget; no decode loops (a constrained request never runs
    # one: its next bitmask needs each token)
    llm = LLM(max_model_len=1024, max_num_batched_tokens=32, max_num_seqs=min(count, 8), attention_backend="cpu",
              linear_backend="cpu", num_scheduler_steps=1, progress=False, **LAZY)
    messages = [[{"role": "user", "content": f"Give me a JSON object with the fields {', '.join(s['properties'])}."}]
                for s in schemas]
    params = [constrained(seed=i, temperature=0.7, max_tokens=256, json=s) for i, s in enumerate(schemas)]
    outs = llm.chat(messages, params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert_no_leaks(llm)


def test_objects_with_declared_properties_are_closed(llm):
    """As xgrammar's strict mode (vLLM's default): an object that declares properties
    and says nothing about others gets only those; one that allows others keeps them; a
    property named "properties" is a property, not a keyword."""
    from jaxllm.structured_output.params import closed_objects

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"b": {}}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}},
              "$defs": {"X": {"properties": {"z": {}}}}, "anyOf": [{"properties": {}}]}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["$defs"]["X"]["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties", "open"} and closed["properties"]["open"]["additionalProperties"]
    assert closed["anyOf"][0]["additionalProperties"] is False
    loose = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    outs = llm.generate(["x"] * 4, [constrained(seed=i, json=loose, disable_any_whitespace=True) for i in range(4)],
                        use_tqdm=False)
    assert all(set(json.loads(o.outputs[0].text)) == {"a"} for o in outs)


def test_structural_tag_constrains_only_the_tagged_segments(test_models_dir):
    """vLLM's structural tag: free text, in which `begin` + JSON of the schema + `end`
    follows each trigger. Checked on the grammar itself with the test tokenizer: text
    with a well-formed segment is accepted to the end, a segment breaking its schema
    is not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(test_models_dir / "llama")
    tag = {"structures": [{"begin": "<fn=add>", "schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}, "end": "</fn>"}], "triggers": ["<fn="]}
    grammar = StructuredOutputsParams(structural_tag=tag).grammar_text()
    ll_tok = llguidance.hf.from_tokenizer(tok)

    def accepted(text: str) -> bool:
        ids = tok.encode(text, add_special_tokens=False)
        return llguidance.LLMatcher(ll_tok, grammar).validate_tokens(ids) == len(ids)

    assert accepted('hello <fn=add>{"a": 1}</fn> bye')
    assert accepted("plain text only")
    assert not accepted('hello <fn=add>{"a": "x"}</fn>')
    assert not accepted('hello <fn=add>{"b": 1}</fn>')
