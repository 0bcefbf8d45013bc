#!/usr/bin/env python
"""Batch evaluation: a JSONL file of requests through the offline `LLM`, results to JSONL.

    python scripts/batch_eval.py REQUESTS.jsonl RESULTS.jsonl [--model PATH]
        [--sampling-params '{"temperature": 0, "max_tokens": 32}'] [--chunk-size N]
        [--max-requests N] [--errors PATH] [--score] [engine options: --max-model-len ...]

Input, one JSON object per line (blank lines are skipped):

    {"id": "q1", "prompt": "The capital of France is"}
    {"id": 2, "messages": [{"role": "user", "content": "2 + 2 = ?"}],
     "sampling_params": {"max_tokens": 8}, "expected": ["4", "four"]}

`id` is a string or an integer, unique in the file; exactly one of `prompt` (text,
tokenized with the tokenizer's special tokens) or `messages` (a chat, rendered with the
model's chat template); `sampling_params` holds SamplingParams fields and overrides
`--sampling-params` (which overrides SamplingParams' defaults); `expected` (an answer or
a list of accepted answers) is only read by `--score`. Only n = 1 is supported: one
completion per id.

Output, one line per id, in input order:

    {"id": "q1", "text": " Paris.", "prompt_tokens": 6, "completion_tokens": 3,
     "cached_tokens": 0, "finish_reason": "stop", "stop_reason": null,
     "ttft_s": 0.41, "latency_s": 0.52}

`ttft_s` and `latency_s` run from the moment the request's chunk was submitted to its
first token and to its last. A malformed line (bad JSON, a missing or duplicate id, no
prompt, an invalid sampling parameter, a prompt the engine rejects, e.g. longer than
max_model_len) is reported on stderr with its line number and written to the errors
file (`RESULTS.errors.jsonl` unless `--errors` says otherwise) as
`{"line": 7, "id": "q7", "error": "temperature: must be non-negative, got -1"}`; the
other lines still run. The errors file holds the latest run's errors only.

`--ray-replicas N` runs the chunks over a Ray cluster instead (RAY_ADDRESS, or `ray
start` on this node; else a local one): Ray Data's `map_batches` with N engines, one per
actor, each on its own tensor x pipeline parallel GPUs; the rest is the same.

Requests run in chunks of `--chunk-size` through `LLM.generate` / `LLM.chat`, and each
chunk's results are appended and flushed as soon as it finishes, so an interrupted run
keeps what finished. Rerunning on the same output file skips the ids already there and
appends the rest (a line torn by the interruption is dropped first); at the end of a
run the file is rewritten in input order. When nothing is left to do, the engine is
not even started, so `--score` on a finished run costs nothing.

`--score` compares each finished result that has an `expected` answer with its text:
correct when an expected answer occurs in the text as a whole word, ignoring case.
The example task `scripts/eval_tasks/capitals.jsonl` is described, with the embedded
model's accuracy, in `scripts/eval_tasks/README.md`.

The exit status is 0 when every line ran, 1 when some line was malformed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import re
import sys
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tqdm import tqdm

from jaxllm import LLM, SamplingParams
from jaxllm.engine.config import EngineConfig
from jaxllm.outputs import RequestOutput

RequestId = str | int
SERVER_ONLY_OPTIONS = {"served_model_name"}
ENGINE_OPTION_HELP = {  # for the options whose default is None
    "model": "HF folder, GGUF file or converted checkpoint (default: the embedded SmolLM2-135M-Instruct)",
    "max_model_len": "default: the model's context length",
    "kv_cache_memory": "bytes, e.g. 4GiB, or a fraction of device memory (default: 2 GiB on CPU)",
    "chat_template": "a template, or a file holding one (default: the model's)",
    "compilation_cache_dir": "default: ~/.cache/jaxllm/xla",
}
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclasses.dataclass
class EvalRequest:
    """One valid input line.

    Attributes:
        line: 1-based line number in the input file.
        id: the caller's id (string or integer), unique in the file.
        prompt: the text prompt, or None for a chat.
        messages: the chat conversation, or None for a text prompt.
        sampling_params: --sampling-params overlaid with the line's own.
        expected: accepted answers for --score (empty when the line has none).
    """

    line: int
    id: RequestId
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling_params: SamplingParams
    expected: list[str]


@dataclasses.dataclass
class LineError:
    """A line that could not run: its 1-based number, its id if it had a usable one,
    and the reason."""

    line: int
    id: RequestId | None
    error: str


@dataclasses.dataclass
class RunStats:
    """What one run did: requests finished, their tokens, and the seconds spent
    generating (engine start-up excluded, reported separately)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generate_seconds: float = 0.0
    startup_seconds: float = 0.0


