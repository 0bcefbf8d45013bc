"""Helpers for the jaxllm lm-evaluation-harness tasks in this folder.

`load_local_jsonl` is the tasks' `custom_dataset`: lm-eval calls it as
`custom_dataset(**metadata, **dataset_kwargs)` (lm_eval/api/task.py, ConfigurableTask.download),
where metadata holds the model_args, `--metadata` and `config_source` (the YAML's path).
Relative `data_files` are read from this folder, so the tasks work from any working
directory; `dataset_path: json` with the same `data_files` would resolve them against the
current directory instead (datasets' packaged `json` builder). Nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_local_jsonl(data_files: dict[str, str] | str | None = None, config_source: str | None = None,
                     **_ignored) -> datasets.DatasetDict:
    """One split per entry of `data_files` ({split: path}; a bare path is the `test` split)."""
    if data_files is None:
        raise ValueError("dataset_kwargs.data_files is required")
    if isinstance(data_files, str):
        data_files = {"test": data_files}
    base = Path(config_source).resolve().parent if config_source and Path(config_source).is_file() else HERE
    splits = {}
    for split, name in data_files.items():
        path = Path(name) if Path(name).is_absolute() else base / name
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def _normalize(text: str) -> str:
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(text.split())


def process_results_chat(doc: dict, results: list[str]) -> dict[str, float]:
    """exact_match: the (stripped) reply equals one of `answers`, ignoring case, punctuation
    and spacing; contains: one of `answers` occurs in the reply as whole words."""
    reply = _normalize(results[0])
    answers = [_normalize(a) for a in doc["answers"]]
    return {
        "exact_match": float(any(reply == a for a in answers)),
        "contains": float(any(re.search(rf"\b{re.escape(a)}\b", reply) for a in answers)),
    }
