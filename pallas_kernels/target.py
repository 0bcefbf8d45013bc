"""Which GPU a kernel is being compiled for: the device's, or, lowering for CUDA on a
machine without one, the device kind of the abstract mesh it lowers under
(pallas_kernels.cuda_lowering.cuda_target)."""

from __future__ import annotations

import jax

# Compute capability 9.x: wgmma is Hopper's (Blackwell multiplies by tcgen05 instead).
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def _abstract_gpu():
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device if device is not None and device.platform == "gpu" else None


def targets_gpu() -> bool:
    """Whether the kernels compile for a GPU (else they run in an interpreter)."""
    return _abstract_gpu() is not None or jax.default_backend() == "gpu"


def targets_hopper() -> bool:
    """Whether the GPU compiled for is a Hopper (compute capability 9.x)."""
    device = _abstract_gpu()
    if device is not None:
        return any(kind in device.device_kind for kind in HOPPER_KINDS)
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "0")).startswith("9.")
