"""The demo's optional dependencies, imported only when the demo runs.

``pip install "grabkit[demo]"`` installs them; grabkit itself needs only torch and numpy.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDemoDependency", "require"]

INSTALL_HINT = 'pip install "grabkit[demo]"'


class MissingDemoDependency(ImportError):
    """A package the demo needs (scikit-learn, matplotlib, tqdm) is not installed."""


def require(module: str, package: str) -> ModuleType:
    """Import ``module`` or raise ``MissingDemoDependency`` naming ``package`` and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingDemoDependency(
            f"the grabkit demo needs {package}, which is not installed ({error}); "
            f"install the demo extras with: {INSTALL_HINT}"
        ) from error
