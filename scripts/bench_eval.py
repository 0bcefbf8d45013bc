"""lm-evaluation-harness through jaxllm's server against lm-eval's own `hf` backend,
on the same weights, in one run: per-item answers must agree; the time ratio is
the speed-up.

    python scripts/bench_eval.py                       # the embedded SmolLM2, tasks in scripts/eval_tasks/lm_eval
    python scripts/bench_eval.py --num-fewshot 0,5 --out bench_results/eval.json

The hf baseline needs the weights as an HF folder: the embedded GGUF is exported once
(float32, `--hf-folder`, default build/smollm2-hf). Both sides are timed from a
loaded model to the results (the server's start-up and HF's load are not counted).
Needs `pip install 'lm-eval[api]'` (in the dev extras).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serving import LaunchedServer  # noqa: E402 (a sibling script: importable once scripts/ is on the path)

TASKS_DIR = ROOT / "scripts" / "eval_tasks" / "lm_eval"


def export_hf_folder(folder: Path, model: str | None) -> Path:
    """The served model as an HF folder (float32), for lm-eval's hf backend."""
    if (folder / "config.json").exists():
        return folder
    from jaxllm.loaders import load_model
    from jaxllm.loaders.hf import save_hf_folder

    loaded = load_model(model, dtype="float32")
    save_hf_folder(folder, loaded.config, loaded.params, loaded.tokenizer)
    return folder


@functools.cache
def task_manager():
    """lm-eval's index of tasks (ours and its own: seconds to build, so built once and
    not timed)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def run_lm_eval(lm, tasks: list[str], num_fewshot: int, limit: int | None) -> tuple[dict, float]:
    """lm-eval's simple_evaluate on an LM object; (results, seconds)."""
    import lm_eval

    task_manager()
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=task_manager(), log_samples=True,
                                      random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return results, time.perf_counter() - start


def per_item(results: dict, task: str) -> dict[int, dict]:
    """doc_id -> the chosen answer (multiple choice: the argmax of the choices'
    loglikelihoods, which are kept too; generation: the filtered reply)."""
    multiple_choice = results["configs"][task]["output_type"] == "multiple_choice"
    items = {}
    for s in results["samples"][task]:
        resps = s["filtered_resps"]
        if multiple_choice:
            scores = [float(r[0]) for r in resps]
            items[s["doc_id"]] = {"answer": max(range(len(scores)), key=scores.__getitem__), "scores": scores}
        else:
            items[s["doc_id"]] = {"answer": resps[0] if isinstance(resps, list) else resps}
    return items


def compare(a: dict, b: dict) -> dict:
    """Agreement of two runs' per-item answers; the items they differ on, with both
    sides' scores and `b`'s margin (its best choice's loglikelihood over the runner-up:
    a flip under a smaller margin than the runs' loglikelihood differences is a near tie)."""
    differ = [d for d in a if a[d]["answer"] != b[d]["answer"]]
    diffs = [abs(x - y) for d in a if "scores" in a[d] for x, y in zip(a[d]["scores"], b[d]["scores"])]
    return {"items": len(a), "same_answers": len(a) - len(differ),
            "max_abs_loglik_diff": max(diffs) if diffs else None,
            "differ": [{"doc_id": d, "a": a[d], "b": b[d], "b_margin": _margin(b[d])} for d in differ]}


def _margin(item: dict) -> float | None:
    scores = sorted(item.get("scores", []), reverse=True)
    return scores[0] - scores[1] if len(scores) > 1 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: the embedded SmolLM2)")
    p.add_argument("--hf-folder", type=Path, default=ROOT / "build" / "smollm2-hf")
    p.add_argument("--tasks", default="jaxllm_facts_mc")
    p.add_argument("--num-fewshot", default="0,5", help="comma-separated shot counts, one run each")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per request to jaxllm (lm-eval batch_size)")
    p.add_argument("--num-concurrent", type=int, default=1, help="requests in flight to jaxllm (lm-eval num_concurrent)")
    p.add_argument("--tokenizer-backend", choices=("huggingface", "remote"), default="huggingface",
                   help="huggingface: the HF folder's tokenizer on the client; remote: the server's /tokenize")
    p.add_argument("--server-args", default="--max-model-len 2048")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                   help="the server's --dtype (bfloat16 on a CPU: bfloat16 weights and matmuls, float32 activations; "
                        "auto, with no --server-args of precision: the server's defaults, whose per-item agreement "
                        "with float32 is their quality)")
    p.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the torch dtype of lm-eval's hf backend (default: --dtype; float32 for auto)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    tasks = args.tasks.split(",")
    shots = [int(x) for x in args.num_fewshot.split(",")]
    folder = export_hf_folder(args.hf_folder, args.model)
    report = {"tasks": tasks, "args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    server_args = args.server_args + f" --dtype {args.dtype}" + (f" --model {args.model}" if args.model else "")
    with LaunchedServer(server_args) as server:
        name = server.model()
        tokenizer = {"tokenizer": str(folder)} if args.tokenizer_backend == "huggingface" else {}
        api = LocalCompletionsAPI(model=name, base_url=f"{server.url}/v1/completions",
                                  tokenizer_backend=args.tokenizer_backend, **tokenizer, batch_size=args.batch_size,
                                  num_concurrent=args.num_concurrent, max_length=2048)
        served = {n: run_lm_eval(api, tasks, n, args.limit) for n in shots}
        metrics = httpx_metrics(server.url)
        report["engine"] = server.engine  # what the server's start-up chose (its dtype, weights, activations, KV)
    hf_dtype = args.hf_dtype or ("float32" if args.dtype == "auto" else args.dtype)
    hf = HFLM(pretrained=str(folder), dtype=hf_dtype, device="cpu", batch_size=args.hf_batch_size)
    for n in shots:
        hf_results, hf_s = run_lm_eval(hf, tasks, n, args.limit)
        results, s = served[n]
        run = {"num_fewshot": n, "jaxllm_s": round(s, 2), "hf_s": round(hf_s, 2), "speedup": round(hf_s / s, 2)}
        for task in tasks:
            ours, theirs = per_item(results, task), per_item(hf_results, task)
            run[task] = compare(ours, theirs)
            report.setdefault("items", {}).setdefault(f"{task}/{n}", {"jaxllm": ours, "hf": theirs})
            run[task]["jaxllm_metrics"] = _metrics(results, task)
            run[task]["hf_metrics"] = _metrics(hf_results, task)
        report["runs"].append(run)
        print(json.dumps(run, indent=1), flush=True)
    report["runs"] = report.pop("runs")  # after the items in the file: the summary last
    report["server_prefix_cache"] = metrics
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


def _metrics(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if isinstance(v, float)}


def httpx_metrics(url: str) -> dict:
    """The server's prefix-cache counters after the runs."""
    import re

    import httpx

    text = httpx.get(f"{url}/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    queries, hits = value("vllm:prefix_cache_queries_total"), value("vllm:prefix_cache_hits_total")
    return {"queried_tokens": queries, "hit_tokens": hits, "hit_rate": hits / queries if queries else 0.0}


if __name__ == "__main__":
    main()
