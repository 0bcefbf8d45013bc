#!/usr/bin/env python
"""Embeddings: jaxllm against sentence-transformers, infinity-emb and vLLM's CPU build,
side by side in one run (issue 61).

The same 1,000 texts of 8-256 tokens (seeded: words that are one WordPiece each, so a
text's length is exact), all-MiniLM-L6-v2 in float32, the folder its PyPI package
unpacks (jaxllm.loaders.default_model.all_minilm_l6_v2_path):

- offline: `SentenceTransformer.encode(texts, batch_size=32)` (torch, every core) in a
  process of its own, then jaxllm's `LLM.embed(texts)` in another (its defaults, then
  with XLA's segment attention in place of the C++ kernel); each timed after a warm-up
  call, best of `--repeats`;
- served, `--clients` concurrent clients (32) each sending one text per request until
  all are sent: jaxllm (`python -m jaxllm.serve --model FOLDER`), infinity-emb
  (its own venv: scripts/build_infinity_emb.sh; `infinity_emb v2 --engine torch`) and
  vLLM's CPU build (`--runner pooling`; scripts/build_vllm_cpu.sh), one after the
  other, the same client. A server that will not install or start is reported with why.

Every system's vectors are checked against sentence-transformers' (the minimum cosine
is printed beside its speed).

    python scripts/bench_embeddings.py --out bench_results/embeddings   # -> bench_results/embeddings.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from bench_serving import LaunchedServer
from bench_vllm import LaunchedVenvServer, LaunchedVllmServer, venv_python, vllm_python
from isa_build import describe

ROOT = Path(__file__).resolve().parents[1]

ST_SCRIPT = """
import json, sys, time
import numpy as np, torch
from sentence_transformers import SentenceTransformer
args = json.loads(sys.stdin.read())
model = SentenceTransformer(args["folder"], device="cpu")
texts = args["texts"]
model.encode(texts[:64], batch_size=32)
times = []
for _ in range(args["repeats"]):
    start = time.perf_counter()
    vectors = model.encode(texts, batch_size=32)
    times.append(time.perf_counter() - start)
np.save(args["out"], vectors)
print("RESULT", json.dumps({"seconds": min(times), "all": times, "threads": torch.get_num_threads()}))
"""

JAXLLM_SCRIPT = """
import json, sys, time
import numpy as np
from jaxllm import LLM
args = json.loads(sys.stdin.read())
llm = LLM(args["folder"], progress=False, **args["options"])
texts = args["texts"]
llm.embed(texts[:64], use_tqdm=False)
times = []
for _ in range(args["repeats"]):
    start = time.perf_counter()
    out = llm.embed(texts, use_tqdm=False)
    times.append(time.perf_counter() - start)
np.save(args["out"], np.array([o.outputs.embedding for o in out], np.float32))
print("RESULT", json.dumps({"seconds": min(times), "all": times, "describe": llm.llm_engine.core.describe()}))
"""


def make_texts(folder: Path, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """`n` texts of `lo`..`hi` tokens ([CLS] and [SEP] counted), uniformly: words that
    are one WordPiece token each."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()  # the file pads and truncates to 128
    tok.no_padding()
    words = sorted(w for w in tok.get_vocab() if w.isalpha() and w.isascii() and len(w) >= 3)
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(words, int(rng.integers(lo, hi + 1)) - 2)) for _ in range(n)]
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    assert min(lengths) >= lo and max(lengths) <= hi, (min(lengths), max(lengths))
    return texts


def run_script(python: str, script: str, args: dict, env: dict | None = None) -> dict:
    proc = subprocess.run([python, "-c", script], input=json.dumps(args), capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


async def drive(url: str, path: str, model: str, texts: list[str], clients: int) -> tuple[float, np.ndarray]:
    """Every text sent alone by `clients` concurrent clients; the seconds from the first
    send to the last answer, and the vectors in text order."""
    vectors: list = [None] * len(texts)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(texts)):
        queue.put_nowait(i)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            r = await http.post(f"{url}{path}", json={"model": model, "input": [texts[i]]})
            r.raise_for_status()
            vectors[i] = r.json()["data"][0]["embedding"]

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - start
    return seconds, np.array(vectors, np.float32)


class LaunchedInfinity(LaunchedVenvServer):
    """infinity-emb's server from its venv, serving the folder with torch on the CPU."""

    name = "infinity-emb"

    def __init__(self, venv_python: str, folder: Path, log_path: Path) -> None:
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                            "DO_NOT_TRACK": "1"}
        super().__init__([], env, log_path)
        self.model = folder.name
        self.cmd = [str(Path(venv_python).parent / "infinity_emb"), "v2", "--model-id", str(folder), "--port",
                    str(self.port), "--host", "127.0.0.1", "--engine", "torch", "--device", "cpu",
                    "--served-model-name", self.model]


