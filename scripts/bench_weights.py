"""Weights in and memory out (issue 64), timed in one run against their baselines:

- `update_weights` with the engine's own parameter tree (a trainer's jax.Arrays in the
  same process) against reading the same weights from disk and updating with them;
- `sleep(1)` + `wake_up()` against a cold start of the engine (measured first), and
  the process's live JAX bytes asleep against awake.

    python scripts/bench_weights.py                                   # the tiny test model, built here
    python scripts/bench_weights.py --arch llama-3.2-1b               # its real shapes (random bfloat16, 2.5 GB)
    python scripts/bench_weights.py --linear-backend cpu              # packed panels: the update copies into them

With `--linear-backend xla` (the default here) the engine multiplies the given arrays
as they are, so the update costs no copy whatever the model's size; the cpu backend
packs its panels (a copy in its layout).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_test_model


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def timed(fn, repeat: int = 3) -> float:
    """The best of `repeat` runs, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama", help="make_test_model's name: llama (tiny) or llama-3.2-1b")
    p.add_argument("--models-dir", type=Path, default=None, help="where the model is written (default: a temp dir)")
    p.add_argument("--linear-backend", default="xla")
    args = p.parse_args()

    from jaxllm import LLM, SamplingParams
    from jaxllm.loaders import load_model

    with tempfile.TemporaryDirectory() as tmp:
        out = args.models_dir or Path(tmp)
        folder = out / args.arch
        if not (folder / "config.json").is_file():
            make_test_model.write_model(out, args.arch)
        start = time.perf_counter()
        llm = LLM(str(folder), max_model_len=256, max_num_seqs=8, linear_backend=args.linear_backend,
                  enable_sleep_mode=True, progress=False)
        cold = time.perf_counter() - start
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        want = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
        dtype = str(llm.llm_engine.core.runner.param_dtype)
        weights = load_model(folder, dtype=dtype).params  # the trainer's copy, in this process
        in_process = timed(lambda: llm.update_weights(weights))
        from_disk = timed(lambda: llm.update_weights(load_model(folder, dtype=dtype).params), repeat=1)
        awake = live_bytes()
        start = time.perf_counter()
        llm.sleep(1)
        asleep = live_bytes()
        llm.wake_up()
        round_trip = time.perf_counter() - start
        assert llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids == want
    size = sum(a.nbytes for a in jax.tree.leaves(weights))  # the trainer's copy, alive throughout
    print(f"{args.arch}, linear_backend {args.linear_backend}, weights {size / 2**20:.1f} MiB ({dtype})")
    print(f"update_weights in process: {in_process * 1e3:.1f} ms; from disk (load + update): {from_disk * 1e3:.1f} ms "
          f"({from_disk / in_process:.1f}x)")
    print(f"sleep(1) + wake_up(): {round_trip:.2f} s; cold start: {cold:.2f} s ({cold / round_trip:.1f}x)")
    print(f"live JAX bytes beside the trainer's copy: awake {(awake - size) / 2**20:.1f} MiB, asleep "
          f"{(asleep - size) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
