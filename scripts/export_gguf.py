#!/usr/bin/env python
"""Export a model jaxllm loads (default: the embedded SmolLM2, dequantized) as a GGUF
with llama.cpp's conventions, e.g. an F32 GGUF for llama.cpp's llama-server baseline.

    python scripts/export_gguf.py smollm2-f32.gguf [--model PATH] [--type F32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_test_model import write_gguf

from jaxllm.loaders import load_model
from jaxllm.loaders.hf import save_hf_folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--type", default="F32", help="tensor type for 2-D weights (F32, F16, Q8_0, Q4_0, Q4_1)")
    args = p.parse_args()
    model = load_model(args.model, dtype="float32", quantization="none")
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_folder(Path(tmp) / "hf", model.config, model.params, model.tokenizer)
        print(write_gguf(folder, args.out, args.type))


if __name__ == "__main__":
    main()
