#!/usr/bin/env python
"""Convert a model (GGUF file, HF folder; default: the embedded SmolLM2) into an orbax
checkpoint folder that jaxllm loads without re-parsing it (a GGUF's kept blocks stay
blocks), and print how long each way takes.

    python scripts/convert_checkpoint.py OUT_DIR [--model PATH] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import jax

from jaxllm.loaders import load_model
from jaxllm.loaders.checkpoint import save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    original = load_model(args.model, dtype=args.dtype)
    jax.block_until_ready(original.params)
    parse_seconds = original.load_seconds
    start = time.perf_counter()
    save_checkpoint(args.out, original.config, original.params, original.tokenizer, source=str(original.path))
    save_seconds = time.perf_counter() - start

    start = time.perf_counter()
    restored = load_model(args.out, dtype=args.dtype)
    jax.block_until_ready(restored.params)
    restore_seconds = time.perf_counter() - start

    print(f"load {original.path.name}: {parse_seconds:.2f} s")
    print(f"save orbax checkpoint to {args.out}: {save_seconds:.2f} s")
    print(f"restore from orbax: {restore_seconds:.2f} s ({parse_seconds / restore_seconds:.1f}x faster)")


if __name__ == "__main__":
    main()
