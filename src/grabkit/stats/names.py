"""Canonical parameter names: a parameter's name in the model with its wrappers looked through.

Wrappers hold the model as a child and so rename every parameter: ``torch.compile``
(``_orig_mod.``), ``DistributedDataParallel`` / ``DataParallel`` (``module.``), FSDP
(``_fsdp_wrapped_module.``) and the activation-checkpoint wrappers
(``_checkpoint_wrapped_module.``), at the root or around any submodule. Whatever is seeded or
recorded by parameter name (the sketch maps of ``grabkit.stats.sketch``) uses the canonical
name, so a model compiled in one run and plain in the next, or wrapped on some ranks only,
draws the same maps.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["canonical_name_of", "canonical_parameter_names", "parameter_layout"]

# children through which a wrapper holds the wrapped module, whatever the wrapper's class: names
# private to torch.compile, FSDP and torch.distributed's checkpoint / offload wrappers
_WRAPPED_CHILDREN = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# "module" is an ordinary attribute name elsewhere: only a data-parallel wrapper's is skipped
_DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def canonical_parameter_names(model: nn.Module) -> dict[str, str]:
    """{name in ``model.named_parameters()``: canonical name}, every wrapper's child dropped.

    Raises ``ValueError`` when two parameters would share a canonical name (a model holding a
    module both wrapped and plain), since they could not be told apart.
    """
    canonical: dict[str, str] = {}
    for name, _ in model.named_parameters():
        canonical[name] = _canonical(model, name)
    seen: dict[str, str] = {}
    for name, short in canonical.items():
        if short in seen:
            raise ValueError(
                f"parameters {seen[short]!r} and {name!r} both read {short!r} with their "
                f"wrappers (torch.compile, DDP, FSDP, checkpoint wrappers) looked through, so "
                f"they cannot be told apart by name; give the modules distinct names."
            )
        seen[short] = name
    return canonical


def parameter_layout(model: nn.Module, shapes: Mapping[str, torch.Size]) -> list[list]:
    """``[[canonical name, [sizes]], ...]`` for the parameters ``shapes`` names (names in
    ``model.named_parameters()``), in its order: plain data that tells whether a flat vector
    over these parameters (a sampler's running sum) can be read against another model's."""
    canonical = canonical_parameter_names(model)
    return [[canonical.get(name, name), list(shape)] for name, shape in shapes.items()]


def canonical_name_of(name: str) -> str:
    """The canonical name read from a parameter's name alone, where no model is at hand (a dict
    of parameters): the wrappers' children dropped, and a leading ``module.`` (a data-parallel
    wrapper's, or an attribute of that name, dropped alike on both sides of a comparison)."""
    parts = [part for part in name.split(".") if part not in _WRAPPED_CHILDREN]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _canonical(model: nn.Module, name: str) -> str:
    *path, leaf = name.split(".")
    kept: list[str] = []
    module = model
    for part in path:
        wrapper = isinstance(module, _DATA_PARALLEL) and part == "module"
        if not wrapper and part not in _WRAPPED_CHILDREN:
            kept.append(part)
        module = module._modules[part]
    return ".".join([*kept, leaf])
