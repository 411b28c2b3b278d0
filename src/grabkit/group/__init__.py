"""grabkit.group: run variable-length batches group by group, padded per group, in order.

A minibatch padded to its longest item wastes most of its compute when lengths vary widely.
This package keeps the minibatch (SGD semantics unchanged), splits it into length groups,
pads each group only to its own longest item, runs the module once per group and puts the
outputs back in the original order.

* asym-compatible API: :class:`DataCollection`, :class:`AnnotatedModule`, the groupers
  (:class:`UniGrouper`, :class:`PredefinedGrouper`, :class:`PredefinedConsecutiveGrouper`,
  :class:`LengthThresholdGrouper`), :func:`find_thresholds`, :class:`CDimPadder`.
* Plain modules: :func:`run_grouped`, :func:`group_batch` / :class:`GroupedBatch`,
  :class:`GroupingCollate` (a ``collate_fn``), :func:`backward_by_group`.
* Planning: :func:`plan_groups` (exact per-batch DP), :class:`DynamicGrouper`,
  :func:`calibrate_cost`.
"""

from .annotation import AnnotationError
from .calibration import CostModel, calibrate_cost
from .collate import GroupingCollate
from .collection import DataCollection, IncompatibleDataCollectionError, TensorData
from .grouped import GroupedBatch, backward_by_group, group_batch, infer_output_lengths, run_grouped
from .groupers import (
    DynamicGrouper,
    Grouper,
    LengthThresholdGrouper,
    PredefinedConsecutiveGrouper,
    PredefinedGrouper,
    UniGrouper,
)
from .module import AnnotatedModule
from .planning import GroupPlan, plan_cost, plan_from_partition, plan_groups
from .plumbing import CDimPadder, ConstantPadder, Padder, ZeroPadder, length_mask
from .thresholds import find_thresholds

__all__ = [
    "AnnotatedModule",
    "AnnotationError",
    "CDimPadder",
    "ConstantPadder",
    "CostModel",
    "DataCollection",
    "DynamicGrouper",
    "GroupPlan",
    "GroupedBatch",
    "Grouper",
    "GroupingCollate",
    "IncompatibleDataCollectionError",
    "LengthThresholdGrouper",
    "Padder",
    "PredefinedConsecutiveGrouper",
    "PredefinedGrouper",
    "TensorData",
    "UniGrouper",
    "ZeroPadder",
    "backward_by_group",
    "calibrate_cost",
    "find_thresholds",
    "group_batch",
    "infer_output_lengths",
    "length_mask",
    "plan_cost",
    "plan_from_partition",
    "plan_groups",
    "run_grouped",
]
