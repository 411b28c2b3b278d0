"""``GraBBatchSampler``: ``GraBSampler`` in batch-sampler form (lists of indices)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from grabkit.order.orderings import Ordering
from grabkit.order.sampler import GraBSampler
from grabkit.order.sources import Gradients, GradientSource, LossScaler
from grabkit.order.state import BATCHING_KEYS
from grabkit.state import setting_differences
from grabkit.validation import check_bool

__all__ = ["GraBBatchSampler"]


class GraBBatchSampler(Sampler[list[int]]):
    """The batch-sampler form: yields lists of ``batch_size`` indices of a ``GraBSampler``.

    Use as ``DataLoader(dataset, batch_sampler=GraBBatchSampler(dataset, params, batch_size=32))``
    (any ``GraBSampler`` form: ``GraBBatchSampler(dataset, ordering, source, batch_size=32)``).
    ``drop_last`` drops the last incomplete batch (its examples are then never stepped and keep
    their place between the front and the back part). Every other keyword goes to
    ``GraBSampler`` (whose replica-level ``drop_last`` stays False); ``step``, ``skip`` (default:
    the current batch), ``set_epoch``, ``update_v``, ``close`` and the state methods delegate to
    it (``.sampler``). Knowing the batch size, hook mode checks that each ``step()`` covers
    whole yielded batches.
    """

    def __init__(
        self,
        data_source: Sized,
        ordering: Ordering | Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None = None,
        source: GradientSource | None = None,
        *,
        batch_size: int,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        self.sampler = GraBSampler(data_source, ordering, source, batch_size=batch_size, **kwargs)
        self.batch_size = self.sampler.batch_size
        self.drop_last = check_bool("drop_last", drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def step(
        self,
        grads: Gradients | None = None,
        *,
        indices: torch.Tensor | Iterable[int] | None = None,
        grad_scale: float | LossScaler = 1.0,
    ) -> None:
        self.sampler.step(grads, indices=indices, grad_scale=grad_scale)

    def skip(self, count: int | None = None) -> None:
        """Skip the current batch (or ``count`` examples): no decision for them this epoch."""
        self.sampler.skip(count)

    def close(self) -> None:
        self.sampler.close()

    def __enter__(self) -> GraBBatchSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def update_v(self, second_moment: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        self.sampler.update_v(second_moment)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state, its configuration extended by this form's ``batch_size`` and
        ``drop_last`` (they decide which examples each batch holds)."""
        state = self.sampler.state_dict()
        state["config"] = {**state["config"], **self._batching()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()`` of this form or of its ``GraBSampler``; a state of this
        form saved with another ``batch_size`` or ``drop_last`` raises (the batches, and the
        decisions of orderings that balance whole batches, would differ from the saved run's)."""
        config = dict(state.get("config", {}))
        saved = {key: config.pop(key) for key in BATCHING_KEYS if key in config}
        mine = self._batching()
        detail = setting_differences(saved, {key: mine[key] for key in saved})
        if detail:
            raise ValueError(
                f"GraBBatchSampler.load_state_dict: the state was saved with other batches "
                f"({detail}); build it with the batch_size and drop_last of the run that was "
                "saved."
            )
        self.sampler.load_state_dict({**state, "config": config})

    def _batching(self) -> dict[str, Any]:
        return {
            "batch_sampler_batch_size": self.batch_size,
            "batch_sampler_drop_last": self.drop_last,
        }
