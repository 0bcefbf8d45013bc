"""PEFT's LoRA format read into one device slot's arrays.

A PEFT adapter folder holds `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` ([r, in])
and `...lora_B.weight` ([out, r]). PEFT adds `scaling * B(A(x))` to the module's
output, scaling = alpha / r (alpha / sqrt(r) with rsLoRA). Here each module's A is
transposed to [in, r] and its B to [r, out] times the scaling, both zero-padded to the
engine's max_lora_rank (zeros add nothing), and laid out as the fused projections'
parts (jaxllm.models.lora). What the step cannot apply is refused with the reason:
DoRA, biases, modules outside q/k/v/o/gate/up/down (embeddings, lm_head,
modules_to_save), fan-in-fan-out layouts, ranks above max_lora_rank.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.models.lora import LoRAProjection, LoRAWeights, lora_targets

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.weight")


def read_config(path: Path) -> dict:
    """adapter_config.json, checked for what jaxllm can apply."""
    file = path / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"lora_path: {path} has no {CONFIG_NAME} (a PEFT LoRA adapter folder is expected)")
    config = json.loads(file.read_text())
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"lora_path: {path} is a {kind} adapter; only LoRA is supported")
    refusals = {"use_dora": "DoRA adapters are not supported", "fan_in_fan_out": "fan_in_fan_out layouts are not "
                "supported", "lora_bias": "adapters with a bias on B are not supported",
                "modules_to_save": "modules_to_save (fully trained modules) are not supported",
                "alpha_pattern": "per-module alpha (alpha_pattern) is not supported"}
    for key, why in refusals.items():
        if config.get(key):
            raise ValueError(f"lora_path: {path}: {why} ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"lora_path: {path}: trained biases (bias={config['bias']!r}) are not supported")
    return config


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise ValueError(f"lora_path: {path} has no {WEIGHTS_NAME}")
    return load_file(str(file))


def load_adapter(lora_path: str, cfg: ModelConfig, max_rank: int) -> tuple[LoRAWeights, int]:
    """One slot's arrays (numpy, float32: each a [D, P, R], each b [R, N]) for the
    adapter at `lora_path`, and its largest rank; ValueError naming the reason where
    the adapter cannot be served on `cfg` under `max_rank`."""
    path = Path(lora_path)
    if not path.is_dir():
        raise ValueError(f"lora_path: {lora_path} is not a directory")
    config = read_config(path)
    modules = _modules(read_tensors(path), path)
    targets = lora_targets(cfg)
    known = {(t.layer, name): (t, p) for t in targets for p, (name, _) in enumerate(t.parts)}
    per_layer: list[dict] = [{} for _ in range(cfg.num_layers)]
    for t in targets:
        a = np.zeros((t.in_features, len(t.parts), max_rank), np.float32)
        b = [np.zeros((max_rank, n), np.float32) for _, n in t.parts]
        per_layer[t.layer][t.field] = LoRAProjection(a, tuple(b))
    largest = 0
    for (layer, module), (lora_a, lora_b) in modules.items():
        if (layer, module) not in known:
            raise ValueError(f"lora_path: {path}: module {module} of layer {layer} is not a projection adapters may "
                             f"target here (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj of layers "
                             f"0..{cfg.num_layers - 1})")
        target, part = known[(layer, module)]
        rank = _check_shapes(lora_a, lora_b, target, part, max_rank, f"{path}: layer {layer} {module}")
        slot = per_layer[layer][target.field]
        slot.a[:, part, :rank] = lora_a.T
        slot.b[part][:rank] = lora_b.T * _scaling(config, rank)
        largest = max(largest, rank)
    if not modules:
        raise ValueError(f"lora_path: {path}: {WEIGHTS_NAME} holds no LoRA A/B tensors")
    return LoRAWeights(tuple(per_layer)), largest


def _modules(tensors: dict[str, np.ndarray], path: Path) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) -> (A, B) as stored; ValueError for a tensor that is neither."""
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, array in tensors.items():
        m = _KEY.fullmatch(name)
        if m is None:
            raise ValueError(f"lora_path: {path}: tensor {name} is not a LoRA A/B of a decoder layer's projection "
                             f"(embeddings, lm_head and other modules are not supported)")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = np.asarray(array, np.float32)
    missing = next((key for key, ab in found.items() if set(ab) != {"A", "B"}), None)
    if missing is not None:
        raise ValueError(f"lora_path: {path}: layer {missing[0]} {missing[1]} has lora_A or lora_B, not both")
    return {key: (ab["A"], ab["B"]) for key, ab in found.items()}


def _check_shapes(lora_a: np.ndarray, lora_b: np.ndarray, target, part: int, max_rank: int, where: str) -> int:
    rank = lora_a.shape[0]
    out = target.parts[part][1]
    if lora_a.shape != (rank, target.in_features) or lora_b.shape != (out, rank):
        raise ValueError(f"lora_path: {where}: lora_A {list(lora_a.shape)} and lora_B {list(lora_b.shape)} do not fit "
                         f"the base model (expected [r, {target.in_features}] and [{out}, r])")
    if rank > max_rank:
        raise ValueError(f"lora_path: {where}: rank {rank} exceeds max_lora_rank {max_rank} "
                         f"(raise --max-lora-rank)")
    return rank


def _scaling(config: dict, rank: int) -> float:
    """PEFT's scaling of a module of `rank`: lora_alpha / r, or / sqrt(r) with rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
