"""One host-to-device transfer per step: a step's inputs packed into one int32 buffer.

A step's inputs (`StepInputs`: token ids, positions, block tables, sampling parameters,
flags) are ~40 small host arrays; handed to the executable as they are, each is its own
host-to-device copy (on the H100, most of a decode step's host time went to those and
to walking the pytree). `PackLayout` fixes, per step shape, where each leaf lives in one
flat int32 buffer (int32 as is, uint32 by its bits, bool as 0/1, float32 by its bits),
so the host sends one array and the step unpacks it with static slices, which cost
nothing on the device. Each leaf starts on a 256-byte boundary (ALIGN words): XLA
hands a static slice of a parameter to a custom call as a view at its offset, and
Mosaic GPU's kernels refuse an operand that is not 256-byte aligned (the H200,
2026-11-30: "Input buffer 1 is not 256-byte aligned", the attention's block tables).
Leaves named in `separate` (the structured-output token bitmask: large, and kept on the
device when no row is constrained) stay arguments of their own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# the leaf dtypes the int32 buffer holds: int32 as is, uint32 and float32 by their bits, bool as 0/1
PACKABLE = frozenset(map(np.dtype, (np.int32, np.uint32, np.float32, np.bool_)))
ALIGN = 64  # words: each leaf's offset a multiple of 256 bytes


@dataclasses.dataclass(frozen=True)
class Slot:
    """One leaf's place in the buffer: `size` words from `offset`, viewed as `shape`."""

    offset: int
    size: int
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each leaf of one step shape's inputs lives (hashable: a jit static argument).
    `slots[i]` is None for a leaf passed separately (`of`'s `separate`, in leaf order)."""

    treedef: jax.tree_util.PyTreeDef
    slots: tuple[Slot | None, ...]
    size: int

    @classmethod
    def of(cls, inputs, separate: tuple[str, ...] = ()) -> PackLayout:
        """The layout of `inputs` (arrays or ShapeDtypeStructs); a leaf whose field
        name is in `separate` is left out."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(inputs)
        slots, offset = [], 0
        for path, leaf in leaves:
            if getattr(path[-1], "name", None) in separate:
                slots.append(None)
                continue
            dtype = np.dtype(leaf.dtype)
            if dtype not in PACKABLE:
                raise TypeError(f"PackLayout: {jax.tree_util.keystr(path)} is {dtype}, not int32, uint32, "
                                "float32 or bool")
            size = int(np.prod(leaf.shape, dtype=np.int64))
            slots.append(Slot(offset, size, tuple(leaf.shape), dtype.name))
            offset += -(-size // ALIGN) * ALIGN
        return cls(treedef, tuple(slots), offset)

    def pack(self, inputs) -> tuple[np.ndarray, list]:
        """The int32 buffer of `inputs` (host arrays of this layout) and the separate
        leaves, in order."""
        leaves = self.treedef.flatten_up_to(inputs)
        buf = np.empty(self.size, np.int32)  # the padding between leaves is never read
        separate = []
        for slot, leaf in zip(self.slots, leaves):
            if slot is None:
                separate.append(leaf)
            elif slot.size:
                a = np.asarray(leaf)
                buf[slot.offset:slot.offset + slot.size] = (a.view(np.int32) if a.dtype.itemsize == 4
                                                            else a).reshape(-1)
        return buf, separate

    def unpack(self, buf: jax.Array, separate) -> object:
        """The inputs again, inside the step: static slices of `buf` (traced)."""
        rest = iter(separate)
        leaves = []
        for slot in self.slots:
            if slot is None:
                leaves.append(next(rest))
                continue
            x = jax.lax.slice(buf, (slot.offset,), (slot.offset + slot.size,)).reshape(slot.shape)
            if slot.dtype == "bool":
                x = x != 0
            elif slot.dtype != "int32":
                x = jax.lax.bitcast_convert_type(x, jnp.dtype(slot.dtype))
            leaves.append(x)
        return self.treedef.unflatten(leaves)

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.size,), jnp.int32)
