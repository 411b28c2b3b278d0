"""Stateful objects driven through a fixed run, for resume tests across processes.

Each case is a name -> ``Case``: ``make()`` builds the object afresh, ``run(obj, start, stop)``
feeds it events ``start..stop-1`` of one fixed, seeded event list and returns what it produced
(plain values: orders, estimates). A run split at any event, with ``state_dict()`` saved by
``torch.save`` and loaded with ``torch.load(weights_only=True)`` into a fresh object, must
produce exactly what the uninterrupted run produces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grabkit import GraBBatchSampler, GraBSampler
from grabkit.noise import GradientNoiseScaleEstimator, MicrobatchNoiseScale, PerExampleNoiseScale

N, BATCH, EPOCHS = 13, 4, 3  # 4 batches an epoch, the last one short


@dataclass(frozen=True)
class Case:
    make: Callable[[], Any]
    run: Callable[[Any, int, int], list]
    events: int


def _gradients() -> torch.Tensor:
    return torch.randn(N, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _sampler_run(batch_form: bool) -> Callable[[Any, int, int], list]:
    """Events are the batches of EPOCHS epochs; each is yielded, then stepped."""
    X = _gradients()

    def run(sampler: Any, start: int, stop: int) -> list:
        seen: list = []
        event = start
        while event < stop:
            iterator = iter(sampler)
            while event < stop:
                if batch_form:
                    batch = next(iterator, None)
                else:
                    batch = [i for _, i in zip(range(BATCH), iterator, strict=False)]
                if not batch:
                    break
                sampler.step(X[batch])
                seen.append(list(batch))
                event += 1
        return seen

    return run


def _microbatch_run(estimator: MicrobatchNoiseScale, start: int, stop: int) -> list:
    """Events: three microbatches then the step's close, repeated (a checkpoint may fall
    between microbatches)."""
    g = torch.Generator().manual_seed(7)
    norms = torch.rand(40, generator=g, dtype=torch.float64) + 0.5
    out = []
    for event in range(start, stop):
        if event % 4 == 3:
            result = estimator.observe_step(float(norms[event]) * 0.3)
            out.append(None if result is None else result.b_simple)
        else:
            estimator.observe_microbatch(float(norms[event]), count=8 + event % 3)
    return out


def _per_example_run(estimator: PerExampleNoiseScale, start: int, stop: int) -> list:
    g = torch.Generator().manual_seed(8)
    norms = torch.rand(12, 16, generator=g, dtype=torch.float64) + 0.1
    return [estimator.observe(norms[e], float(norms[e].mean()) * 0.2).b_simple
            for e in range(start, stop)]  # fmt: skip


def _alf_run(estimator: GradientNoiseScaleEstimator, start: int, stop: int) -> list:
    out = []
    for event in range(start, stop):
        torch.manual_seed(event)  # the estimator's random split of the batch
        g = torch.Generator().manual_seed(100 + event)
        w = torch.randn(5, requires_grad=True, generator=g, dtype=torch.float64)
        x = torch.randn(8, 5, generator=g, dtype=torch.float64)
        loss = (x @ w - 1.0) ** 2  # (B,) per-example losses, as ALF takes them
        out.append(float(estimator(loss, [w])))
    return out


def cases() -> dict[str, Case]:
    grab = {"seed": 5}
    sampler_events = EPOCHS * 4
    table = {
        f"sampler-{kind}": Case(
            lambda kind=kind: GraBSampler(
                range(N), balance_type=kind, **grab, **({"depth": 2} if kind == "recursive" else {})
            ),
            _sampler_run(batch_form=False),
            sampler_events,
        )
        for kind in ("mean", "pair", "recursive")
    }
    table["batch-sampler-pair"] = Case(
        lambda: GraBBatchSampler(range(N), batch_size=BATCH, balance_type="pair", **grab),
        _sampler_run(batch_form=True),
        sampler_events,
    )
    table["microbatch-noise"] = Case(
        lambda: MicrobatchNoiseScale(update_rate=0.3), _microbatch_run, 40
    )
    table["per-example-noise"] = Case(
        lambda: PerExampleNoiseScale(update_rate=0.3), _per_example_run, 12
    )
    table["alf-noise"] = Case(lambda: GradientNoiseScaleEstimator(update_rate=0.3), _alf_run, 10)
    return table
