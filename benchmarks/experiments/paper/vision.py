"""MNIST logistic regression and LeNet on CIFAR-10 at the GraB authors' settings.

Orderings (``ORDERINGS``):

* ``rr``: random reshuffling of examples, a fresh permutation each epoch (the authors' loader
  with ``shuffle=True``); a plain loop, no hooks.
* ``mean`` / ``pair``: grabkit's defaults: ``GraBSampler(..., model=model)`` orders single
  examples from exact hook statistics; the first epoch is a random permutation.
* ``mean-units`` / ``pair-units``: the authors' variant: the unit of ordering is a fixed
  micro-batch of ``unit`` consecutive examples (2 on MNIST, 8 on CIFAR-10: the loader's
  ``batch_size`` in their scripts, ``shuffle=False``), balanced on the micro-batch's mean
  gradient, and the first epoch visits the units in dataset order (``random_first_epoch=
  False``). grabkit expresses it with what it has: a dataset of units (``n / unit`` items, each
  a (unit, ...) block of examples) and the functional ``sampler.step(grads)`` with the per-unit
  gradients that ``torch.func.vmap(grad(...))`` returns over the units; the optimizer steps on
  their mean, as the authors' accumulation of ``batch / unit`` micro-batch means does.

One optimizer step per effective batch (64 on MNIST, 16 on CIFAR-10); a shorter last batch is
the mean over its examples, as in the authors' accumulation loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from benchmarks.experiments import data as datasets
from benchmarks.experiments.models import LeNet
from grabkit.order import GraBSampler

ORDERINGS = ("rr", "mean", "pair", "mean-units", "pair-units")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class VisionTask:
    """A classification task at fixed hyperparameters (SGD with momentum and weight decay)."""

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    lr: float
    momentum: float
    weight_decay: float
    batch: int  # examples per optimizer step
    unit: int  # examples per unit of the authors' ordering
    epochs: int
    eval_batch: int = 1024

    def settings(self, synthetic: bool) -> dict[str, Any]:
        return {
            "model": self.description, "optimizer": "SGD", "lr": self.lr,
            "momentum": self.momentum, "weight_decay": self.weight_decay,
            "batch": self.batch, "unit": self.unit, "epochs": self.epochs,
            "synthetic": synthetic,
        }  # fmt: skip


def _mnist_model() -> nn.Module:
    return nn.Linear(784, 10)


TASKS = {
    "mnist": VisionTask(
        "mnist", "Linear(784, 10) on all 60k MNIST images, normalised (0.1307, 0.3081)",
        _mnist_model, lr=0.01, momentum=0.9, weight_decay=1e-4, batch=64, unit=2, epochs=100,
    ),
    "cifar": VisionTask(
        "cifar", "LeNet (conv 6, 16; FC 120, 84, 10; ReLU, max-pool) on all 50k CIFAR-10 "
        "images (JPEG), normalised with ImageNet's mean and std, no augmentation",
        LeNet, lr=1e-3, momentum=0.9, weight_decay=1e-2, batch=16, unit=8, epochs=100,
    ),
}  # fmt: skip


def load_data(task: str, synthetic: bool) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test); ``synthetic``: a tiny random set of the same shapes."""
    if synthetic:
        g = torch.Generator().manual_seed(0)
        shape = (784,) if task == "mnist" else (3, 32, 32)
        x = torch.randn(192, *shape, generator=g)
        y = torch.randint(0, 10, (192,), generator=g)
        return x, y, x[:64], y[:64]
    if task == "mnist":
        return datasets.mnist(60_000, 10_000)
    return datasets.cifar10_full(IMAGENET_MEAN, IMAGENET_STD)


