"""The moves between host and device on the hot path, in one place.

A balancing step reads its inner products from the device once (``to_host``: the one host
synchronisation of a step) and sends its decisions back (``to_device``: from pinned memory and
without waiting, so sending never stalls the host). Keeping both here marks every point where
the host and the device meet, and lets a test count them.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["NUMPY_DTYPES", "host_values", "to_device", "to_host"]

#: the numpy dtype a torch floating-point dtype reads into (bfloat16 has none: it reads widened)
NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values on the host, as a numpy array: waits for the device (a host sync)
    when the tensor lives there."""
    return tensor.cpu().numpy()


def host_values(tensor: torch.Tensor) -> np.ndarray:
    """The values of a tensor the host made (no sync: it is not on a device)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"host_values() reads host tensors, but got one on {tensor.device}")
    return tensor.numpy()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. To a CUDA device the copy goes from pinned memory and does
    not block the host: the device runs it in order, before any kernel that reads the result
    (a plain ``.to(device)`` from pageable memory waits for the device: a hidden host sync).
    A tensor already on a device is moved as ``.to`` would."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
