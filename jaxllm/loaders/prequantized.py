"""HF checkpoints quantized by GPTQ, AWQ, llm-compressor or to FP8: a model folder
whose config.json has a `quantization_config` with `quant_method` "gptq" (AutoGPTQ /
GPTQModel), "awq" (AutoAWQ, llm-awq's GEMM layout), "compressed-tensors" (its
"pack-quantized" format, weight-only W4A16 and W8A16; "int-quantized" W8A8;
"float-quantized" FP8) or "fp8" (HF's fine-grained FP8): what vLLM's `gptq`, `awq`,
`compressed-tensors` and `fp8` methods read. 8-bit values packed by groups (GPTQ-Int8,
compressed-tensors W8A16 by group) are read as the 4-bit ones below, four to a word
(plus 128 in compressed-tensors), and held as int8_g128 / int8_g64 / int8_g32 (values
less 128, mins -scale * (zero - 128)). The other 8-bit ones are read by
jaxllm.loaders.scaled: symmetric int8 per channel is held as jaxllm's int8 (a W8A8
checkpoint's activations then stay float), FP8 and the rest only dequantized at load
(`quantization="none"`; refused as stored, naming that remedy).
The 4-bit ones:

Each quantized projection `<module>.weight` is stored as
- `qweight` int32, 4-bit values eight to a word: GPTQ packs along the inputs ([in / 8,
  out], input 8i + j in bits 4j..4j+3), AWQ along the outputs ([in, out / 8], column
  8c + AWQ_ORDER[j] in bits 4j..);
- `qzeros` int32 [in / group, out / 8], the zero points packed along the outputs as
  qweight's columns are (GPTQ in order; its original "gptq" checkpoint format stores
  each zero less one, "gptq_v2" as it is);
- `scales` float16 [in / group, out];
- GPTQ's `g_idx` int32 [in]: each input's group (i // group unless the checkpoint was
  quantized in activation order, `desc_act`).

compressed-tensors names them `weight_packed` (int32 [out, in / 8], packed along the
inputs, each value stored plus 8), `weight_scale` ([out, in / group], the model's float
dtype), `weight_zero_point` (asymmetric only: int32 [out / 8, in / group], packed along
the outputs, plus 8 too; symmetric: zero) and `weight_g_idx` (activation order).

The weight is `scale * (q - zero)`. jaxllm holds it in its int4 formats (4-bit values, a
float32 scale and min per group: min = -scale * zero), whose kernels compute each weight
as fl(fl(scale * q) + min). Both products are exact in float32 (a float16 or bfloat16
scale times an integer below 16) and so is their sum, so the weights the kernels
multiply are the checkpoint's exactly: `quantization="none"` (dequantized at load) gives
the same matrix. A projection in activation order (g_idx not i // group) is held with
its rows sorted by group and that order of its inputs (`QuantizedWeight.perm`: `linear`
takes x's inputs in it), marked in the config's `tensor_quantization` ("int4+act_order")
so that the declaration, and with it the abstract params, carry the order too. Which
projections are quantized is read from the checkpoint (a `qweight` or `weight_packed`
beside them): an unquantized lm_head or module stays as stored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.loaders.scaled import read_scaled, unpack_bits
from jaxllm.models.params import ACT_ORDER, GROUPED_FORMATS, QUANT_FORMATS, QuantizedWeight, declarations

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
# jaxllm's format for each (bits, group size) a grouped checkpoint may have (inputs per scale)
HELD_FORMATS = {(QUANT_FORMATS[name].bits, QUANT_FORMATS[name].group): name for name in GROUPED_FORMATS}
HELD_GROUPS = sorted({group for _, group in HELD_FORMATS})
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_ORDER[j] of its eight
PACK = 8  # 4-bit values per int32
# each method's tensors of a projection: values, zero points, scales, g_idx (optional)
SUFFIXES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales", "g_idx"),
            "compressed-tensors": ("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx")}
# 8-bit values stored as `weight` (jaxllm.loaders.scaled): compressed-tensors' int- and
# float-quantized formats, HF's fine-grained FP8 (per block, scales named weight_scale_inv) and
# per-tensor FP8
STORED_SUFFIXES = {"compressed-tensors": ("weight", "weight_zero_point", "weight_scale", "weight_g_idx"),
                   "fp8": ("weight", None, "weight_scale", None)}
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
NONE_REMEDY = "quantization='none' dequantizes it to the model's dtype at load"


class PrequantizedError(ValueError):
    """A GPTQ / AWQ / compressed-tensors checkpoint jaxllm cannot hold as it is stored."""


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's `quantization_config`, validated."""

    method: str  # "gptq", "awq", "compressed-tensors" or "fp8"
    group: int  # inputs per scale of grouped values (4-bit, GPTQ's or compressed-tensors' packed 8-bit); else 0
    zero_offset: int  # what is added to a stored zero point: 1 in GPTQ's original format
    symmetric: bool = False  # compressed-tensors: no zero points stored (zero 8 on the stored values)
    bits: int = 4  # 8: int8 or FP8 values (ungrouped: read by jaxllm.loaders.scaled)
    packed: bool = True  # values packed into int32 words (else stored as `weight`)
    block: tuple[int, int] | None = None  # 8 bits: (rows, inputs) per scale, 0 all; None: the scale's shape says
    scale_suffix: str = ""  # 8 bits: the scales' tensor, where not the method's usual one
    why: str = ""  # what keeps jaxllm from holding it as stored ("": nothing)
    activations: bool = False  # the checkpoint also quantizes activations (W8A8): not applied

    @property
    def suffixes(self) -> tuple[str | None, ...]:
        """The tensors of a projection: values, zero points, scales, g_idx."""
        if self.group:
            return SUFFIXES[self.method]
        values, zeros, scales, g_idx = STORED_SUFFIXES[self.method]
        return ("weight_packed" if self.packed else values, zeros, self.scale_suffix or scales, g_idx)

    @property
    def marker(self) -> str:
        """The suffix of the tensor only a quantized projection has: its packed values,
        or the scales of values stored as `weight`."""
        return self.suffixes[0] if self.packed else self.suffixes[2]

    @property
    def held(self) -> str | None:
        """The jaxllm format its projections are held in; None where it holds none (`why`)."""
        if self.why:
            return None
        return HELD_FORMATS[self.bits, self.group] if self.group else "int8"

    @classmethod
    def from_hf(cls, qc: Mapping[str, Any], source: str) -> CheckpointQuantization:
        method = str(qc.get("quant_method", "")).lower()
        if method not in METHODS:
            raise PrequantizedError(f"{source}: quantization_config quant_method {method!r} is not supported; "
                                    f"jaxllm reads {', '.join(METHODS)} checkpoints and GGUF files")
        if method == "fp8":
            return cls._fp8(qc, source)
        weights = _compressed_tensors_weights(qc, source) if method == "compressed-tensors" else qc
        bits = int(_first(weights, ("bits", "w_bit", "num_bits"), 4))
        group = int(_first(weights, ("group_size", "q_group_size"), 128))
        grouped = method != "compressed-tensors" or (weights.get("strategy") == "group" and group in HELD_GROUPS
                                                     and qc.get("format") == "pack-quantized")
        if method == "compressed-tensors" and bits == 8 and not grouped:
            return cls._compressed_tensors_8bit(qc, weights, source)
        if bits not in (4, 8) or (bits == 8 and method == "awq"):
            raise PrequantizedError(f"{source}: {method} with {bits}-bit weights is not supported (4-bit; GPTQ "
                                    f"and compressed-tensors 8-bit)")
        if (bits, group) not in HELD_FORMATS or not grouped:
            layout = f"{qc.get('format')} " if method == "compressed-tensors" else ""
            raise PrequantizedError(f"{source}: {method} {layout}{bits}-bit weights by "
                                    f"{weights.get('strategy', 'group')} (group_size {group}) are not supported; "
                                    f"jaxllm holds them packed by groups of {', '.join(str(g) for g in HELD_GROUPS)} "
                                    f"inputs")
        if method == "compressed-tensors":
            return cls(method, group, 0, bool(weights.get("symmetric", True)), bits)
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or not qc.get("zero_point", True):
                raise PrequantizedError(f"{source}: AWQ version {version!r} zero_point={qc.get('zero_point')} is "
                                        f"not supported (the GEMM layout with zero points only)")
            return cls(method, group, 0)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise PrequantizedError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("dynamic"):
            raise PrequantizedError(f"{source}: GPTQ per-module overrides (dynamic) are not supported")
        return cls(method, group, 1 if fmt == "gptq" else 0, bits=bits)  # desc_act: read from each g_idx

    @classmethod
    def _fp8(cls, qc: Mapping[str, Any], source: str) -> CheckpointQuantization:
        """HF's fine-grained FP8 (e4m3 values, a float32 `weight_scale_inv` per block of
        `weight_block_size`, multiplied) or per-tensor FP8 (`weight_scale`)."""
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise PrequantizedError(f"{source}: fp8 fmt {qc.get('fmt')!r} is not supported (e4m3)")
        size = qc.get("weight_block_size")
        if size is not None and (len(size) != 2 or min(size) < 1):
            raise PrequantizedError(f"{source}: fp8 weight_block_size {size!r} is not two block sizes")
        return cls("fp8", 0, 0, True, 8, False, None if size is None else (int(size[0]), int(size[1])),
                   "weight_scale_inv" if size is not None else "", why="FP8 weights",
                   activations=qc.get("activation_scheme") is not None)

    @classmethod
    def _compressed_tensors_8bit(cls, qc: Mapping[str, Any], weights: Mapping[str, Any],
                                 source: str) -> CheckpointQuantization:
        """compressed-tensors 8-bit, but packed by groups jaxllm holds (`from_hf`): W8A16
        packed, W8A8 int, FP8; symmetric int8 per channel (or tensor) is held as int8,
        the rest dequantized on request (`why`)."""
        fmt, kind, strategy = qc.get("format"), weights.get("type", "int"), weights.get("strategy")
        bits, symmetric = int(weights.get("num_bits", 8)), bool(weights.get("symmetric", True))
        if bits != 8 or kind not in ("int", "float") or (kind == "float" and fmt == "pack-quantized"):
            raise PrequantizedError(f"{source}: compressed-tensors {fmt} with {bits}-bit {kind} weights is not "
                                    f"supported (4-bit pack-quantized; 8-bit int or FP8)")
        blocks = {"tensor": (0, 0), "channel": (1, 0), "group": (1, int(weights.get("group_size") or 0)),
                  "block": tuple(int(b) for b in weights.get("block_structure") or (0, 0))}
        if strategy not in blocks or (strategy in ("group", "block") and min(blocks[strategy]) < 1):
            raise PrequantizedError(f"{source}: compressed-tensors weights by {strategy!r} are not supported "
                                    f"(tensor, channel, group, block)")
        why = ("FP8 weights" if kind == "float" else "asymmetric int8 weights" if not symmetric
               else f"int8 weights by {strategy}" if strategy in ("group", "block") else "")
        activations = bool(_only_scheme(qc, source).get("input_activations"))
        return cls("compressed-tensors", 0, 0, symmetric, 8, fmt == "pack-quantized", blocks[strategy], why=why,
                   activations=activations)

    def refusal(self, source: str) -> str:
        """Why loading it as stored is refused, and what to do."""
        return (f"{source}: {self.why} ({self.method}): jaxllm holds no such weights as stored (it keeps 4-bit "
                f"groups and symmetric int8 per channel); {NONE_REMEDY}")


