"""HF model folders: config.json + safetensors (single file or sharded) + tokenizer."""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.loaders.prequantized import held_names, quantized_source, read_quantization
from jaxllm.loaders.weights import CheckpointError, build_declared, build_params, params_to_hf_tensors
from jaxllm.models.params import ModelParams
from jaxllm.models.vision_params import VisionParams, declare_vision
from jaxllm.vision_config import VisionConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes its numpy reader has no type for, read here as ml_dtypes' (FP8 checkpoints)
RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_tensor(f, path: Path, name: str):
    """Tensor `name` of the open safetensors file `f` (at `path`) as numpy; FP8 ones
    (which safetensors' numpy reader cannot make) read from the file's bytes."""
    dtype = RAW_DTYPES.get(f.get_slice(name).get_dtype())
    if dtype is None:
        return f.get_tensor(name)
    import ml_dtypes

    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(size))[name]
    start, end = info["data_offsets"]
    return np.fromfile(path, np.dtype(getattr(ml_dtypes, dtype)), end - start, offset=8 + size + start).reshape(
        info["shape"])


def _safetensors_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = {name: folder / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard listed in {index} is missing")
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} in the model folder")
    return {}  # every name lives in the single file


def tensor_names(folder: str | Path) -> set[str]:
    """The names of the tensors an HF folder holds (from its index, or the single
    file's header)."""
    from safetensors import safe_open

    folder = Path(folder)
    files = _safetensors_files(folder)
    if files:
        return set(files)
    try:
        with safe_open(str(folder / SINGLE_FILE), framework="np") as f:
            return set(f.keys())
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{folder / SINGLE_FILE}: cannot read safetensors file ({e})") from None


def tensor_reader(folder: str | Path):
    """A function reading one of the folder's tensors by name (None when absent), each
    read opening its file (for a few small tensors: a GPTQ checkpoint's g_idx)."""
    from safetensors import safe_open

    folder = Path(folder)
    files = _safetensors_files(folder)

    def read(name: str):
        path = files.get(name) if files else folder / SINGLE_FILE
        if path is None:
            return None
        with safe_open(str(path), framework="np") as f:
            return read_tensor(f, path, name) if name in f.keys() else None  # noqa: SIM118 (safetensors' handle has keys(), no __contains__)

    return read


