"""Shared setup for the framework tests.

A torchvision wheel built for another torch variant (e.g. a CUDA torchvision beside a CPU torch)
fails to import with "operator torchvision::nms does not exist", and transformers and Lightning
import torchvision. When (and only when) that is the case, declare the two operator schemas that
torchvision registers fake kernels for at import, so that it imports without its C extension;
nothing here uses torchvision's operators.
"""

import importlib.util

import torch


def _repair_torchvision_import() -> None:
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
        _LIBRARIES.append(library)  # keep the definitions alive
        import sys

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]


_LIBRARIES: list = []
_repair_torchvision_import()
