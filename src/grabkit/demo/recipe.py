"""One training run of the demo, written as the recipe a user would copy.

The GraB part is three lines of an ordinary PyTorch loop:

1. ``GraBSampler(train_set, model=model, balance_type=...)`` attaches layer hooks that read each
   example's gradient statistics during ``loss.backward()``;
2. the ``DataLoader`` takes it as its ``sampler``;
3. ``sampler.step()`` after ``loss.backward()`` balances that batch's per-example gradients,
   which decides the order of the next epoch.

Everything else measures the run: the full training loss and test accuracy after each epoch, and
the herding bound of the epoch (max over prefixes of the inf-norm of the centred prefix sums of
the per-example gradients, in visit order), which GraB drives down and random reshuffling does not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from grabkit.demo.digits import DigitsSplit, make_model
from grabkit.order import GraBSampler, herding_bound

__all__ = ["EpochResult", "RunSettings", "train_run"]


@dataclass(frozen=True)
class RunSettings:
    """What every run shares: epochs, batch size, SGD learning rate."""

    epochs: int
    batch_size: int
    lr: float


@dataclass(frozen=True)
class EpochResult:
    """One epoch of one run.

    Attributes:
        train_loss: mean cross-entropy over the whole training set after the epoch.
        test_accuracy: fraction of test images classified correctly after the epoch.
        herding_bound: of the epoch's per-example gradients in visit order.
        seconds: wall time of the epoch's training loop (the herding measurement excluded).
    """

    model: str
    ordering: str
    seed: int
    epoch: int
    train_loss: float
    test_accuracy: float
    herding_bound: float
    seconds: float


def per_example_gradients(sampler: GraBSampler) -> torch.Tensor:
    """(B, d) gradients of the last batch's examples, rebuilt from the sampler's hook statistics.

    ``weighted_sum`` with the (B, B) identity returns one row per example. Only the herding-bound
    column needs them; GraB itself never builds this matrix.
    """
    batch = sampler.stats.gradient_batch()
    identity = torch.eye(batch.size, dtype=batch.dtype, device=batch.device)
    return batch.weighted_sum(identity)


def train_run(
    data: DigitsSplit,
    model_name: str,
    ordering: str,
    seed: int,
    settings: RunSettings,
    on_epoch: Callable[[EpochResult], None] = lambda result: None,
) -> list[EpochResult]:
    """Train one model with one ordering and seed; one ``EpochResult`` per epoch."""
    model = make_model(model_name, seed)
    sampler = GraBSampler(data.train_set, model=model, balance_type=ordering, seed=seed)
    loader = DataLoader(data.train_set, batch_size=settings.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    loss_fn = nn.CrossEntropyLoss()

    results = []
    for epoch in range(1, settings.epochs + 1):
        gradients = []  # this epoch's per-example gradients, in visit order (measurement only)
        measuring = 0.0
        start = time.perf_counter()
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            sampler.step()  # GraB: balance this batch's per-example gradients
            optimizer.step()

            tick = time.perf_counter()
            gradients.append(per_example_gradients(sampler))
            measuring += time.perf_counter() - tick
        seconds = time.perf_counter() - start - measuring

        with torch.no_grad():
            train_loss = loss_fn(model(data.train_inputs), data.train_targets).item()
            predictions = model(data.test_inputs).argmax(dim=1)
            accuracy = (predictions == data.test_targets).float().mean().item()
        result = EpochResult(
            model=model_name,
            ordering=ordering,
            seed=seed,
            epoch=epoch,
            train_loss=train_loss,
            test_accuracy=accuracy,
            herding_bound=herding_bound(torch.cat(gradients)),
            seconds=seconds,
        )
        results.append(result)
        on_epoch(result)
    sampler.stats.close()  # detach the hooks from the model
    return results