# ---------------------------------------------------------------------------- input


def parse_line(text: str, line: int, defaults: dict[str, Any]) -> EvalRequest:
    """One input line as an EvalRequest; ValueError naming what is wrong."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    rid = record.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise ValueError(f"id: must be a string or an integer, got {rid!r}")
    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError("needs exactly one of 'prompt' (a string) or 'messages' (a chat)")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"prompt: must be a non-empty string, got {prompt!r}")
    if messages is not None and (
        not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages)
    ):
        raise ValueError("messages: must be a non-empty list of {'role': ..., 'content': ...} objects")
    params = record.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params: must be an object, got {params!r}")
    sampling_params = make_sampling_params(defaults | params)
    expected = record.get("expected", [])
    expected = [expected] if isinstance(expected, str) else expected
    if not isinstance(expected, list) or not all(isinstance(e, str) and e for e in expected):
        raise ValueError(f"expected: must be a non-empty string or a list of them, got {record['expected']!r}")
    return EvalRequest(line, rid, prompt, messages, sampling_params, expected)


def make_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from JSON fields; ValueError naming an unknown or invalid field."""
    unknown = sorted(set(fields) - SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {', '.join(unknown)}")
    params = SamplingParams(**fields)
    if params.n != 1:
        raise ValueError(f"n: batch evaluation keeps one completion per id, got {params.n}")
    return params


def read_requests(path: Path, defaults: dict[str, Any]) -> tuple[list[EvalRequest], list[LineError]]:
    """The valid requests of a JSONL file in order, and the lines that are not."""
    requests: list[EvalRequest] = []
    errors: list[LineError] = []
    first_line: dict[RequestId, int] = {}
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                request = parse_line(text, line, defaults)
            except ValueError as error:
                errors.append(LineError(line, _id_of(text), str(error)))
                continue
            if request.id in first_line:
                errors.append(LineError(line, request.id, f"id: {request.id!r} already used on line {first_line[request.id]}"))
                continue
            first_line[request.id] = line
            requests.append(request)
    return requests, errors


def _id_of(text: str) -> RequestId | None:
    """The id of a line that failed to parse, when it has a usable one."""
    try:
        rid = json.loads(text).get("id")
    except (json.JSONDecodeError, AttributeError):
        return None
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


# --------------------------------------------------------------------------- output


def load_results(path: Path) -> dict[RequestId, dict[str, Any]]:
    """Results already in the output file, by id. A last line torn by an interrupted
    run is cut off the file; a bad line anywhere else stops the run rather than
    append to a file that may not be a results file."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    results: dict[RequestId, dict[str, Any]] = {}
    offset = 0
    for number, raw in enumerate(data.splitlines(keepends=True), start=1):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("no newline")
            record = json.loads(raw)
            results[record["id"]] = record
        except (ValueError, KeyError, TypeError):
            if offset + len(raw) < len(data):
                raise SystemExit(f"{path}:{number}: not a result line; refusing to append to this file") from None
            print(f"{path}:{number}: dropping a torn last line from an interrupted run", file=sys.stderr)
            with path.open("r+b") as f:
                f.truncate(offset)
            break
        offset += len(raw)
    return results


def result_record(request: EvalRequest, output: RequestOutput) -> dict[str, Any]:
    """The output line for a finished request."""
    completion = output.outputs[0]
    metrics = output.metrics
    ttft = latency = None
    if metrics is not None and metrics.first_token_time is not None:
        ttft = round(metrics.first_token_time - metrics.arrival_time, 4)
    if metrics is not None and metrics.finished_time is not None:
        latency = round(metrics.finished_time - metrics.arrival_time, 4)
    return {
        "id": request.id,
        "text": completion.text,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
        "cached_tokens": output.num_cached_tokens,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "ttft_s": ttft,
        "latency_s": latency,
    }


def rewrite_in_order(path: Path, results: dict[RequestId, dict[str, Any]], order: Sequence[RequestId]) -> None:
    """Replace the output file by its results in input order (ids not in the input,
    e.g. from an older input file, go last), atomically."""
    position = {rid: i for i, rid in enumerate(order)}
    records = sorted(results.values(), key=lambda r: position.get(r["id"], len(position)))
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- run


def run_isolating_errors(
    call: Callable[[list[EvalRequest]], list[RequestOutput]], requests: list[EvalRequest]
) -> list[RequestOutput | str]:
    """`call` on all requests at once; when it rejects the batch (the engine validates
    every request of a call before queueing any), bisect to find the rejected ones.
    Returns each request's output, or the error message that rejected it."""
    if not requests:
        return []
    try:
        return list(call(requests))
    except (ValueError, jinja2.TemplateError) as error:
        if len(requests) == 1:
            return [str(error)]
    mid = len(requests) // 2
    return run_isolating_errors(call, requests[:mid]) + run_isolating_errors(call, requests[mid:])


def generate_chunk(llm: LLM, chunk: list[EvalRequest]) -> list[RequestOutput | str]:
    """Outputs (or rejection messages) for a chunk, in its order: text prompts through
    `LLM.generate`, chats through `LLM.chat`."""

    def generate(requests: list[EvalRequest]) -> list[RequestOutput]:
        return llm.generate([r.prompt for r in requests], [r.sampling_params for r in requests], use_tqdm=False)

    def chat(requests: list[EvalRequest]) -> list[RequestOutput]:
        return llm.chat([r.messages for r in requests], [r.sampling_params for r in requests], use_tqdm=False)

    prompts = [r for r in chunk if r.prompt is not None]
    chats = [r for r in chunk if r.messages is not None]
    by_id = dict(zip([r.id for r in prompts], run_isolating_errors(generate, prompts)))
    by_id |= dict(zip([r.id for r in chats], run_isolating_errors(chat, chats)))
    return [by_id[r.id] for r in chunk]


def chunks(items: list[EvalRequest], size: int) -> Iterator[list[EvalRequest]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def run(
    llm: LLM,
    pending: list[EvalRequest],
    output: Path,
    chunk_size: int,
    on_error: Callable[[LineError], None],
    progress: bool = True,
) -> tuple[dict[RequestId, dict[str, Any]], RunStats]:
    """Generate for the pending requests chunk by chunk, appending each chunk's results
    to `output` (flushed) as it finishes. Returns the new results and the run's stats."""
    stats = RunStats()
    new_results: dict[RequestId, dict[str, Any]] = {}
    start = time.perf_counter()
    with output.open("a", encoding="utf-8") as f, tqdm(
        total=len(pending), unit="req", desc="batch eval", disable=not progress
    ) as bar:
        for chunk in chunks(pending, chunk_size):
            for request, outcome in zip(chunk, generate_chunk(llm, chunk)):
                if isinstance(outcome, str):
                    on_error(LineError(request.line, request.id, outcome))
                    continue
                record = result_record(request, outcome)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                new_results[request.id] = record
                stats.requests += 1
                stats.prompt_tokens += record["prompt_tokens"]
                stats.completion_tokens += record["completion_tokens"]
            f.flush()
            stats.generate_seconds = time.perf_counter() - start
            bar.update(len(chunk))
            bar.set_postfix(out_tok_s=f"{stats.completion_tokens / stats.generate_seconds:.1f}")
    return new_results, stats


class EngineActor:
    """One engine of a Ray Data run (`--ray-replicas`): a batch of pickled requests in,
    each one's result record or rejection out (`map_batches`' callable class)."""

    def __init__(self, model: str | None, options: dict[str, Any]) -> None:
        self.llm = LLM(model, progress=False, **options)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        chunk = [pickle.loads(raw) for raw in batch["request"]]
        outcomes = generate_chunk(self.llm, chunk)
        return {"request": list(batch["request"]),
                "record": ["" if isinstance(o, str) else json.dumps(result_record(r, o), ensure_ascii=False)
                           for r, o in zip(chunk, outcomes)],
                "error": [o if isinstance(o, str) else "" for o in outcomes]}


def run_on_ray(
    model: str | None,
    options: dict[str, Any],
    pending: list[EvalRequest],
    output: Path,
    chunk_size: int,
    replicas: int,
    on_error: Callable[[LineError], None],
    progress: bool = True,
) -> tuple[dict[RequestId, dict[str, Any]], RunStats]:
    """`run` over a Ray cluster (RAY_ADDRESS, `ray start` on this node, else a local
    one): Ray Data's map_batches with `replicas` engines, one per actor (each on
    tensor x pipeline parallel GPUs where the cluster has GPUs), chunks of `chunk_size`
    requests; results appended and flushed as each chunk arrives, so a rerun resumes."""
    import ray

    from jaxllm.engine.ray_executor import connect

    connect(ray)
    if __name__ != "__main__":  # imported: its classes and functions go to the actors by value (as __main__'s do)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.data.DataContext.get_current().enable_progress_bars = False
    devices = max(1, options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1))
    gpus = devices if ray.cluster_resources().get("GPU", 0) > 0 else 0
    rows = [{"request": ray.cloudpickle.dumps(r)} for r in pending]
    results = ray.data.from_items(rows).map_batches(
        EngineActor, batch_size=chunk_size, concurrency=replicas, num_cpus=1, num_gpus=gpus,
        fn_constructor_kwargs={"model": model, "options": options})
    stats = RunStats()
    new_results: dict[RequestId, dict[str, Any]] = {}
    start = time.perf_counter()
    with output.open("a", encoding="utf-8") as f, tqdm(
        total=len(pending), unit="req", desc=f"batch eval ({replicas} engines on Ray)", disable=not progress
    ) as bar:
        for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
            for raw, line, error in zip(batch["request"], batch["record"], batch["error"]):
                request = pickle.loads(raw)
                if error:
                    on_error(LineError(request.line, request.id, str(error)))
                    continue
                f.write(line + "\n")
                record = new_results[request.id] = json.loads(line)
                stats.requests += 1
                stats.prompt_tokens += record["prompt_tokens"]
                stats.completion_tokens += record["completion_tokens"]
            f.flush()
            stats.generate_seconds = time.perf_counter() - start
            bar.update(len(batch["request"]))
    return new_results, stats


# -------------------------------------------------------------------------- score


def is_correct(text: str, expected: Sequence[str]) -> bool:
    """Whether an expected answer occurs in the text as a whole word, ignoring case
    ("Paris" in "It is Paris." but "12" not in "112")."""
    return any(re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", text, re.IGNORECASE) for answer in expected)


def score(requests: Sequence[EvalRequest], results: dict[RequestId, dict[str, Any]]) -> tuple[int, int]:
    """(correct, scored) over the finished results whose requests have expected answers."""
    scored = [r for r in requests if r.expected and r.id in results]
    correct = sum(is_correct(results[r.id]["text"], r.expected) for r in scored)
    return correct, len(scored)


# ---------------------------------------------------------------------------- CLI


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (dashed), defaulting to the engine's default."""
    group = parser.add_argument_group("engine options (EngineConfig fields; unset = the engine's default)")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in SERVER_ONLY_OPTIONS:
            continue
        flag = "--" + field.name.replace("_", "-")
        hint = hints[field.name]
        text = ENGINE_OPTION_HELP.get(field.name, f"default: {field.default}")
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = int if hint in (int, int | None) else str
            group.add_argument(flag, type=kind, default=None, help=text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="JSONL file of requests")
    parser.add_argument("output", type=Path, help="JSONL file of results (appended to on a rerun)")
    parser.add_argument("--errors", type=Path, help="JSONL file of malformed lines (default: OUTPUT.errors.jsonl)")
    parser.add_argument("--sampling-params", type=json.loads, default={},
                        help='JSON object of SamplingParams fields for every line, e.g. \'{"temperature": 0}\'')
    parser.add_argument("--chunk-size", type=int, help="requests per LLM.generate call (default: 4 x max_num_seqs)")
    parser.add_argument("--max-requests", type=int, help="only the first N valid requests of the input")
    parser.add_argument("--score", action="store_true", help="report accuracy against the lines' 'expected' answers")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--ray-replicas", type=int, default=0,
                        help="run on a Ray cluster with Ray Data, this many engines (one per actor; "
                             "default 0: one engine in this process)")
    add_engine_options(parser)
    args = parser.parse_args(argv)
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error("--chunk-size: must be positive")
    if args.ray_replicas < 0:
        parser.error("--ray-replicas: must be non-negative")
    if args.max_requests is not None and args.max_requests < 0:
        parser.error("--max-requests: must be non-negative")
    if not isinstance(args.sampling_params, dict):
        parser.error("--sampling-params: must be a JSON object")
    try:
        make_sampling_params(args.sampling_params)
    except ValueError as error:
        parser.error(f"--sampling-params: {error}")
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, as LLM(...) keyword arguments."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - SERVER_ONLY_OPTIONS - {"model"}
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def print_summary(stats: RunStats, num_done: int, num_total: int) -> None:
    seconds = max(stats.generate_seconds, 1e-9)
    print(f"engine start-up: {stats.startup_seconds:.1f} s")
    print(
        f"{stats.requests} requests in {stats.generate_seconds:.1f} s: "
        f"{stats.requests / seconds:.2f} requests/s, {stats.completion_tokens / seconds:.1f} output tokens/s "
        f"({stats.prompt_tokens} prompt + {stats.completion_tokens} output tokens)"
    )
    print(f"{num_done} of {num_total} requests done")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    errors_path = args.errors or args.output.with_name(args.output.name + ".errors.jsonl")
    errors_path.unlink(missing_ok=True)
    num_errors = 0

    def report(error: LineError) -> None:
        nonlocal num_errors
        num_errors += 1
        print(f"{args.input}:{error.line}: {error.error}", file=sys.stderr)
        with errors_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(dataclasses.asdict(error), ensure_ascii=False) + "\n")

    requests, line_errors = read_requests(args.input, args.sampling_params)
    for error in line_errors:
        report(error)
    if args.max_requests is not None:
        requests = requests[: args.max_requests]
    results = load_results(args.output)
    pending = [r for r in requests if r.id not in results]
    stats = RunStats()
    if pending and args.ray_replicas:
        options = engine_options(args)
        chunk_size = args.chunk_size or 4 * EngineConfig(model=args.model, **options).max_num_seqs
        new_results, stats = run_on_ray(args.model, options, pending, args.output, chunk_size, args.ray_replicas,
                                        report, args.progress)
        results |= new_results
    elif pending:
        start = time.perf_counter()
        llm = LLM(args.model, progress=args.progress, **engine_options(args))
        startup_seconds = time.perf_counter() - start
        chunk_size = args.chunk_size or 4 * llm.llm_engine.config.max_num_seqs
        new_results, stats = run(llm, pending, args.output, chunk_size, report, args.progress)
        stats.startup_seconds = startup_seconds
        results |= new_results
    rewrite_in_order(args.output, results, [r.id for r in requests])
    print_summary(stats, sum(r.id in results for r in requests), len(requests))
    if num_errors:
        print(f"{num_errors} malformed lines: see {errors_path}")
    if args.score:
        correct, scored = score(requests, results)
        print(f"accuracy: {correct}/{scored} = {correct / max(scored, 1):.1%}")
    return 1 if num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
