"""A warning for modules whose result depends on how the batch is split.

Grouping is exact only for modules that treat items independently. A training-mode BatchNorm
normalises with statistics of whatever rows it is given, so run group by group it sees each
group's statistics instead of the batch's: warn (once per module) rather than differ silently.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

__all__ = ["warn_if_batch_coupled"]

_BATCH_COUPLED: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def warn_if_batch_coupled(module: nn.Module, groups: int) -> None:
    """Warn (once per module) when a training-mode BatchNorm would see per-group statistics."""
    if groups <= 1 or not isinstance(module, nn.Module) or module in _warned:
        return
    coupled = [
        name for name, m in module.named_modules() if isinstance(m, _BATCH_COUPLED) and m.training
    ]
    if coupled:
        _warned.add(module)
        warnings.warn(
            f"{type(module).__name__} has batch-coupled layers in training mode ({coupled[:3]}); "
            f"run in {groups} groups they normalise each group with its own statistics, so "
            "results differ from the padded batch. Use LayerNorm/GroupNorm, eval mode, or "
            "UniGrouper for these layers.",
            stacklevel=3,
        )
