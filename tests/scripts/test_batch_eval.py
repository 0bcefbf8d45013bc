"""scripts/batch_eval.py end to end on the tiny llama test model: results in input
order with consistent token counts, resuming an interrupted run, malformed lines
reported with their line numbers while the good ones complete, scoring."""

from __future__ import annotations

import json
from pathlib import Path

import batch_eval
import pytest
from transformers import AutoTokenizer

CHAT = [{"role": "user", "content": "Hello world! How are you today?"}]


@pytest.fixture(scope="module")
def engine_args(test_models_dir, shared_cache_dir) -> list[str]:
    """A small engine on the tiny llama: the test servers' (tests/support/server.py) and their
    compilation cache, the run's (what one of them compiled and measured is loaded)."""
    return ["--model", str(test_models_dir / "llama"), "--max-model-len", "256", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "64", "--kv-cache-memory", "4MiB",
            "--compilation-cache-dir", str(shared_cache_dir), "--no-progress"]


def write_jsonl(path: Path, lines: list[dict | str]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def requests(n: int) -> list[dict]:
    """n requests: text prompts and chats, greedy, different lengths; odd ones ignore EOS."""
    out = []
    for i in range(n):
        params = {"temperature": 0, "max_tokens": 3 + i % 5, "ignore_eos": i % 2 == 1}
        source = {"messages": CHAT} if i % 3 == 2 else {"prompt": f"The quick brown fox {i} jumps over"}
        out.append({"id": f"r{i}", **source, "sampling_params": params})
    return out


def test_end_to_end(engine_args, test_models_dir, tmp_path, capsys):
    lines = requests(7)
    output = tmp_path / "out.jsonl"
    assert batch_eval.main([str(write_jsonl(tmp_path / "in.jsonl", lines)), str(output), *engine_args]) == 0

    results = read_jsonl(output)
    assert [r["id"] for r in results] == [line["id"] for line in lines]
    tokenizer = AutoTokenizer.from_pretrained(test_models_dir / "llama")
    for line, result in zip(lines, results):
        max_tokens = line["sampling_params"]["max_tokens"]
        if "prompt" in line:
            assert result["prompt_tokens"] == len(tokenizer.encode(line["prompt"]))
        assert result["finish_reason"] in ("stop", "length")
        if result["finish_reason"] == "length":
            assert result["completion_tokens"] == max_tokens
        else:  # EOS, possibly as the last allowed token
            assert result["completion_tokens"] <= max_tokens
        if line["sampling_params"]["ignore_eos"]:
            assert result["finish_reason"] == "length"
        assert 0 <= result["ttft_s"] <= result["latency_s"]
    assert not (tmp_path / "out.jsonl.errors.jsonl").exists()
    summary = capsys.readouterr().out
    assert "7 requests in" in summary and "requests/s" in summary and "output tokens/s" in summary


def test_resume_after_interruption(engine_args, tmp_path, monkeypatch, capsys):
    lines = requests(9)
    source, output = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    ids = [line["id"] for line in lines]

    # A capped run, then a run killed during its second chunk that left a torn line.
    assert batch_eval.main([str(source), str(output), "--max-requests", "2", *engine_args]) == 0
    first = read_jsonl(output)
    assert [r["id"] for r in first] == ids[:2]

    real_generate_chunk = batch_eval.generate_chunk
    calls = 0

    def interrupted(llm, chunk):
        nonlocal calls
        calls += 1
        if calls == 2:
            with output.open("a") as f:
                f.write('{"id": "r4", "text": "half a li')
            raise KeyboardInterrupt
        return real_generate_chunk(llm, chunk)

    monkeypatch.setattr(batch_eval, "generate_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        batch_eval.main([str(source), str(output), "--chunk-size", "3", *engine_args])
    monkeypatch.undo()
    assert output.read_text().count("\n") == 5  # the first run's 2 and the first chunk's 3

    capsys.readouterr()
    assert batch_eval.main([str(source), str(output), *engine_args]) == 0
    results = read_jsonl(output)
    assert [r["id"] for r in results] == ids  # once each, in input order
    assert results[:2] == first  # kept, not recomputed
    assert "4 requests in" in capsys.readouterr().out

    # Nothing left: the engine is not started, the file is unchanged.
    monkeypatch.setattr(batch_eval, "LLM", None)
    assert batch_eval.main([str(source), str(output), *engine_args]) == 0
    assert read_jsonl(output) == results


def test_malformed_lines_are_reported_and_skipped(engine_args, tmp_path, capsys):
    good = {"prompt": "Hello world", "sampling_params": {"temperature": 0, "max_tokens": 2}}
    lines = [
        {"id": "a", **good},
        '{"id": "b", "prompt": ',  # 2: bad JSON
        {"prompt": "no id"},  # 3
        {"id": "d"},  # 4: neither prompt nor messages
        {"id": "e", "prompt": "x", "sampling_params": {"temperature": -1}},  # 5
        {"id": "f", "prompt": "x", "sampling_params": {"temprature": 0}},  # 6
        {"id": "a", **good},  # 7: duplicate id
        {"id": "h", "prompt": "Hello world " * 200, "sampling_params": {"max_tokens": 2}},  # 8: too long
        {"id": "i", "prompt": "x", "sampling_params": {"stop_token_ids": [10**6]}},  # 9: out of vocabulary
        {"id": "j", "messages": CHAT, "sampling_params": {"temperature": 0, "max_tokens": 2}},
    ]
    source, output = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    errors_path = tmp_path / "errors.jsonl"
    assert batch_eval.main([str(source), str(output), "--errors", str(errors_path), "--chunk-size", "8",
                            *engine_args]) == 1

    assert [r["id"] for r in read_jsonl(output)] == ["a", "j"]
    errors = {e["line"]: e for e in read_jsonl(errors_path)}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8, 9]
    expected_messages = {2: "invalid JSON", 3: "id:", 4: "'prompt'", 5: "temperature:", 6: "temprature",
                         7: "already used on line 1", 8: "maximum context length is 256 tokens", 9: "stop_token_ids:"}
    for line, text in expected_messages.items():
        assert text in errors[line]["error"], errors[line]
    assert errors[7]["id"] == "a" and errors[8]["id"] == "h" and errors[2]["id"] is None
    stderr = capsys.readouterr().err
    assert f"{source}:5: temperature:" in stderr


def test_score(engine_args, tmp_path, capsys):
    lines = [{"id": 1, "prompt": "one", "expected": "x"}, {"id": 2, "prompt": "two"}]
    source, output = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    write_jsonl(output, [{"id": 1, "text": "It is X."}, {"id": 2, "text": "y"}])
    assert batch_eval.main([str(source), str(output), "--score", *engine_args]) == 0
    assert "accuracy: 1/1 = 100.0%" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "expected", "correct"),
    [("The capital is Paris.", ["paris"], True), ("112", ["12"], False), ("12 + 9 = 21", ["21"], True),
     ("twenty-one", ["21", "twenty-one"], True), ("Parisian", ["Paris"], False)],
)
def test_is_correct(text, expected, correct):
    assert batch_eval.is_correct(text, expected) is correct