def kv_cache_scales(folder: str | Path, num_layers: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A checkpoint's fp8 KV cache scales, as vLLM reads them: each layer's
    `model.layers.{i}.self_attn.k_scale` and `v_scale` (the largest entry where one holds
    several); None for a checkpoint without them (or that is not an HF folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    names = tensor_names(folder)
    wanted = {kind: [f"model.layers.{i}.self_attn.{kind}_scale" for i in range(num_layers)] for kind in "kv"}
    present = [n in names for kind in "kv" for n in wanted[kind]]
    if not any(present):
        return None
    if not all(present):
        missing = next(n for kind in "kv" for n in wanted[kind] if n not in names)
        raise CheckpointError(f"{folder}: KV cache scales for some layers only ({missing} is missing)")
    read = tensor_reader(folder)
    k, v = (np.array([float(np.asarray(read(n), np.float32).max()) for n in wanted[kind]], np.float32)
            for kind in "kv")
    if (k <= 0).any() or (v <= 0).any() or not (np.isfinite(k).all() and np.isfinite(v).all()):
        raise CheckpointError(f"{folder}: KV cache scales must be positive and finite")
    return k, v


def load_hf_params(folder: str | Path, cfg: ModelConfig, dtype, on_host: bool = False) -> ModelParams:
    """The folder's weights for `cfg`. A GPTQ / AWQ checkpoint's packed projections are
    kept where `cfg` declares them quantized, else dequantized (jaxllm.loaders.prequantized).
    A vision-language model's: its language model's (`language_model_names`)."""
    folder = Path(folder)
    with _tensor_source(folder) as (source, where):
        if cfg.is_encoder:
            source = _unprefixed(source, tensor_names(folder), "bert.")
        if cfg.vision is not None:
            source = language_model_names(source)
        quant = read_quantization(folder)
        if quant is not None:
            source = quantized_source(quant, source, tensor_names(folder), held_names(cfg))
        return build_params(cfg, source, dtype, where, on_host=on_host)


def load_hf_vision_params(folder: str | Path, cfg: VisionConfig, dtype) -> VisionParams:
    """A vision-language model's image side (jaxllm.models.vision_params), as declared
    or as transformers 5 saves it (`vision_names`)."""
    with _tensor_source(Path(folder)) as (source, where):
        return build_declared(declare_vision(cfg), vision_names(source), dtype, where)


@contextmanager
def _tensor_source(folder: Path):
    """(a function reading one of the folder's tensors by name, None when absent; the
    checkpoint's name for error messages), its files open while the context lasts."""
    from safetensors import safe_open

    files = _safetensors_files(folder)
    with ExitStack() as stack:
        handles = {}

        def handle(path: Path):
            if path not in handles:
                try:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="np"))
                except Exception as e:  # safetensors raises its own error types
                    raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
            return handles[path]

        def source(name: str):
            path = files.get(name) if files else folder / SINGLE_FILE
            if path is None:
                return None
            f = handle(path)
            if name not in f.keys():  # noqa: SIM118 (safetensors' handle has keys(), no __contains__)
                return None
            try:
                return read_tensor(f, path, name)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

        yield source, str(folder / (INDEX_FILE if files else SINGLE_FILE))


def _first_found(source, names: list[str]):
    return next((t for t in (source(n) for n in names) if t is not None), None)


def language_model_names(source):
    """`source` reading a language model's names ("model.layers...", "lm_head.weight")
    inside a vision-language checkpoint: "language_model.model..." (the hub's, as
    transformers 4 saves them) or "model.language_model..." (transformers 5)."""
    def read(name: str):
        if name.startswith("model."):
            rest = name[len("model."):]
            return _first_found(source, [f"language_model.model.{rest}", f"model.language_model.{rest}", name])
        return _first_found(source, [f"language_model.{name}", name])
    return read


def vision_names(source):
    """`source` reading the image side's declared names (jaxllm.models.vision_params:
    "vision_tower.vision_model...", "multi_modal_projector...") as the hub stores them or
    as transformers 5 saves them (without "vision_model.", or under "model.")."""
    def read(name: str):
        short = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
        return _first_found(source, [name, short, f"model.{name}", f"model.{short}"])
    return read


def _unprefixed(source, names: set[str], prefix: str):
    """`source` reading the declaration's names where the checkpoint prefixes them (a
    BERT saved from a task model, BertForMaskedLM's "bert.embeddings...")."""
    if not any(name.startswith(prefix) for name in names):
        return source
    return lambda name: source(prefix + name)


def load_hf_tokenizer(folder: str | Path, chat_template: str | None = None):
    """The folder's tokenizer (tokenizer.json); the chat template comes from
    chat_template.jinja (transformers 5) or tokenizer_config.json (transformers 4).

    tokenizer.json holds the whole pipeline, so PreTrainedTokenizerFast reads it
    directly (5x faster than AutoTokenizer's class resolution); folders without one
    fall back to AutoTokenizer.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    elif (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    else:
        raise FileNotFoundError(f"{folder}: no tokenizer.json in the model folder")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def save_hf_folder(folder: str | Path, cfg: ModelConfig, params: ModelParams, tokenizer=None) -> Path:
    """Write params as an HF folder (float32 safetensors + config.json [+ tokenizer]).

    Used to check a GGUF load against HF transformers on the same dequantized weights.
    """
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = cfg.to_hf_config() | {"dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(params_to_hf_tensors(cfg, params), str(folder / SINGLE_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder
