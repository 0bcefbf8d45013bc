"""Reasoning parsers without a server (jaxllm.reasoning): a whole output's split, the
same split streamed in any cut, and the token-level thinking state a structured
output's grammar waits on (the server tests drive them end to end)."""

import itertools

import pytest

from jaxllm.reasoning import PARSERS, ReasoningSplitter, ThinkingState, split

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]


@pytest.mark.parametrize("parser, text, opened, want", [
    (R1, "<think>\nplan it\n</think>\n\nThe answer.", "none", ("plan it\n", "The answer.")),
    (R1, "plan it</think>The answer.", "open", ("plan it", "The answer.")),  # the template opened it
    (R1, "still thinking", "none", ("still thinking", None)),  # cut short while thinking
    (R1, "<think>all</think>", "none", ("all", None)),
    (QWEN3, "<think>\nplan it\n</think>\n\nThe answer.", "none", ("plan it\n", "The answer.")),
    (QWEN3, "The answer, no thinking.", "none", (None, "The answer, no thinking.")),
    (QWEN3, "<think>x</think>y", "closed", (None, "<think>x</think>y")),  # enable_thinking false closed it
    (QWEN3, "plan it</think>The answer.", "open", ("plan it", "The answer.")),  # a thinking template opened it
    (QWEN3, "  <think>x</think>y", "none", ("x", "y")),
    (QWEN3, "<think>unfinished", "none", ("unfinished", None)),
    (QWEN3, "a </think> b", "none", (None, "a </think> b")),  # not opened: the marker is text
])
def test_whole_outputs_split(parser, text, opened, want):
    assert split(parser, text, opened) == want


def test_the_prompt_says_whether_the_output_thinks():
    assert QWEN3.prompt_state("<|im_start|>assistant\n") == "none"
    assert QWEN3.prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert QWEN3.prompt_state("<|im_start|>assistant\n<think>\n") == "open"
    assert QWEN3.prompt_state("<think>a</think>b<|im_end|><|im_start|>assistant\n") == "none"  # an earlier turn's


@pytest.mark.parametrize("parser, text, opened", [
    (R1, "<think>\nplan it\n</think>\n\nThe answer.", "none"),
    (QWEN3, "<think>\nplan <it>\n</think>\n\nThe </answer>.", "none"),
    (QWEN3, "<thin but not a marker", "none"),
    (QWEN3, "plan</think>answer", "open"),
])
def test_any_streamed_cut_gives_the_whole_split(parser, text, opened):
    """Every way of cutting the text into three pieces: the pieces' reasoning and content
    join to the whole output's, and nothing is sent that a later piece takes back."""
    whole = tuple(part or "" for part in split(parser, text, opened))
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        splitter = ReasoningSplitter(parser, opened)
        pieces = [splitter.feed(text[:i]), splitter.feed(text[i:j]), splitter.feed(text[j:], final=True)]
        got = ("".join(r for r, _ in pieces), "".join(c for _, c in pieces))
        assert got == whole, (i, j, pieces)


def test_a_marker_cut_across_pieces_is_held_back():
    s = ReasoningSplitter(QWEN3, "none")
    assert s.feed("<thi") == ("", "")  # maybe <think>
    assert s.feed("nk>plan </th") == ("plan ", "")  # maybe </think>
    assert s.feed("ink>ok") == ("", "ok")


def test_thinking_state_follows_the_tokens():
    start, end = 3, 4
    # deepseek_r1: thinking from the first token, whatever the prompt
    r1 = ThinkingState.of_prompt(R1, start, end, [1, 2])
    assert r1.free and [r1.accept(t) for t in (9, 9, end, 9)] == [True, True, True, False] and not r1.free
    # qwen3, the prompt closed an empty block (enable_thinking false): the grammar from the start
    closed = ThinkingState.of_prompt(QWEN3, start, end, [1, start, 7, end, 7])
    assert not closed.free and closed.also_allowed is None and not closed.accept(9)
    # qwen3, no block in the prompt: the first token may open one (the mask allows it too)
    maybe = ThinkingState.of_prompt(QWEN3, start, end, [1, 2])
    assert not maybe.free and maybe.also_allowed == start
    assert maybe.accept(start) and maybe.free and maybe.accept(9) and maybe.accept(end) and not maybe.free
    assert not maybe.accept(start)  # a later <think> is the answer's
    answering = ThinkingState.of_prompt(QWEN3, start, end, [1, 2])
    assert not answering.accept(9) and answering.also_allowed is None and not answering.free
    # qwen3, a thinking template left the block open
    opened = ThinkingState.of_prompt(QWEN3, start, end, [1, start, 7])
    assert opened.free and opened.also_allowed is None


def test_unknown_parser_and_a_tokenizer_without_the_markers_are_refused(test_models_dir):
    from transformers import AutoTokenizer

    from jaxllm.engine.config import EngineConfig

    with pytest.raises(ValueError, match="reasoning_parser: unknown 'nope'; choose one of deepseek_r1, qwen3"):
        EngineConfig(model="m", reasoning_parser="nope")
    plain = AutoTokenizer.from_pretrained(test_models_dir / "llama")
    with pytest.raises(ValueError, match=r"reasoning_parser qwen3: the model's tokenizer has no single token for "
                                         r"'<think>'"):
        QWEN3.token_ids(plain)
