"""IncrementalDetokenizer: split UTF-8 characters, prompt context, special tokens,
stop strings (spanning tokens, include_stop_str_in_output, min_tokens) and the
streaming hold-back."""

from __future__ import annotations

import pytest

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.loaders.hf import load_hf_tokenizer
from jaxllm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
FOX = "The quick brown fox jumps over the lazy dog."
# FOX with the test tokenizer: 'The',' qu','ick',' brow','n',' fox',' ju','mp','s',' over',
# ' the',' laz','y',' do','g','.'


@pytest.fixture(scope="module")
def tokenizer(test_models_dir):
    return load_hf_tokenizer(test_models_dir / "llama")


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from jaxllm.loaders import default_model_path
    from jaxllm.loaders.gguf_loader import GGUFFile

    return GGUFFile(default_model_path()).tokenizer()


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A sentencepiece-style tokenizer (Metaspace, byte fallback, leading-space strip),
    as Llama 2 and Mistral have."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed ids one at a time; the delta released after each, the final flush last."""
    deltas = []
    for token_id in ids:
        stop = detok.update([token_id], stop_terminated=False)
        if stop is not None:
            deltas.append(detok.get_next_output_text(finished=True, delta=True))
            return deltas, stop
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize(
    "which, text, expected_deltas",
    [
        # 'æĹ','¥æ','ľ¬è','ªŀ','ĠðŁ','ĺĢ': every boundary splits a character.
        ("test", "日本語 😀", ["", "", "", "日本語", "", " 😀", ""]),
        # 'æĹ','¥','æľ¬','è','ª','ŀ','ĠðŁĺ','Ģ'
        ("smollm", "日本語 😀", ["", "日", "本", "", "", "語", "", " 😀", ""]),
        ("smollm", " 🦙🦙 naïve ﷺ 𝔘𝔫𝔦", None),
    ],
)
def test_character_split_across_tokens(request, which, text, expected_deltas):
    tokenizer = request.getfixturevalue("tokenizer" if which == "test" else "smollm_tokenizer")
    ids = encode(tokenizer, text)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "no character is split"
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello"), SamplingParams())
    deltas, stop = stream(detok, ids)
    assert stop is None
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    if expected_deltas is not None:
        assert deltas == expected_deltas
    assert detok.token_ids == ids


def test_prompt_ending_mid_character_is_not_claimed(tokenizer):
    # "Hello 日本語" = 'He','llo',' \xe6\x97','\xa5\xe6','\x9c\xac\xe8','\xaa\x9e': the prompt
    # keeps the first half of 日; the output's text is what its own tokens decode to.
    ids = encode(tokenizer, "Hello 日本語")
    prompt, output = ids[:3], ids[3:]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    detok.update(output, stop_terminated=False)
    assert detok.output_text == tokenizer.decode(output) == REPLACEMENT_CHAR + "本語"


def test_prompt_context_keeps_leading_space(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    output = encode(tok, "a b")  # '▁a','▁b'
    alone = IncrementalDetokenizer(tok, [], SamplingParams())
    alone.update(output, stop_terminated=False)
    assert alone.output_text == "a b"  # the decoder strips the text's leading space
    after_prompt = IncrementalDetokenizer(tok, encode(tok, "ab"), SamplingParams())
    after_prompt.update(output, stop_terminated=False)
    assert after_prompt.output_text == " a b"  # mid-text, the space stays


def test_recovers_when_decoder_rewrites_emitted_text(byte_fallback_tokenizer):
    # Byte 0x8A after byte 0x61 turns the 'a' already emitted into U+FFFD in a full
    # decode; tokenizers' DecodeStream raises on that; the detokenizer carries on.
    tok = byte_fallback_tokenizer
    pieces = ["ab", "▁a", "▁", "▁a", "<0x61>", "<0x8A>", "a", "<0xDA>", "<0x4A>", "<0x17>"]
    ids = tok.convert_tokens_to_ids(pieces)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas, _ = stream(detok, ids)
    assert deltas[:5] == ["ab", " a", " ", " a", "a"]
    assert detok.output_text.startswith("ab a  aa")
    assert detok.token_ids == ids


@pytest.mark.parametrize(
    "skip, expected", [(True, "Hello world"), (False, "<|im_start|>Hello<|im_end|> world<|endoftext|>")]
)
def test_skip_special_tokens(tokenizer, skip, expected):
    ids = [1, *encode(tokenizer, "Hello"), 2, *encode(tokenizer, " world"), 0]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == expected


@pytest.mark.parametrize("include, expected", [(False, "Hello world!"), (True, "Hello world!<|im_end|>")])
def test_stop_token_text_left_out_unless_included(tokenizer, include, expected):
    ids = [*encode(tokenizer, "Hello world!"), 2]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.get_next_output_text(finished=True, delta=False) == expected
    assert detok.token_ids == ids


def test_no_detokenize_tracks_ids_only(tokenizer):
    ids = encode(tokenizer, FOX)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False, stop=["fox"]))
    assert detok.update(ids, stop_terminated=False) is None
    assert detok.output_text == ""
    assert detok.token_ids == ids