def serve(label: str, server, path: str, model: str, texts: list[str], clients: int, oracle: np.ndarray) -> dict:
    try:
        with server:
            asyncio.run(drive(server.url, path, model, texts[:clients], clients))  # warm-up
            seconds, vectors = asyncio.run(drive(server.url, path, model, texts, clients))
    except Exception as e:
        print(f"{label}: did not serve ({type(e).__name__}: {e})", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}
    result = {"seconds": seconds, "texts_per_s": len(texts) / seconds, "min_cosine": min_cosine(vectors, oracle),
              "startup_s": server.startup_s}
    print(f"{label}: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma-separated: offline, jaxllm-server, infinity, vllm")
    parser.add_argument("--infinity-venv", default=str(ROOT / "build" / "infinity-emb"))
    parser.add_argument("--vllm-venv", default=str(ROOT / "build" / "vllm-cpu"))
    parser.add_argument("--jaxllm-args", default="", help="extra flags of the jaxllm server")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from jaxllm.loaders.default_model import all_minilm_l6_v2_path

    folder = all_minilm_l6_v2_path()
    texts = make_texts(folder, args.texts, args.min_tokens, args.max_tokens, args.seed)
    out_dir = args.out or Path("bench_results/embeddings")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": describe("native"), "texts": len(texts), "tokens": [args.min_tokens, args.max_tokens],
                     "clients": args.clients}
    print(results["machine"], flush=True)
    common = {"folder": str(folder), "texts": texts, "repeats": args.repeats}
    st = run_script(sys.executable, ST_SCRIPT, common | {"out": str(out_dir / "st.npy")})
    oracle = np.load(out_dir / "st.npy")
    results["sentence_transformers"] = st
    print(f"sentence-transformers encode (batch 32): {st['seconds']:.2f} s ({len(texts) / st['seconds']:.1f} texts/s, "
          f"{st['threads']} torch threads)", flush=True)
    offline = {"jaxllm_offline": {}, "jaxllm_offline_xla_attention": {"attention_backend": "xla"}}
    for key, options in offline.items() if "offline" not in skip else ():
        mine = run_script(sys.executable, JAXLLM_SCRIPT, common | {"out": str(out_dir / "jaxllm.npy"),
                                                                  "options": options})
        mine["min_cosine"] = min_cosine(np.load(out_dir / "jaxllm.npy"), oracle)
        results[key] = mine
        print(f"jaxllm LLM.embed {options or ''}: {mine['seconds']:.2f} s ({len(texts) / mine['seconds']:.1f} "
              f"texts/s), {st['seconds'] / mine['seconds']:.2f}x sentence-transformers; min cosine "
              f"{mine['min_cosine']:.7f}; {mine['describe']}", flush=True)
    served = {}
    if "jaxllm-server" not in skip:
        server = LaunchedServer(f"--model {shlex.quote(str(folder))} --served-model-name minilm {args.jaxllm_args}",
                                out_dir / "jaxllm-server.log")
        served["jaxllm"] = serve("jaxllm server", server, "/v1/embeddings", "minilm", texts, args.clients, oracle)
    if "infinity" not in skip and (python := venv_python("build_infinity_emb.sh", args.infinity_venv,
                                                         "infinity-emb")) is not None:
        server = LaunchedInfinity(python, folder, out_dir / "infinity.log")
        served["infinity-emb"] = serve("infinity-emb", server, "/embeddings", server.model, texts, args.clients, oracle)
    if "vllm" not in skip and (python := vllm_python(args.vllm_venv)) is not None:
        server = LaunchedVllmServer(python, folder, "float32", 64, out_dir / "vllm.log")
        server.cmd[server.cmd.index("--max-model-len") + 1] = "256"
        server.cmd += ["--runner", "pooling"]
        served["vllm-cpu"] = serve("vLLM CPU", server, "/v1/embeddings", str(folder), texts, args.clients, oracle)
    results["served"] = served
    print_table(results)
    out_dir.with_suffix(".json").write_text(json.dumps(results, indent=2))  # beside the folder of vectors and logs


def print_table(results: dict) -> None:
    st = results["sentence_transformers"]["seconds"]
    n = results["texts"]
    print(f"\n{results['machine']}; {n} texts of {results['tokens'][0]}-{results['tokens'][1]} tokens, float32")
    print("| run | seconds | texts/s | vs baseline | min cosine to sentence-transformers |")
    print("|---|---:|---:|---:|---:|")
    print(f"| sentence-transformers encode, batch 32 | {st:.2f} | {n / st:.1f} | 1.00x | 1 |")
    for key, label in (("jaxllm_offline", "jaxllm LLM.embed"),
                       ("jaxllm_offline_xla_attention", "jaxllm LLM.embed, attention_backend xla")):
        mine = results.get(key)
        if mine:
            print(f"| {label} | {mine['seconds']:.2f} | {n / mine['seconds']:.1f} | {st / mine['seconds']:.2f}x "
                  f"| {mine['min_cosine']:.7f} |")
    served = results.get("served", {})
    base = served.get("infinity-emb", {}).get("seconds")
    for name, r in served.items():
        if "error" in r:
            print(f"| {name}, {results['clients']} clients | did not serve: {r['error'][:80]} | | | |")
            continue
        ratio = f"{base / r['seconds']:.2f}x infinity-emb" if base else ""
        print(f"| {name}, {results['clients']} clients | {r['seconds']:.2f} | {r['texts_per_s']:.1f} | {ratio} "
              f"| {r['min_cosine']:.7f} |")


if __name__ == "__main__":
    main()
