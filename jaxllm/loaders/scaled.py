"""Projections a checkpoint stores as 8-bit values with float scales: compressed-tensors'
W8A16 (`pack-quantized`, four int8 values to an int32 word, each stored plus 128) and
W8A8 (`int-quantized`: `weight` int8), FP8 (`float-quantized`, HF's fine-grained `fp8`:
`weight` float8_e4m3fn), each scale covering a block of the [out, in] matrix: the whole
tensor, one output row (channel), `group` inputs of a row, or a 2-D block (FP8's 128 x
128). The matrix is `scale * (value - zero)` (zero points: asymmetric int only).

jaxllm holds the symmetric int8 ones with one scale per output channel (or per tensor)
in its "int8" format (int8 values, a float32 scale per column of [in, out]): every
product of a bfloat16 / float16 scale and an 8-bit integer is exact in float32, so
those are the checkpoint's weights. The others (FP8, groups, blocks, zero points) are
dequantized to float32 at load (`quantization="none"`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxllm.models.params import QuantizedWeight

WORD_BITS = 32


def unpack_bits(words: np.ndarray, axis: int, bits: int) -> np.ndarray:
    """int32 words of 32 / `bits` unsigned values (value j in bits j*bits..), as uint8
    values, those of a word consecutive along `axis`."""
    per_word = WORD_BITS // bits
    shifts = np.arange(0, WORD_BITS, bits, dtype=np.uint32)
    values = (words.astype(np.uint32)[..., None] >> shifts) & ((1 << bits) - 1)  # [..., per_word]
    values = np.moveaxis(values, -1, axis + 1 if axis >= 0 else axis)
    shape = list(words.shape)
    shape[axis] *= per_word
    return values.reshape(shape).astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class ScaledMatrix:
    """One projection as stored: values [out, in] (int8, or float32 holding FP8 ones
    exactly), scales and zero points (or None) per block of `block` = (rows, inputs)
    (0: all of them), and each input's group where the checkpoint gives one (g_idx)."""

    values: np.ndarray
    scale: np.ndarray  # float32 [ceil(out / rows), ceil(in / inputs)]
    zero: np.ndarray | None
    block: tuple[int, int]
    group_of: np.ndarray | None = None

    def _expanded(self, a: np.ndarray) -> np.ndarray:
        """`a` (one entry per block) repeated over each block's entries: [out, in]."""
        out, k = self.values.shape
        rows, cols = (b or n for b, n in zip(self.block, (out, k)))
        a = np.repeat(a, rows, axis=0)[:out]
        return a[:, self.group_of] if self.group_of is not None else np.repeat(a, cols, axis=1)[:, :k]

    def weight(self) -> np.ndarray:
        """The float32 [out, in] matrix it stands for."""
        values = self.values.astype(np.float32)
        if self.zero is not None:
            values = values - self._expanded(self.zero.astype(np.float32))
        return values * self._expanded(self.scale)

    @property
    def per_channel(self) -> bool:
        """Symmetric int8 with one scale per output row (or one for all): jaxllm's int8."""
        return self.values.dtype == np.int8 and self.zero is None and self.block[1] == 0

    def held(self) -> QuantizedWeight:
        """As jaxllm's int8 format holds it, in the HF orientation ([out, in], one scale
        per row; build_params transposes it to [in, out], a scale per column)."""
        if not self.per_channel:
            raise ValueError(f"int8 per channel expected, not {self.values.dtype} values in blocks of {self.block}"
                             f"{' with zero points' if self.zero is not None else ''}")
        scale = self._expanded(self.scale)[:, 0]
        return QuantizedWeight(np.ascontiguousarray(self.values), np.ascontiguousarray(scale), 0, bits=8,
                               group_axis=1)


def read_scaled(get: Callable[[str], np.ndarray | None], module: str, suffixes: tuple[str | None, ...],
                packed: bool, block: tuple[int, int] | None) -> ScaledMatrix:
    """`module`'s tensors, read by `get` (None when absent): values, zero points, scales
    and g_idx named by `suffixes`; `packed`: compressed-tensors' int32 words of four int8
    values plus 128 ([out, in / 4]; zero points [out / 4, ...] packed along the outputs);
    `block` None: read from the scale's shape (one element: the tensor; one per row)."""
    names = [None if s is None else f"{module}.{s}" for s in suffixes]
    raw, zero, scale, g_idx = (None if n is None else get(n) for n in names)
    if raw is None or scale is None:
        missing = [n for n, a in zip((names[0], names[2]), (raw, scale)) if a is None]
        raise ValueError(f"tensors missing: {', '.join(missing)}")
    values = np.asarray(raw)
    if packed:
        shape = get(f"{module}.weight_shape")
        values = (unpack_bits(values, 1, 8).astype(np.int16) - 128).astype(np.int8)
        if shape is not None:
            values = values[:, : int(np.asarray(shape)[1])]
        if zero is not None:
            zero = unpack_bits(np.asarray(zero), 0, 8).astype(np.int32) - 128
    elif values.dtype != np.int8:
        values = values.astype(np.float32)  # FP8: every value is a float32
    scale = np.asarray(scale, np.float32)
    scale = scale.reshape(1, 1) if scale.size == 1 else scale.reshape(scale.shape[0], -1)
    out, k = values.shape
    if block is None:
        block = (0, 0) if scale.size == 1 else (1, 0)
    if zero is not None:  # as the scales (packed: past the outputs' padding to a multiple of four)
        zero = np.asarray(zero)
        zero = zero.reshape(1, 1) if zero.size == 1 else zero.reshape(zero.shape[0], -1)
        zero = zero[: scale.shape[0], : scale.shape[1]]
    group_of = None if g_idx is None else np.asarray(g_idx).astype(np.int64)
    matrix = ScaledMatrix(values, scale, zero, block, group_of)
    expect = tuple(-(-n // (b or n)) for n, b in zip((out, k), block))
    if group_of is not None:
        expect = (expect[0], int(group_of.max()) + 1 if group_of.size else 0)
    if scale.shape != expect or (zero is not None and zero.shape != scale.shape):
        raise ValueError(f"scales {scale.shape} do not cover a {out} x {k} matrix in blocks of "
                         f"{block} ({expect} expected)")
    return matrix
