"""A count of the parameters and submodules registered on any module since import.

An engine attached to a model must follow the model when its parameters or layers are replaced
or added after attaching (``model.head = nn.Linear(...)``, ``layer.weight = nn.Parameter(...)``,
``load_state_dict(..., assign=True)``, ``model.append(...)``): the hooks sit on the old objects,
and a new parameter would receive gradients no statistic describes. PyTorch calls its global
registration hooks on every such assignment (``Module.__setattr__``, ``register_parameter``,
``add_module``); counting them costs nothing per step, and an engine re-reads the model's
parameters only at the first forward after the count moved (most often once, after the models
of a run are built). An assignment into ``module._parameters`` itself bypasses the hooks and is
not seen.
"""

from __future__ import annotations

from typing import Any

from torch.nn.modules import module as _module

__all__ = ["registrations"]

_count = [0]


def _registered(*_: Any) -> None:
    """Global registration hook: count, change nothing (None keeps the registered object)."""
    _count[0] += 1


_module.register_module_parameter_registration_hook(_registered)
_module.register_module_module_registration_hook(_registered)


def registrations() -> int:
    """How many parameters and submodules were registered on any module so far."""
    return _count[0]