def _only_scheme(qc: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or qc.get("sparsity_config"):
        raise PrequantizedError(f"{source}: compressed-tensors with {len(groups)} config groups"
                                f"{' and sparsity' if qc.get('sparsity_config') else ''} is not supported (one)")
    return groups[0]


def _compressed_tensors_weights(qc: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """The weights' scheme of a compressed-tensors config, if jaxllm reads it: one of
    CT_FORMATS, one config group, static weight scales, no sparsity, activations not
    quantized but for 8-bit weights (W8A8: read as W8A16)."""
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise PrequantizedError(f"{source}: compressed-tensors format {fmt!r} is not supported "
                                f"({', '.join(CT_FORMATS)})")
    scheme = _only_scheme(qc, source)
    weights = scheme.get("weights") or {}
    if (scheme.get("input_activations") and int(weights.get("num_bits", 8)) != 8) or scheme.get(
            "output_activations"):
        raise PrequantizedError(f"{source}: compressed-tensors quantizing activations with other than 8-bit "
                                f"weights (W4A8) is not supported; weight-only (W4A16, W8A16) and W8A8 are")
    if weights.get("dynamic"):
        raise PrequantizedError(f"{source}: compressed-tensors weights with dynamic scales are not supported")
    return weights


def _first(qc: Mapping[str, Any], keys: tuple[str, ...], default):
    return next((qc[k] for k in keys if qc.get(k) is not None), default)


def read_quantization(folder: str | Path) -> CheckpointQuantization | None:
    """The folder's GPTQ / AWQ / compressed-tensors quantization, or None for a float (or
    jaxllm-converted) checkpoint."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text()).get("quantization_config")
    return None if qc is None else CheckpointQuantization.from_hf(qc, str(path))


def module_of(name: str) -> str | None:
    """`<module>` of a projection's `<module>.weight` name, else None."""
    return name[: -len(".weight")] if name.endswith(".weight") else None


def held_config(cfg: ModelConfig, quant: CheckpointQuantization, names: set[str],
                get: Callable[[str], np.ndarray | None], source: str = "the checkpoint") -> ModelConfig:
    """`cfg` with the projections held as the checkpoint stores them: each declared
    projection whose tensors all have a `qweight` (`weight_packed`) in `names` in
    `quant.held`, the ones with none as stored (an lm_head GPTQ left in float16, AWQ's
    modules_to_not_convert); one fused from parts stored both ways is an error. A
    projection in activation order (its g_idx, read by `get`) is marked so. A scheme
    jaxllm holds no format for (FP8...) is refused, naming the remedy."""
    if quant.held is None:
        raise PrequantizedError(quant.refusal(source))
    quantized = dataclasses.replace(cfg, quantization=quant.held)
    own, projections = [], 0
    for decl in declarations(quantized):
        if not decl.quant:
            continue
        projections += 1
        stored = {f"{module_of(name)}.{quant.marker}" in names for one in decl.per_expert() for name, _ in one.hf}
        if stored == {True, False}:
            raise PrequantizedError(f"{decl.hf[0][0]}: its parts ({', '.join(n for n, _ in decl.hf)}) are stored "
                                    f"some quantized, some not; jaxllm fuses them into one projection")
        if stored == {False}:
            own.append((decl.hf[0][0], "none"))
        elif _in_activation_order(quant, decl, get):
            own.append((decl.hf[0][0], f"{quant.held}+{ACT_ORDER}"))
    if sum(f == "none" for _, f in own) == projections:
        raise PrequantizedError(f"the checkpoint's config says {quant.method} but it holds no {quant.marker} "
                                f"tensors")
    return dataclasses.replace(quantized, tensor_quantization=tuple(own))


def _in_activation_order(quant: CheckpointQuantization, decl, get: Callable[[str], np.ndarray | None]) -> bool:
    """Whether a declared projection's parts are stored in activation order (their g_idx
    not the inputs' own): then they must share one order, and not be a mixture's
    experts or the output projection."""
    g_idx = quant.suffixes[3]
    if g_idx is None or not quant.group:  # ungrouped (int8 per channel): no order
        return False
    orders = [get(f"{module_of(name)}.{g_idx}") for one in decl.per_expert() for name, _ in one.hf]
    if all(o is None or np.array_equal(o, np.arange(len(o)) // quant.group) for o in orders):
        return False
    name = decl.hf[0][0]
    if decl.experts or not name.startswith("model.layers.") or any(o is None for o in orders):
        raise PrequantizedError(f"{name}: activation order (desc_act) is kept for a layer's dense projections "
                                f"only; quantization='none' dequantizes it at load")
    if any(not np.array_equal(np.argsort(o, kind="stable"), np.argsort(orders[0], kind="stable")) for o in orders):
        raise PrequantizedError(f"{name}: its parts ({', '.join(n for n, _ in decl.hf)}) are in different "
                                f"activation orders; jaxllm fuses them into one projection; quantization='none' "
                                f"dequantizes them at load")
    return True


def unpack_int4(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words of eight 4-bit values (value j in bits 4j..4j+3) as uint8 values,
    the eight of a word consecutive along `axis`."""
    return unpack_bits(words, axis, 4)


def _awq_columns(values: np.ndarray) -> np.ndarray:
    """Unpacked AWQ columns (nibble order) in column order."""
    order = np.argsort(AWQ_ORDER)  # column c is nibble order[c] of its word
    rows, cols = values.shape
    return values.reshape(rows, cols // PACK, PACK)[:, :, order].reshape(rows, cols)


@dataclasses.dataclass(frozen=True)
class StoredProjection:
    """One projection as the checkpoint stores it, unpacked: values and zero points in
    [0, 2^bits), float16 scales, each input's group."""

    q: np.ndarray  # uint8 [in, out]
    zeros: np.ndarray  # int32 [in / group, out]
    scales: np.ndarray  # float32 [in / group, out] (the checkpoint's float16 or bfloat16 ones, exact)
    group_of: np.ndarray  # int [in]
    bits: int = 4

    def weight(self) -> np.ndarray:
        """The float32 [in, out] matrix it stands for, scale * (q - zero) (exact)."""
        g = self.group_of
        return self.scales[g] * (self.q.astype(np.float32) - self.zeros[g].astype(np.float32))

    def perm(self, group: int, name: str) -> np.ndarray | None:
        """The order of the inputs that makes each group's consecutive (activation order:
        GPTQ's desc_act), or None where they already are."""
        k = self.q.shape[0]
        if np.array_equal(self.group_of, np.arange(k) // group):
            return None
        perm = np.argsort(self.group_of, kind="stable").astype(np.int32)
        if not np.array_equal(self.group_of[perm], np.arange(k) // group):
            raise PrequantizedError(f"{name}: g_idx puts other than {group} inputs in a group")
        return perm

    def held(self, group: int, name: str) -> QuantizedWeight:
        """As jaxllm's int4 (int8_g*) format holds it, in the HF orientation ([out, in],
        grouped along the inputs): values (8-bit ones less 128, to fit an int8), float32
        scales and mins -scale * (zero - that offset), each exact; in activation order,
        its inputs sorted by group, with their order (`perm`)."""
        offset = 128 if self.bits == 8 else 0
        scale = self.scales
        mins = -(scale * (self.zeros - offset).astype(np.float32))
        perm = self.perm(group, name)
        q = (self.q if perm is None else self.q[perm]).astype(np.int16) - offset
        return QuantizedWeight(np.ascontiguousarray(q.T.astype(np.int8)), np.ascontiguousarray(scale.T), group,
                               np.ascontiguousarray(mins.T), bits=self.bits, group_axis=1, perm=perm)


def stored_projection(quant: CheckpointQuantization, get: Callable[[str], np.ndarray | None],
                      module: str) -> StoredProjection:
    """`module`'s grouped tensors (read by `get`, None when absent) unpacked, shapes checked."""
    suffixes = quant.suffixes
    needed = suffixes[:1] + suffixes[2:3] if quant.symmetric else suffixes[:3]
    parts = {s: get(f"{module}.{s}") for s in suffixes}
    missing = [s for s in needed if parts[s] is None]
    if missing:
        raise PrequantizedError(f"{module}: {quant.method} tensors missing: {', '.join(missing)}")
    qweight, qzeros, scales = (None if parts[s] is None else np.asarray(parts[s]) for s in suffixes[:3])
    bits = quant.bits
    if quant.method == "gptq":
        q = unpack_bits(qweight, 0, bits)
        zeros = unpack_bits(qzeros, 1, bits).astype(np.int32) + quant.zero_offset
    elif quant.method == "awq":
        q = _awq_columns(unpack_int4(qweight, 1))
        zeros = _awq_columns(unpack_int4(qzeros, 1)).astype(np.int32)
    else:  # [out, ...] as torch.nn.Linear, each word padded: values and zero points stored plus 2^(bits-1),
        # so w = scale * (q - zero) on the stored ones (symmetric: zero 2^(bits-1))
        out, inputs = scales.shape[0], scales.shape[1] * quant.group
        q, scales = unpack_bits(qweight, 1, bits)[:, :inputs].T, scales.T
        zeros = (np.full(scales.shape, 1 << (bits - 1), np.int32) if quant.symmetric
                 else unpack_bits(qzeros, 0, bits)[:out].T.astype(np.int32))
    k, n = q.shape
    if scales.shape != (k // quant.group, n) or zeros.shape != scales.shape or k % quant.group:
        raise PrequantizedError(f"{module}: {suffixes[0]} {qweight.shape}, zero points {zeros.shape}, scales "
                                f"{scales.shape} do not make a {k} x {n} matrix in groups of {quant.group}")
    g_idx = parts[suffixes[3]]
    group_of = np.arange(k) // quant.group if g_idx is None else np.asarray(g_idx).astype(np.int64)
    if group_of.shape != (k,) or group_of.min() < 0 or group_of.max() >= k // quant.group:
        raise PrequantizedError(f"{module}: g_idx of shape {group_of.shape} is not one group per input")
    return StoredProjection(q, zeros, scales.astype(np.float32), group_of, bits)


def quantized_source(quant: CheckpointQuantization, get: Callable[[str], np.ndarray | None], names: set[str],
                     held: set[str]) -> Callable[[str], np.ndarray | QuantizedWeight | None]:
    """A tensor source over the checkpoint's own (`get`, holding `names`): a projection's
    `<module>.weight` comes from its packed tensors, kept (a QuantizedWeight, HF
    orientation) where its name is in `held`, else dequantized to float32 [out, in];
    everything else as stored."""

    if quant.activations:
        logger.warning("the checkpoint quantizes activations too (%s); jaxllm multiplies its weights with float "
                       "activations", quant.method)

    def source(name: str):
        module = module_of(name)
        if module is None or f"{module}.{quant.marker}" not in names:
            return get(name)
        if not quant.group:
            try:
                stored = read_scaled(get, module, quant.suffixes, quant.packed, quant.block)
                return stored.held() if name in held else np.ascontiguousarray(stored.weight())
            except ValueError as e:
                raise PrequantizedError(f"{quant.method} {module}: {e}") from None
        stored = stored_projection(quant, get, module)
        return stored.held(quant.group, name) if name in held else np.ascontiguousarray(stored.weight().T)

    return source


def held_names(cfg: ModelConfig) -> set[str]:
    """The HF names of the projections `cfg` declares quantized."""
    return {name for decl in declarations(cfg) if decl.quant for one in decl.per_expert() for name, _ in one.hf}
