"""Load a model from what a user names: an HF folder, a GGUF file, a converted (orbax)
checkpoint folder, or nothing (the embedded SmolLM2)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from jaxllm.config import ModelConfig
from jaxllm.loaders.checkpoint import is_converted_checkpoint, restore_params
from jaxllm.loaders.default_model import default_model_path
from jaxllm.loaders.gguf_loader import GGUFFile, load_gguf_params
from jaxllm.loaders.hf import load_hf_params, load_hf_tokenizer
from jaxllm.loaders.weights import CheckpointError
from jaxllm.models.params import ModelParams
from jaxllm.platform import resolve_dtype

__all__ = ["CheckpointError", "LoadedModel", "load_model", "default_model_path"]


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: ModelParams
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    path: Path
    load_seconds: float


def load_model(model: str | Path | None = None, dtype: str | None = "auto", chat_template: str | None = None) -> LoadedModel:
    start = time.perf_counter()
    path = Path(model) if model is not None else default_model_path()
    compute_dtype = resolve_dtype(dtype)
    if path.is_file() and path.suffix == ".gguf":
        gguf_file = GGUFFile(path)
        cfg = gguf_file.model_config()
        params = load_gguf_params(gguf_file, cfg, compute_dtype)
        tokenizer = gguf_file.tokenizer()
        if chat_template is not None:
            tokenizer.chat_template = chat_template
    elif path.is_dir():
        cfg = ModelConfig.from_hf_folder(path)
        if is_converted_checkpoint(path):
            params = restore_params(path, cfg, compute_dtype)
        else:
            params = load_hf_params(path, cfg, compute_dtype)
        tokenizer = load_hf_tokenizer(path, chat_template)
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or folder")
    else:
        raise CheckpointError(f"{path}: not a model (expected an HF folder or a .gguf file)")
    return LoadedModel(cfg, params, tokenizer, path, time.perf_counter() - start)
