import os
from pathlib import Path

import make_test_model  # scripts/ is on sys.path: pyproject.toml's [tool.pytest.ini_options] pythonpath
import pytest
from jaxtyping import install_import_hook

# The array functions' jaxtyping shapes are checked at run time in the test run (at
# trace time under jit), so an annotation that drifts from the code fails a test.
# Installed before anything imports jaxllm.
install_import_hook(["jaxllm.models.llama", "jaxllm.models.pipeline", "jaxllm.models.bert", "jaxllm.models.vision", "jaxllm.worker.pooling_runner", "jaxllm.models.moe", "jaxllm.models.linear", "jaxllm.models.formats", "jaxllm.models.lora", "jaxllm.models.quant", "jaxllm.models.rope", "jaxllm.attention.xla", "jaxllm.attention.cpu",
                     "jaxllm.sample.sampler", "jaxllm.worker.step", "jaxllm.worker.model_runner", "jaxllm.worker.input_builder",
                     "jaxllm.worker.decode_loop", "jaxllm.spec_decode.ngram_proposer",
                     "pallas_kernels"],
                    "beartype.beartype")

# The helpers the tests share (tests/support/) assert as the tests do: pytest rewrites
# their asserts too, so a failure shows the values. Before anything imports them.
pytest.register_assert_rewrite("tests.support")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """The tests' programs compiled with LLVM's optimizations off (tests/support/xla_flags.py
    says why), before collection imports the test modules and they start a backend."""
    from tests.support.xla_flags import set_test_xla_flags

    set_test_xla_flags()


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
    from tests.support.models import ARCHITECTURES

    out = tmp_path_factory.mktemp("test_models")
    for name in ARCHITECTURES:
        make_test_model.write_model(out, name)
    return out


@pytest.fixture(scope="session")
def shared_cache_dir(tmp_path_factory) -> Path:
    """A compilation cache for the whole run, shared by the xdist workers (the run's base
    temporary directory; the store writes each entry atomically): the test servers and the
    offline engines compared with them compile and measure each configuration once
    (tests/support/server.py). Tests of a cold start keep a directory of their own."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-compilation-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def vision_models_dir(tmp_path_factory) -> Path:
    """The vision-language test models (made with HF transformers: scripts/make_test_model.py)."""
    out = tmp_path_factory.mktemp("vision_models")
    for name in make_test_model.VISION_LANGUAGE:
        make_test_model.write_vision_language_model(out, name)
    return out
