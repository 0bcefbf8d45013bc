"""Converted checkpoints with orbax: save a params pytree once, restore it fast.

A converted checkpoint folder holds `params/` (an orbax PyTree checkpoint),
`config.json` (the ModelConfig in HF transformers-5 form), the tokenizer files and a
marker file, so it loads without re-parsing (or dequantizing) the original weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.models.params import ModelParams, abstract_params, declare, map_declared

PARAMS_DIR = "params"
MARKER = "jaxllm_checkpoint.json"


def is_converted_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_checkpoint(folder: str | Path, cfg: ModelConfig, params: ModelParams, tokenizer, source: str = "") -> Path:
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(folder / PARAMS_DIR, params, force=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    dtype = str(params.final_norm.dtype)  # the float parameters (quantized ones are stored as they are)
    (folder / MARKER).write_text(json.dumps({"source": source, "dtype": dtype}))
    return folder


def restore_params(folder: str | Path, cfg: ModelConfig, dtype, on_host: bool = False) -> ModelParams:
    """Restore into the structure `cfg` implies, cast to the compute dtype (quantized
    projections as stored: `cfg.quantization`, from the folder's config); `on_host`:
    restored through the CPU backend into numpy arrays (host memory, for placing shard
    by shard), never onto an accelerator."""
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    stored = json.loads((folder / MARKER).read_text())["dtype"]
    target = abstract_params(cfg, jnp.dtype(stored))
    if on_host:
        cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu), target)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(folder / PARAMS_DIR, target)

    def cast(decl, array):  # quantized projections (values, scales, mins) stay as stored
        if decl.quant:
            return jax.tree.map(np.asarray, array) if on_host else array
        return np.asarray(array).astype(jnp.dtype(dtype)) if on_host else array.astype(dtype)

    return map_declared(cast, declare(cfg), params)