class VisionTrainer:
    """One (task, ordering, seed): the model starts from ``torch.manual_seed(seed)``'s draw, the
    same for every ordering of that seed."""

    def __init__(
        self,
        task: VisionTask,
        ordering: str,
        seed: int,
        tensors: tuple[torch.Tensor, ...],
        device: str = "cpu",
    ) -> None:
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r}; expected one of {ORDERINGS}")
        self.task, self.ordering, self.seed = task, ordering, seed
        self.device = torch.device(device)
        self.x, self.y, self.x_test, self.y_test = (t.to(self.device) for t in tensors)
        torch.manual_seed(seed)
        self.model = task.make_model().to(self.device)  # drawn on the CPU: the same on a GPU
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=task.lr, momentum=task.momentum,
            weight_decay=task.weight_decay,
        )  # fmt: skip
        self.sampler: GraBSampler | None = None
        n = len(self.x)
        if ordering in ("mean", "pair"):
            self.sampler = GraBSampler(
                range(n), model=self.model, balance_type=ordering, seed=seed,
                batch_size=task.batch,
            )  # fmt: skip
        elif ordering.endswith("-units"):
            if n % task.unit:
                raise ValueError(f"{n} examples do not split into units of {task.unit}")
            self.sampler = GraBSampler(
                range(n // task.unit), params=dict(self.model.named_parameters()),
                balance_type=ordering.removesuffix("-units"), seed=seed,
                batch_size=task.batch // task.unit, random_first_epoch=False,
            )  # fmt: skip

    # -- training ------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self.sampler is None:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            return torch.randperm(len(self.x), generator=generator).to(self.device)
        order = list(iter(self.sampler))
        return torch.tensor(order, dtype=torch.int64, device=self.device)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        order = self._epoch_order(epoch)
        if self.ordering.endswith("-units"):
            self._train_units(order)
        else:
            self._train_examples(order)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the epoch's time is the finished work
        return {"lr": self.optimizer.param_groups[0]["lr"]}

    def _train_examples(self, order: torch.Tensor) -> None:
        for start in range(0, len(order), self.task.batch):
            idx = order[start : start + self.task.batch]
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx]).backward()
            if self.sampler is not None:
                self.sampler.step()
            self.optimizer.step()

    def _unit_loss(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(self.model, params, (x,)), y)

    def _train_units(self, order: torch.Tensor) -> None:
        k = self.task.unit
        x_units = self.x.view(len(self.x) // k, k, *self.x.shape[1:])
        y_units = self.y.view(-1, k)
        per_unit = vmap(grad(self._unit_loss), in_dims=(None, 0, 0))
        per_step = self.task.batch // k
        params = dict(self.model.named_parameters())
        for start in range(0, len(order), per_step):
            idx = order[start : start + per_step]
            detached = {name: p.detach() for name, p in params.items()}
            grads = per_unit(detached, x_units[idx], y_units[idx])  # {name: (U, ...)}
            self.sampler.step(grads)
            for name, p in params.items():
                p.grad = grads[name].mean(0)
            self.optimizer.step()

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Full-train loss (mean over all training examples) and test accuracy, eval mode."""
        self.model.eval()
        b = self.task.eval_batch
        with torch.no_grad():
            loss = sum(
                nn.functional.cross_entropy(
                    self.model(self.x[i : i + b]), self.y[i : i + b], reduction="sum"
                ).item()
                for i in range(0, len(self.x), b)
            )
            correct = sum(
                (self.model(self.x_test[i : i + b]).argmax(1) == self.y_test[i : i + b])
                .sum()
                .item()
                for i in range(0, len(self.x_test), b)
            )
        return {"train_loss": loss / len(self.x), "test_metric": 100.0 * correct / len(self.x_test)}

    def after_evaluation(self, metrics: dict[str, float]) -> None:
        """No scheduler: the authors' StepLR(step_size=1, gamma=1) keeps the rate fixed."""

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
            # a state saved at an epoch's end resumes with the rest of that epoch: nothing
            leftover = list(iter(self.sampler))
            if leftover:
                raise ValueError(
                    f"the checkpoint was taken {len(leftover)} examples before its epoch's end; "
                    "this loop saves only at epoch ends, so it is not one of its checkpoints"
                )

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
