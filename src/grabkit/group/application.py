"""``DataCollection.apply``: run an annotated module group by group and check what it returns.

The module's annotations bind its length labels to the data's; each group's output is checked
against the output annotation (batch rows, constant sizes, length sizes) so a module that
changes a length without declaring it fails loudly instead of being unpadded wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from grabkit.stats.rows import grouped_run

from .annotation import (
    BATCH,
    CONST,
    LENGTH,
    AnnotationError,
    KeyConversion,
    Signature,
    convert_keys,
    iter_leaves,
    tree_get,
)
from .coupling import warn_if_batch_coupled
from .items import TensorData, length_labels

if TYPE_CHECKING:
    from .collection import DataCollection

__all__ = ["FROM_MODULE", "apply_module"]

FROM_MODULE = object()  # the mask_hint default: ask the module's get_mask_hint()


def _data_label(dc: DataCollection, label: str, binding: Mapping[str, str]) -> str:
    if label in binding:
        return binding[label]
    if label in dc.lengths:
        return label
    raise ValueError(
        f"length label {label!r} is neither a module label bound by the input annotation "
        f"({sorted(binding)}) nor a data label ({sorted(dc.lengths)})"
    )


def _output_lengths(
    dc: DataCollection, out_sigs: Any, derived: Mapping[str, Callable]
) -> dict[str, Tensor]:
    """``{label: (n,) int64}`` of the outputs: the input lengths, or the module's mapping."""
    lengths = dc.lengths
    out: dict[str, Tensor] = {}
    for label in length_labels(out_sigs):
        base = lengths[label]
        if label in derived:
            base = torch.as_tensor(derived[label](base.clone())).to(torch.long).cpu()
            if base.shape != lengths[label].shape or bool((base < 0).any()):
                raise ValueError(
                    f"get_output_lengths()[{label!r}] should map {len(dc)} input lengths to "
                    f"as many non-negative output lengths, but gave {base.tolist()[:8]}..."
                )
        out[label] = base
    return out


def _check_leaf(
    tensor: Any, sig: Signature, where: str, rows: int, limits: Mapping[str, tuple[int, int, bool]]
) -> None:
    """One output tensor of a group against its annotation.

    ``limits[label]``: the group's longest output length, its padded input length, and whether
    the module declared the length as changed (else the output must keep the padded size).
    """
    if not isinstance(tensor, Tensor) or tensor.dim() != len(sig):
        got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise AnnotationError(f"{where}: expected a {len(sig)}-dim tensor {sig}, got {got}")
    for pos, dim in enumerate(sig.dims):
        size = tensor.shape[pos]
        if dim.kind == BATCH and size != rows:
            raise AnnotationError(f"{where}: batch dim has {size} rows for {rows} items")
        if dim.kind == CONST and size != dim.size:
            raise AnnotationError(f"{where}: dim {pos} is {size}, annotated {dim.size}")
        if dim.kind != LENGTH:
            continue
        need, padded, derived = limits[dim.label]
        if size < need or (not derived and size != padded):
            raise AnnotationError(
                f"{where}: size {size} along L_{dim.label}, but the group is padded "
                f"to {padded}; a module that changes a length should define "
                "get_output_lengths() returning {label: fn(input_lengths)}"
            )


def check_output(
    dc: DataCollection,
    out: Any,
    sigs: Any,
    i: int,
    lengths: Mapping[str, Tensor],
    derived: Mapping[str, Callable],
) -> None:
    """Group ``i``'s output ``out`` against the output signatures ``sigs``.

    ``lengths``: every item's output lengths; ``derived``: the labels the module changes.
    """
    idx = dc.partition[i]
    inputs = dc.lengths

    def group_max(values: Tensor) -> int:
        return int(values[idx].max()) if len(idx) else 0

    limits = {
        label: (group_max(values), group_max(inputs[label]), label in derived)
        for label, values in lengths.items()
    }
    for path, sig in iter_leaves(sigs):
        where = f"group {i} output {'/'.join(path) or '(root)'}"
        try:
            tensor = tree_get(out, path)
        except (KeyError, TypeError, IndexError) as error:
            raise AnnotationError(f"{where}: missing, but the output annotation has it") from error
        _check_leaf(tensor, sig, where, len(idx), limits)


def apply_module(
    dc: DataCollection,
    module: nn.Module,
    mask_hint: Any = FROM_MODULE,
    input_key_conv: KeyConversion | None = None,
    output_key_conv: KeyConversion | None = None,
) -> tuple[Any, list[TensorData], dict[str, Tensor]]:
    """Run ``module`` on every group of ``dc``: output signatures, group outputs, lengths."""
    if not callable(getattr(module, "get_input_annot", None)):
        raise TypeError(
            f"apply() needs an AnnotatedModule (with get_input_annot/get_output_annot), got "
            f"{type(module).__name__}; for a plain nn.Module use grabkit.group.run_grouped"
        )
    out_sigs, binding = module.resolve(convert_keys(dc.shapesig_data, input_key_conv))
    hint = module.get_mask_hint() if mask_hint is FROM_MODULE else mask_hint
    if isinstance(hint, Sequence) and not isinstance(hint, str):
        hint = [_data_label(dc, label, binding) for label in hint]
    derived = {
        _data_label(dc, label, binding): fn
        for label, fn in (getattr(module, "get_output_lengths", dict)() or {}).items()
    }
    warn_if_batch_coupled(module, len(dc.data_groups))
    new_lengths = _output_lengths(dc, out_sigs, derived)
    out_sigs = convert_keys(out_sigs, output_key_conv)
    outputs = []
    with grouped_run(len(dc)) as run:  # grabkit.stats learns which items each call holds
        for i, group in enumerate(dc.data_groups):
            value = convert_keys(group.value, input_key_conv)
            with run.group(dc.partition[i]):
                if hint is None:
                    out = module(value)
                else:
                    out = module(value, dc.get_mask(i, key_conv=input_key_conv, mask_hint=hint))
            out = convert_keys(out, output_key_conv)
            check_output(dc, out, out_sigs, i, new_lengths, derived)
            outputs.append(TensorData(out))
    return out_sigs, outputs, new_lengths
