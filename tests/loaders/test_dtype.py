"""dtype "auto" (jaxllm.loaders.dtype): the checkpoint's bfloat16 (or float16, as bfloat16)
where the CPU's kernels multiply bfloat16 natively, float32 elsewhere and for float32
checkpoints and GGUF files; what the start-up line says."""

import json
import shutil

import jax.numpy as jnp
import pytest

from jaxllm import LLM, cpu_kernels
from jaxllm.loaders import load_model
from jaxllm.loaders.dtype import checkpoint_dtype, choose_dtype
from tests.support.llm import LAZY


@pytest.mark.parametrize("native", [True, False])
def test_auto_takes_a_half_checkpoint_s_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch, native):
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: native)
    half = jnp.bfloat16 if native else jnp.float32
    assert choose_dtype("auto", "bfloat16")[0] == half and choose_dtype(None, "float16")[0] == half
    assert choose_dtype("auto", "float32") == (jnp.float32, "auto: the checkpoint's float32")
    assert choose_dtype("float32", "bfloat16") == (jnp.float32, "as asked")
    assert choose_dtype("bfloat16", "float32") == (jnp.bfloat16, "as asked")
    with pytest.raises(ValueError, match="dtype: unsupported 'float64'; choose one of auto, float32, bfloat16"):
        choose_dtype("float64", "float32")
    why = choose_dtype("auto", "bfloat16")[1]
    assert ("multiplies bfloat16 natively" in why) == native and ("no native bfloat16" in why) == (not native)


def test_no_kernels_is_float32(monkeypatch):
    def fail():
        raise cpu_kernels.KernelBuildError("no compiler")

    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", fail)
    assert choose_dtype("auto", "bfloat16")[0] == jnp.float32


def test_the_checkpoint_s_dtype_is_read_from_its_config(test_models_dir, tmp_path):
    """transformers 4's torch_dtype or 5's dtype; float32 where none is named, and for a GGUF."""
    import make_test_model

    assert checkpoint_dtype(test_models_dir / "llama") == "float32"
    folder = tmp_path / "half"
    shutil.copytree(test_models_dir / "llama", folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop("dtype", None), config.pop("torch_dtype", None)
        (folder / "config.json").write_text(json.dumps(config | {key: "bfloat16"}))
        assert checkpoint_dtype(folder) == "bfloat16"
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}))
    assert checkpoint_dtype(folder) == "float32"
    gguf = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "m.gguf", "Q8_0")
    assert checkpoint_dtype(gguf) == "float32"


def test_a_bfloat16_checkpoint_loads_and_starts_as_auto_chooses(test_models_dir, tmp_path):
    """The loaded weights and the engine's start-up line follow choose_dtype on this CPU
    (bfloat16 where it has AVX512_BF16: a machine-dependent answer, checked against the
    kernels' own report)."""
    folder = tmp_path / "half"
    shutil.copytree(test_models_dir / "llama", folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    want = jnp.bfloat16 if cpu_kernels.has_bf16_dot() else jnp.float32
    assert load_model(folder).params.layers[0].wqkv.dtype == want
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=1, max_num_batched_tokens=4, attention_backend="cpu",
              linear_backend="xla", num_scheduler_steps=1, progress=False, **LAZY)  # two step shapes: the start is the point
    assert llm.llm_engine.core.describe().startswith(f"dtype {jnp.dtype(want).name} (auto: a bfloat16 checkpoint")
    assert load_model(test_models_dir / "llama").params.layers[0].wqkv.dtype == jnp.float32
