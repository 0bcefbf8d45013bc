"""A pooling model's pooler and length, as its folder says: a sentence-transformers
folder (`modules.json`, the Pooling module's `config.json`, a Normalize module,
`sentence_bert_config.json`'s max_seq_length) or, without one, the family's default
(vLLM's: an encoder's [CLS], a decoder's last token, normalized). Matryoshka sizes
come from config.json (`matryoshka_dimensions`, `is_matryoshka`). Plain file reading:
sentence-transformers itself is never imported.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxllm.config import ModelConfig, UnsupportedModelError
from jaxllm.pooling_params import PoolerConfig

# sentence-transformers' Pooling config keys -> jaxllm's pooling types
_POOLING_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
                  "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_MODULE = "sentence_transformers.models."


def is_sentence_transformers(path: Path) -> bool:
    """Whether `path` is a sentence-transformers folder (an embedding model, whatever
    its architecture: gte-Qwen2 and Qwen3-Embedding are Qwen2/3ForCausalLM)."""
    return path.is_dir() and (path / "modules.json").is_file()


def model_pooler(path: Path, cfg: ModelConfig) -> tuple[PoolerConfig, int | None]:
    """The model's pooler and, where a sentence-transformers folder gives one, the
    sequence length it was trained for (max_seq_length)."""
    folder = path if path.is_dir() else None
    dimensions = _matryoshka(folder)
    modules = _read_json(folder / "modules.json") if folder is not None and (folder / "modules.json").is_file() else None
    if modules is None:
        return PoolerConfig("CLS" if cfg.is_encoder else "LAST", True, dimensions), None
    types = [m.get("type", "") for m in modules]
    unknown = [t for t in types if t not in (_MODULE + "Transformer", _MODULE + "Pooling", _MODULE + "Normalize")]
    if unknown:
        raise UnsupportedModelError(f"{folder / 'modules.json'}: sentence-transformers module(s) "
                                    f"{', '.join(unknown)} are not supported (Transformer, Pooling, Normalize)")
    pooling = next((m for m in modules if m.get("type") == _MODULE + "Pooling"), None)
    pooling_type = "CLS" if cfg.is_encoder else "LAST"
    if pooling is not None:
        pooling_type = _pooling_type(folder / pooling.get("path", "") / "config.json")
    st_config = folder / "sentence_bert_config.json"
    max_len = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    normalize = _MODULE + "Normalize" in types
    return PoolerConfig(pooling_type, normalize, dimensions), None if max_len is None else int(max_len)


def _pooling_type(path: Path) -> str:
    config = _read_json(path)
    unsupported = [k for k in _UNSUPPORTED_MODES if config.get(k)]
    if unsupported:
        raise UnsupportedModelError(f"{path}: {', '.join(unsupported)} is not supported (mean, cls, lasttoken)")
    modes = [kind for key, kind in _POOLING_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise UnsupportedModelError(f"{path}: expected one pooling mode, found {modes or 'none'}")
    return modes[0]


def _matryoshka(folder: Path | None) -> tuple[int, ...]:
    """The matryoshka sizes config.json declares ((0,): any size; (): none)."""
    if folder is None or not (folder / "config.json").is_file():
        return ()
    hf = _read_json(folder / "config.json")
    if hf.get("matryoshka_dimensions"):
        return tuple(int(d) for d in hf["matryoshka_dimensions"])
    return (0,) if hf.get("is_matryoshka") else ()


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"{path}: cannot read ({e})") from None
