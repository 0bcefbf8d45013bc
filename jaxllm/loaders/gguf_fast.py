"""A fast reader for little-endian GGUF v2/v3 files: metadata and tensor views.

`gguf.GGUFReader` builds two numpy views per string of the tokenizer's arrays (about
100k for a 49k-token vocabulary), which takes seconds; this reader walks the same
bytes with `struct` and decodes the values directly into the Python values
`ReaderField.contents()` returns, and maps tensors as the same numpy views over a
memmap. Anything it does not handle (big-endian files, other versions) raises
`UnsupportedLayout`, and the caller falls back to `gguf.GGUFReader`.

Q8_0 tensors, the common case, are dequantized here in one vectorized pass (the same
arithmetic as `gguf.quants`, so the same float32 bits); other types go through
`gguf.quants.dequantize`.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

GGUF_MAGIC = 0x46554747  # "GGUF" little-endian
DEFAULT_ALIGNMENT = 32

# GGUFValueType -> (struct format, size) for scalars
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class UnsupportedLayout(ValueError):
    """The file is valid GGUF this reader does not handle; use gguf.GGUFReader."""


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # like gguf.ReaderTensor.data: elements (float types) or bytes per row


class GGUFContents(NamedTuple):
    metadata: dict[str, Any]
    tensors: list[Tensor]


def read_gguf(path: str | Path) -> GGUFContents:
    import gguf

    mm = np.memmap(path, mode="r")
    buf = memoryview(mm)
    if len(buf) < 24 or struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
        raise UnsupportedLayout("not a little-endian GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise UnsupportedLayout(f"GGUF version {version}")
    offset = 24

    def read_string(offset: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, offset)
        end = offset + 8 + n
        if end > len(buf):
            raise ValueError("truncated string")
        return str(buf[offset + 8:end], "utf-8"), end

    def read_value(vtype: int, offset: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return read_string(offset)
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, offset)[0], offset + size
        if vtype == _ARRAY:
            itype, count = struct.unpack_from("<IQ", buf, offset)
            offset += 12
            if itype == _STRING:
                items = []
                for _ in range(count):
                    item, offset = read_string(offset)
                    items.append(item)
                return items, offset
            if itype in _NUMPY:
                dtype = np.dtype(_NUMPY[itype])
                end = offset + count * dtype.itemsize
                if end > len(buf):
                    raise ValueError("truncated array")
                return np.frombuffer(buf[offset:end], dtype).tolist(), end
            raise UnsupportedLayout(f"array of value type {itype}")
        raise UnsupportedLayout(f"value type {vtype}")

    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key, offset = read_string(offset)
        (vtype,) = struct.unpack_from("<I", buf, offset)
        value, offset = read_value(vtype, offset + 4)
        if key in metadata:
            raise ValueError(f"duplicate key {key}")
        metadata[key] = value

    infos = []
    for _ in range(n_tensors):
        name, offset = read_string(offset)
        (n_dims,) = struct.unpack_from("<I", buf, offset)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, offset + 4)
        raw_type, tensor_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        infos.append((name, dims, gguf.GGMLQuantizationType(raw_type), tensor_offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError("invalid general.alignment")
    data_start = offset + (-offset) % alignment

    tensors, names = [], set()
    float_types = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}
    for name, dims, qtype, tensor_offset in infos:
        if name in names:
            raise ValueError(f"duplicated tensor {name}")
        names.add(name)
        n_elems = int(np.prod(dims))
        np_dims = tuple(reversed(dims))
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        start = data_start + tensor_offset
        if qtype.name in float_types:
            dtype = np.dtype(float_types[qtype.name])
            count = n_elems
        else:
            dtype = np.dtype(np.uint8)
            count = n_elems * type_size // block_size
            np_dims = gguf.quants.quant_shape_to_byte_shape(np_dims, qtype)
        end = start + count * dtype.itemsize
        if end > len(mm):
            raise ValueError(f"tensor {name} extends past the end of the file")
        tensors.append(Tensor(name, qtype, mm[start:end].view(dtype).reshape(np_dims)))
    return GGUFContents(metadata, tensors)


def _split_blocks(data: np.ndarray, block_bytes: int, header_halves: int):
    """[..., row_bytes] bytes -> (f16 header fields as float32 [n, 1] each, payload [n, k])."""
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)
    headers = [blocks[:, 2 * i:2 * i + 2].copy().view(np.float16).astype(np.float32) for i in range(header_halves)]
    return headers, blocks[:, 2 * header_halves:]


def _nibbles(qs: np.ndarray, dtype) -> np.ndarray:
    """Per block: the 16 low nibbles, then the 16 high nibbles (ggml's order)."""
    out = np.empty((qs.shape[0], 2 * qs.shape[1]), dtype)
    out[:, :qs.shape[1]] = qs & np.uint8(0x0F)
    out[:, qs.shape[1]:] = qs >> np.uint8(4)
    return out


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """float32 values of a tensor's data, as `gguf.quants.dequantize` computes them (the
    same operations in the same order, so the same bits), vectorized over the whole
    tensor for Q8_0, Q4_0 and Q4_1 (3-4x faster than gguf's groups of 16 rows)."""
    import gguf

    q = gguf.GGMLQuantizationType
    if qtype not in (q.Q8_0, q.Q4_0, q.Q4_1):
        return gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == q.Q8_0:  # f16 scale d, 32 int8: x * d
        (d,), qs = _split_blocks(data, block_bytes, 1)
        values = qs.view(np.int8).astype(np.float32)
        values *= d
    elif qtype == q.Q4_0:  # f16 scale d, 32 nibbles: d * (q - 8)
        (d,), qs = _split_blocks(data, block_bytes, 1)
        values = (_nibbles(qs, np.int8) - np.int8(8)).astype(np.float32)
        values *= d
    else:  # Q4_1: f16 scale d, f16 min m, 32 nibbles: d * q + m
        (d, m), qs = _split_blocks(data, block_bytes, 2)
        values = _nibbles(qs, np.float32)
        values *= d
        values += m
    return values.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * block_elems)
