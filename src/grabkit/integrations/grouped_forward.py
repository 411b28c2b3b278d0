"""Group a padded transformers batch by length inside the model: the frameworks' grouping.

A right-padded batch (``attention_mask`` rows of ones then zeros) mostly computes padding when
lengths vary. :class:`GroupedForward` replaces the forward of a transformers model's *base*
(``model.base_model``: the transformer body, e.g. ``GPT2Model``, ``BertModel``, ``LlamaModel``)
by one that plans length groups with :func:`grabkit.group.plan_groups` from the attention mask,
runs the body once per group on the rows of the group narrowed to the group's longest row, and
scatters the outputs back into the padded ``(n, T, ...)`` layout (zeros at padded positions).
The head and the loss then run on the merged outputs exactly as in the padded run, so the loss,
whatever it averages (tokens through ``num_items_in_batch``, examples), is the padded run's up
to float rounding, and so are the gradients. Nothing else changes: the batches, the sampler,
the collator.

Exact when every row only sees its own real positions (attention masked by ``attention_mask``,
positions counted from the left: right padding) and the loss ignores padded positions (labels
-100 there, as ``DataCollatorForLanguageModeling`` and ``DataCollatorWithPadding`` make them).
Refused: left padding (a row's positions would shift), 4-D attention masks, outputs without a
batch dim 0 (a key/value cache: grouping runs with ``use_cache=False``), attention maps.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from grabkit.group import GroupPlan, plan_groups
from grabkit.group.plumbing import merge_groups
from grabkit.stats.rows import grouped_run

__all__ = ["GroupedForward", "check_padded_labels", "right_padded_lengths"]


def right_padded_lengths(mask: Tensor) -> Tensor:
    """(n,) lengths of a right-padded (n, T) attention mask; raise for any other padding."""
    lengths = mask.sum(1).to(torch.int64)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if not torch.equal(prefix, mask.bool()):
        raise ValueError(
            "grouping needs right-padded batches (attention_mask rows of ones, then zeros): with "
            "left padding or holes, a group narrowed to its longest row would drop real tokens "
            "and shift positions. Pad on the right (tokenizer.padding_side = 'right')."
        )
    return lengths


def check_padded_labels(labels: Any, mask: Any) -> None:
    """Raise when per-token labels train on padded positions (grouping leaves those outputs zero,
    the padded run leaves them arbitrary; the loss must not read them)."""
    if not (isinstance(labels, Tensor) and isinstance(mask, Tensor)):
        return
    if labels.shape == mask.shape and bool((labels[~mask.bool()] != -100).any()):
        raise ValueError(
            "grouping: some labels at padded positions (attention_mask 0) are not -100, so the "
            "loss reads outputs at padding, which a grouped run does not compute; set labels to "
            "-100 at padding (DataCollatorForLanguageModeling does), or train without grouping."
        )


def _slice(value: Any, rows: Tensor, length: int, n: int, T: int) -> Any:
    """A keyword argument narrowed to one group: rows ``rows``, positions ``:length``."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if value.dim() > 2 and value.shape[0] == n and value.shape[1] == T and value.dim() == 4:
        raise ValueError("grouping: 4-D attention masks are not supported; pass a 2-D mask")
    if value.shape[0] == n:
        value = value.index_select(0, rows.to(value.device))
    elif value.shape[0] != 1:
        return value
    if value.dim() >= 2 and value.shape[1] == T:
        value = value[:, :length]
    return value


def _merge(parts: list[Any], plan: GroupPlan, n: int, T: int) -> Any:
    """Group outputs (batch dim 0) back in the batch's row order; a sequence output ((n_g, L_g,
    ...) hidden states) zero-padded to T."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        sequence = first.dim() >= 3 and all(  # (n_g, L_g, ...): hidden states
            p.shape[1] == min(int(sizes[0]), T)
            for p, sizes in zip(parts, plan.lengths, strict=True)
        )
        if sequence and first.shape[1] < T:
            pad = [0, 0] * (first.dim() - 2) + [0, T - first.shape[1]]
            parts[0] = torch.nn.functional.pad(first, pad)
        return merge_groups(parts, plan.inverse_order, 0, (1,) if sequence else ())
    if isinstance(first, tuple):
        return tuple(_merge([p[i] for p in parts], plan, n, T) for i in range(len(first)))
    raise ValueError(
        f"grouping cannot merge a {type(first).__name__} output of the model's base; run it "
        "with use_cache=False and without output_attentions"
    )


class GroupedForward:
    """Run ``model.base_model`` group by group on right-padded batches (see the module doc).

    Args:
        model: a transformers model (its ``base_model`` is grouped) or the base itself.
        **planning: :func:`grabkit.group.plan_groups` keywords (``cost``, ``alpha``,
            ``overhead``, ``max_group_cost``, ``length_buckets``).

    ``attach()`` installs the grouped forward (an instance attribute over the class's), and
    ``detach()`` removes it; ``with GroupedForward(model):`` does both. A batch without an
    ``attention_mask`` (no padding) or whose rows all have one length runs as it is.
    """

    def __init__(self, model: nn.Module, **planning: Any) -> None:
        if "size_buckets" in planning:
            raise ValueError("GroupedForward runs each group at its own size; drop size_buckets")
        plan_groups([1], **planning)  # options checked now
        self.base: nn.Module = getattr(model, "base_model", model)
        self.planning = planning
        self._signature = inspect.signature(self.base.forward)
        self.groups_run = 0  # group calls so far (a batch of one length counts one)

    def attach(self) -> GroupedForward:
        if "forward" not in vars(self.base):
            self.base.forward = self._forward
        return self

    def detach(self) -> None:
        if vars(self.base).get("forward") == self._forward:
            del self.base.forward

    def __enter__(self) -> GroupedForward:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        original = type(self.base).forward.__get__(self.base)
        arguments = dict(self._signature.bind(*args, **kwargs).arguments)
        arguments.update(arguments.pop("kwargs", None) or {})
        mask = arguments.get("attention_mask")
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            self.groups_run += 1
            return original(**arguments)
        lengths = right_padded_lengths(mask)
        n, T = mask.shape
        plan = plan_groups(lengths.cpu(), **self.planning)
        if len(plan) == 1 and plan.lengths[0][0] >= T:
            self.groups_run += 1
            return original(**arguments)
        if "use_cache" in self._signature.parameters:
            arguments["use_cache"] = False
        parts = []
        with grouped_run(n) as run:  # grabkit.stats learns which rows each group holds
            for rows, sizes in zip(plan.groups, plan.lengths, strict=True):
                length = min(int(sizes[0]), T)
                group = {k: _slice(v, rows, length, n, T) for k, v in arguments.items()}
                tensors = [v for v in group.values() if isinstance(v, Tensor) and v.dim()]
                with run.group(rows, len(rows), [t for t in tensors if t.shape[0] == len(rows)]):
                    parts.append(original(**group))
        self.groups_run += len(parts)
        return _merge_outputs(parts, plan, n, T)


def _merge_outputs(parts: list[Any], plan: GroupPlan, n: int, T: int) -> Any:
    """Merge the base's outputs: a ``ModelOutput`` (dict-like), a tuple or a tensor."""
    first = parts[0]
    if isinstance(first, Mapping):
        merged = {key: _merge([p[key] for p in parts], plan, n, T) for key in first}
        return type(first)(**merged)
    return _merge(parts, plan, n, T)
