"""Load a model from what a user names: an HF folder, a GGUF file, a converted (orbax)
checkpoint folder, or nothing (the embedded SmolLM2)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxllm.config import CHECKPOINT_METHODS, ModelConfig
from jaxllm.loaders.checkpoint import is_converted_checkpoint, restore_params, save_checkpoint
from jaxllm.loaders.default_model import PACKAGED_MODELS, default_model_path, model_path
from jaxllm.loaders.dtype import checkpoint_dtype, choose_dtype
from jaxllm.loaders.gguf_loader import GGUFFile, load_gguf_params
from jaxllm.loaders.hf import load_hf_params, load_hf_tokenizer, load_hf_vision_params, tensor_names, tensor_reader
from jaxllm.loaders.prequantized import held_config, read_quantization
from jaxllm.loaders.weights import CheckpointError
from jaxllm.models.params import ModelParams, QuantizedWeight, declare, map_declared
from jaxllm.models.quant import check_quantization, dequantize, quantize_params, quantized_config
from jaxllm.models.vision_params import VisionParams
from jaxllm.platform import prune_least_recently_used

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "LoadedModel", "load_model", "peek_model_config", "default_model_path"]


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: ModelParams | None  # None in an engine's copy: its model runner holds them
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    path: Path
    load_seconds: float
    vision_params: VisionParams | None = None  # a vision-language model's image side (config.vision)


def load_model(model: str | Path | None = None, dtype: str | None = "auto", chat_template: str | None = None,
               conversion_cache_dir: str | Path | None = None, on_host: bool = False,
               quantization: str | None = None) -> LoadedModel:
    """Load weights, config and tokenizer. With `conversion_cache_dir`, a GGUF file is
    converted once into an orbax checkpoint there (keyed by the file and the dtype),
    and later loads restore that instead of parsing and dequantizing the GGUF again.
    `on_host`: the weights stay in host memory (numpy arrays), for an engine that places
    each device's shard of them (tensor parallelism): no device holds them whole.
    `quantization` (jaxllm.config.QUANTIZATIONS): "int8", "int4", "int4_g32", "q8_0", "q4_0",
    "q4_1" quantize a float checkpoint's projections after loading (the conversion cache
    keeps the float weights); a GGUF whose projections are all Q8_0, Q4_0 or Q4_1 keeps
    those blocks, one of mixed block types keeps them as "gguf_int8" (and its conversion
    holds them so), a GPTQ / AWQ / compressed-tensors checkpoint its 4-bit or 8-bit groups
    (int4*, int8_g*) or its int8 per channel (int8) (jaxllm.loaders.prequantized: FP8 and
    other 8-bit schemes are refused as stored, loaded with "none"), unless it is "none"
    (`_gguf_quantization`, `_folder_config`); the returned config says what is held
    (`ModelConfig.quantization`)."""
    start = time.perf_counter()
    path = model_path(model)
    quantization = _as_stored(path, quantization)
    compute_dtype, _ = choose_dtype(dtype, checkpoint_dtype(path))
    folder = _folder_to_read(path, compute_dtype, conversion_cache_dir, quantization)
    if folder is not None:
        cfg, params, tokenizer = _load_folder(folder, compute_dtype, chat_template, on_host, quantization)
        _check_not_requantized(cfg.quantization, quantization, path)
    elif path.is_file() and path.suffix == ".gguf":
        cfg, params, tokenizer = _load_gguf(path, compute_dtype, chat_template, on_host, quantization)
        converted = _converted_path(path, compute_dtype, conversion_cache_dir, quantization)
        if converted is not None:  # floats, or the blocks kept as they are
            _save_conversion(converted, cfg, params, tokenizer, path)
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or folder (packaged models, by name: "
                                f"{', '.join(PACKAGED_MODELS)})")
    else:
        raise CheckpointError(f"{path}: not a model (expected an HF folder or a .gguf file)")
    if cfg.quantization is None and quantization not in (None, "none"):  # float weights quantized at load
        cfg = quantized_config(cfg, quantization)
        params = quantize_params(cfg, params)
    vision = load_hf_vision_params(folder, cfg.vision, compute_dtype) if cfg.vision is not None else None
    return LoadedModel(cfg, params, tokenizer, path, time.perf_counter() - start, vision)


def peek_model_config(model: str | Path | None = None, dtype: str | None = "auto",
                      conversion_cache_dir: str | Path | None = None,
                      quantization: str | None = None) -> ModelConfig | None:
    """The config `load_model` with the same arguments will return, when it can be read
    without touching the weights (an HF folder or converted checkpoint, or a GGUF
    already converted in `conversion_cache_dir`); None otherwise. It lets the engine
    load its compiled executables, which need only shapes, while the weights load."""
    path = model_path(model)
    quantization = _as_stored(path, quantization)
    folder = _folder_to_read(path, choose_dtype(dtype, checkpoint_dtype(path))[0], conversion_cache_dir, quantization)
    if folder is None or not (folder / "config.json").is_file():
        return None
    cfg = _folder_config(folder, quantization)  # a GGUF's kept blocks, GPTQ / AWQ groups: quantized as stored
    return cfg if cfg.quantization is not None else quantized_config(cfg, quantization)


def _as_stored(path: Path, quantization: str | None) -> str | None:
    """`quantization` checked (jaxllm.config.QUANTIZATIONS); a checkpoint method's name
    (vLLM's "gptq", "awq", "compressed-tensors", "fp8", "gguf") is None, as stored, once the
    checkpoint is found stored so."""
    check_quantization(quantization)
    if quantization not in CHECKPOINT_METHODS:
        return quantization
    if path.is_file() and path.suffix == ".gguf":
        stored = "gguf"
    else:
        method = read_quantization(path) if path.is_dir() else None
        stored = method.method if method is not None else None
    if stored != quantization:
        raise ValueError(f"quantization {quantization!r}: {path} is stored as {stored or 'float weights'}, not "
                         f"{quantization}; leave quantization unset to load it as stored")
    return None


def _folder_to_read(path: Path, dtype, conversion_cache_dir: str | Path | None,
                    quantization: str | None = None) -> Path | None:
    """The folder `load_model` reads: the model's own (HF or converted checkpoint), or a
    GGUF's conversion kept in the cache; None when a GGUF must be parsed. A GGUF's
    conversion holds what it loads as by default (its kept blocks, else floats);
    `quantization` "none" (dequantized) has a key of its own."""
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        converted = _converted_path(path, dtype, conversion_cache_dir, quantization)
        if converted is not None and is_converted_checkpoint(converted):
            with contextlib.suppress(OSError):
                os.utime(converted)  # recently used: pruned last
            return converted
    return None


def _gguf_quantization(gguf_file: GGUFFile, cfg: ModelConfig, asked: str | None) -> str | None:
    """What a GGUF's projections are held as: its own blocks (Q8_0, Q4_0, Q4_1) unless
    `asked` is "none" (dequantize); None (dequantized, then quantized as asked)."""
    own = gguf_file.own_quantization(cfg)
    if own is None or asked == "none":
        return None
    _check_not_requantized(own, asked, gguf_file.path)
    return own


def _check_not_requantized(held: str | None, asked: str | None, path: Path) -> None:
    """Asking another quantization of a checkpoint that holds its projections quantized
    (a GGUF's kept blocks, or its conversion) is an error, not a silent re-quantization."""
    if held is not None and asked not in (None, "none", held):
        raise ValueError(f"quantization {asked!r}: {path} holds its projections as {held.upper()} "
                         f"(kept as they are by default); {asked} would re-quantize them. Leave quantization "
                         f"unset to keep them, or 'none' to dequantize")


def _load_gguf(path: Path, dtype, chat_template: str | None, on_host: bool = False, quantization: str | None = None):
    gguf_file = GGUFFile(path)
    cfg = gguf_file.model_config()
    own = _gguf_quantization(gguf_file, cfg, quantization)
    if own is not None:
        cfg = quantized_config(cfg, own)
    if own == "gguf_int8":  # each projection in the tightest container that holds its types exactly
        cfg = dataclasses.replace(cfg, tensor_quantization=gguf_file.own_tensor_quantization(cfg))
    if quantization != "none":  # the embedding keeps its blocks too, unless everything is dequantized
        cfg = dataclasses.replace(cfg, embed_quantization=gguf_file.own_embed_quantization())
    params = load_gguf_params(gguf_file, cfg, dtype, on_host)
    tokenizer = gguf_file.tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return cfg, params, tokenizer


def _folder_config(path: Path, quantization: str | None) -> ModelConfig:
    """A folder's config as the weights will be held: the projections a GPTQ / AWQ /
    compressed-tensors checkpoint (or a converted one) stores quantized held so, unless
    `quantization` is "none" (everything dequantized at load)."""
    cfg = ModelConfig.from_hf_folder(path)
    if quantization == "none":
        return _unquantized(cfg)
    quant = read_quantization(path)
    return cfg if quant is None else held_config(cfg, quant, tensor_names(path), tensor_reader(path), str(path))


def _unquantized(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, quantization=None, embed_quantization=None, tensor_quantization=())


def _load_folder(path: Path, dtype, chat_template: str | None, on_host: bool = False,
                 quantization: str | None = None):
    cfg = _folder_config(path, quantization)
    if is_converted_checkpoint(path):  # restored as stored; "none" then dequantizes what it holds quantized
        stored = ModelConfig.from_hf_folder(path)
        params = restore_params(path, stored, dtype, on_host)
        if stored != cfg:
            params = _dequantized(stored, params, dtype, on_host)
    else:
        params = load_hf_params(path, cfg, dtype, on_host)
    return cfg, params, load_hf_tokenizer(path, chat_template)


def _dequantized(cfg: ModelConfig, params: ModelParams, dtype, on_host: bool) -> ModelParams:
    """Every quantized parameter of `cfg`'s `params` as the `dtype` matrix it stands for."""

    def plain(decl, array):
        if not isinstance(array, QuantizedWeight):
            return array
        w = np.asarray(dequantize(array), np.float32)
        return w.astype(jnp.dtype(dtype)) if on_host else jnp.asarray(w, dtype)

    return map_declared(plain, declare(cfg), params)


# What a conversion of a GGUF holds, by version: a change to which tensors are kept as
# blocks (2: Q4_0 / Q4_1 projections and the embedding's blocks), or to the parameters'
# pytree (3: LayerParams' Gemma output norms, None elsewhere; 4: a GGUF of mixed block
# types keeps them as gguf_int8; 5: LayerParams' MoE fields; 6: Q8_0 / Q4_0 / Q4_1 scales and mins as the file's
# float16; 7: a mixed GGUF's projections in the tightest exact container, tensor_quantization),
# must not restore an older conversion (floats where blocks are now kept; a tree orbax cannot map).
CONVERSION_FORMAT = 7
# Converted GGUFs kept (each a whole model's weights): the least recently used beyond these are
# deleted when one is stored, but none used in the last SPARE_SECONDS (a process may be reading it).
# A GGUF's key has its path and mtime, so a reinstalled or rewritten file is converted anew.
MAX_CONVERSIONS = 8
SPARE_SECONDS = 600.0


def _converted_path(gguf: Path, dtype, cache_dir: str | Path | None, quantization: str | None = None) -> Path | None:
    if cache_dir is None:
        return None
    stat = gguf.stat()
    mode = "|dequantized" if quantization == "none" else ""  # else as it loads by default (floats or kept blocks)
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}{mode}|{CONVERSION_FORMAT}"
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{gguf.stem}-{key}"


def _save_conversion(folder: Path, cfg, params, tokenizer, source: Path) -> None:
    """Best effort: a failed save (disk full, read-only cache) only costs the next start."""
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        save_checkpoint(tmp, cfg, params, tokenizer, source=str(source))
        os.replace(tmp, folder)
    except OSError as e:
        logger.warning("could not keep a converted checkpoint of %s in %s: %s", source, folder, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    kept = (p for p in folder.parent.iterdir() if ".tmp" not in p.name and is_converted_checkpoint(p))
    prune_least_recently_used(kept, MAX_CONVERSIONS, lambda old: shutil.rmtree(old, ignore_errors=True), SPARE_SECONDS)