# -------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens(tokenizer):
    ids = encode(tokenizer, FOX)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["own f"]))  # ' brow','n',' fox'
    results = [detok.update([i], stop_terminated=False) for i in ids[:6]]
    assert results == [None] * 5 + ["own f"]
    assert detok.output_text == "The quick br"
    assert detok.get_next_output_text(finished=True, delta=False) == "The quick br"
    assert detok.token_ids == ids[:6]


def test_include_stop_str_in_output_cuts_after_it(tokenizer):
    ids = encode(tokenizer, FOX)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["own f"], include_stop_str_in_output=True))
    deltas, stop = stream(detok, ids)
    assert stop == "own f"
    # Nothing is held back: the stop string would be shown anyway; 'ox' of ' fox' is cut.
    assert deltas == ["The", " qu", "ick", " brow", "n", " f"]
    assert detok.output_text == "The quick brown f"


def test_several_tokens_in_one_update_stop_at_the_first_match(tokenizer):
    ids = encode(tokenizer, FOX)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["dog", "the", "fox"]))
    assert detok.update(ids, stop_terminated=False) == "fox"
    assert detok.output_text == "The quick brown "


def test_hold_back_withholds_partial_match_until_it_fails(tokenizer):
    ids = encode(tokenizer, FOX)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["jumps!"]))
    deltas, stop = stream(detok, ids)
    assert stop is None
    # ' ju' -> "ju" may begin "jumps!": held through 'mp', 's'; released with ' over'.
    assert deltas == [
        "The", " qu", "ick", " brow", "n", " fox", " ", "", "", "jumps over", " the", " laz", "y", " do", "g", ".", ""
    ]
    assert "".join(deltas) == FOX


def test_hold_back_then_stop(tokenizer):
    ids = encode(tokenizer, FOX)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["lazy cat", "dog."]))
    deltas, stop = stream(detok, ids)
    assert stop == "dog."
    # "laz", "lazy" are held (prefixes of "lazy cat"); ' do' ends that hope, so "lazy " goes
    # out while "do" is held (a prefix of "dog."), which then matches and is cut.
    assert deltas[-6:] == [" the", " ", "", "lazy ", "", ""]
    assert "".join(deltas) == detok.output_text == "The quick brown fox jumps over the lazy "


def test_hold_back_flushed_at_finish(tokenizer):
    ids = encode(tokenizer, "Hello world! How are you")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["you?"]))
    for i in ids:
        detok.update([i], stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello world! How are "
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world! How are you"


@pytest.mark.parametrize(
    "stop, min_tokens, num_tokens, expected",
    [
        # 'On','e',',',' two',',': the first ',' is token 3, the second token 5.
        (",", 0, 3, "One"),
        (",", 3, 3, "One"),
        (",", 4, 5, "One, two"),
        # A match counts when it ends in text of a token numbered >= min_tokens, even if
        # it begins earlier.
        (", two", 4, 4, "One"),
        (", two", 5, None, "One, two, three"),
    ],
)
def test_min_tokens(tokenizer, stop, min_tokens, num_tokens, expected):
    ids = encode(tokenizer, "One, two, three")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop], min_tokens=min_tokens))
    stopped_at = None
    for n, token_id in enumerate(ids, 1):
        if detok.update([token_id], stop_terminated=False) == stop:
            stopped_at = n
            break
    assert stopped_at == num_tokens
    assert detok.output_text == expected
