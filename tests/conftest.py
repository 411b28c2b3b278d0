"""Shared fixtures: the location of the real datasets (tests that use them skip when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ``../shared/data``; skips the test when the folder is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA


# -- framework tests (tests/integrations, README integration examples) --------------------------
def _repair_torchvision_import() -> None:
    """Let transformers and Lightning import torchvision when its C extension cannot load.

    A torchvision wheel built for another torch variant (a CUDA torchvision beside a CPU torch)
    fails at import with "operator torchvision::nms does not exist". Only then, declare the two
    operator schemas torchvision registers fake kernels for at import; nothing in the tests uses
    torchvision's operators.
    """
    import importlib.util
    import sys

    import torch

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError as error:
        if "torchvision::nms" not in str(error):
            raise
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION_SCHEMAS.append(library)  # keep the definitions alive
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]


_TORCHVISION_SCHEMAS: list = []
_repair_torchvision_import()
