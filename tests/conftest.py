import importlib.util
import os
import sys
from pathlib import Path

import pytest
from jaxtyping import install_import_hook

# The array functions' jaxtyping shapes are checked at run time in the test run (at
# trace time under jit), so an annotation that drifts from the code fails a test.
# Installed before anything imports jaxllm.
install_import_hook(["jaxllm.models.llama", "jaxllm.models.moe", "jaxllm.models.linear", "jaxllm.models.lora", "jaxllm.models.quant", "jaxllm.models.rope", "jaxllm.attention.xla", "jaxllm.attention.cpu",
                     "jaxllm.sample.sampler", "jaxllm.worker.step", "jaxllm.worker.model_runner", "jaxllm.worker.input_builder",
                     "jaxllm.worker.decode_loop", "jaxllm.spec_decode.ngram_proposer",
                     "pallas_kernels"],
                    "beartype.beartype")

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make_test_model = _load_script("make_test_model")
bench_structured = _load_script("bench_structured")  # its varied JSON schemas
ARCHITECTURES = list(make_test_model.ARCHITECTURES)
MOE = [name for name, spec in make_test_model.ARCHITECTURES.items() if make_test_model.moe_layers(spec, 1)]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """A test module's SLOW_CASES (substrings of test ids: parameter combinations) are
    marked slow."""
    for item in items:
        if any(case in item.name for case in getattr(item.module, "SLOW_CASES", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def test_models_dir(tmp_path_factory) -> Path:
    """Tiny random-weight HF folders, one per architecture, built once per session."""
    out = tmp_path_factory.mktemp("test_models")
    for name in ARCHITECTURES:
        make_test_model.write_model(out, name)
    return out
