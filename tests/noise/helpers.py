"""Exact ground truth for noise-scale tests: an MLP on the digits data, per-example gradients.

Everything is float64. ``Problem.per_example`` holds torch.func per-example gradients of the whole
dataset at fixed parameters, from which |G|^2, tr(Sigma) and B_simple are exact (the data set is
the distribution: Sigma is the population covariance, divided by N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

# a few hundred Monte-Carlo draws: |z| <= 3 fails by chance about once in 370 tests; seeds are
# fixed, so a test either always passes or always fails
Z_LIMIT = 3.0


def make_model(seed: int = 0, hidden: int = 12) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10)).double()


@lru_cache(maxsize=1)
def digits(n: int = 1200) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # here: spawned DDP ranks never need it

    x, y = load_digits(return_X_y=True)
    return (
        torch.as_tensor(x[:n] / 16.0, dtype=torch.float64),
        torch.as_tensor(y[:n], dtype=torch.long),
    )


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, reduction="none")


@dataclass
class Problem:
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    names: tuple[str, ...]
    per_example: torch.Tensor  # (N, d) flat per-example gradients, named_parameters() order
    block_sizes: tuple[int, ...]

    @property
    def n(self) -> int:
        return self.x.shape[0]

    def block_sq(self, vectors: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., P) squared norms per parameter block."""
        parts = torch.split(vectors, self.block_sizes, dim=-1)
        return torch.stack([(p * p).sum(-1) for p in parts], dim=-1)

    def truth(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact per-block (|G|^2, tr Sigma) with Sigma the population covariance."""
        mean = self.per_example.mean(0)
        return self.block_sq(mean), self.block_sq(self.per_example - mean).mean(0)

    def expected_without_replacement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the two-batch estimates average to when batches are drawn without replacement.

        E|G_b|^2 = |G|^2 + tr(Sigma) (N - b) / (b (N - 1)), so the identities return on average
        tr(Sigma) N / (N - 1) and |G|^2 - tr(Sigma) / (N - 1) (finite-population correction).
        """
        g, t = self.truth()
        return g - t / (self.n - 1), t * self.n / (self.n - 1)

    def b_simple(self) -> float:
        g, t = self.truth()
        return float(t.sum() / g.sum())


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        per_example_loss(model, x, y).mean().backward()
        opt.step()


@lru_cache(maxsize=2)
def problem(train_steps: int = 30) -> Problem:
    """Digits MLP after a few full-batch steps (so that B_simple is in the tens), exact grads."""
    x, y = digits()
    model = make_model()
    _train(model, x, y, train_steps)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        out = functional_call(model, p, (xi[None],))
        return nn.functional.cross_entropy(out, yi[None])

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    names = tuple(params)
    flat = torch.cat([grads[k].reshape(x.shape[0], -1) for k in names], dim=1)
    sizes = tuple(params[k].numel() for k in names)
    return Problem(model, x, y, names, flat, sizes)


def linear_losses(
    prob: Problem, index: torch.Tensor, weights: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-example losses l_i = <g_i, w> at w = 0: the gradient of any mean is the mean g_i.

    ``weights`` (one zero vector per block, made when None) are the tensors to differentiate.
    """
    if weights is None:
        weights = {
            name: torch.zeros(size, dtype=torch.float64, requires_grad=True)
            for name, size in zip(prob.names, prob.block_sizes, strict=True)
        }
    rows = torch.split(prob.per_example[index], prob.block_sizes, dim=-1)
    loss = sum(r @ weights[n] for r, n in zip(rows, prob.names, strict=True))
    return loss, weights


def z_score(samples: torch.Tensor, expected: float) -> float:
    """(mean - expected) / standard error of the mean."""
    n = samples.numel()
    se = float(samples.std()) / math.sqrt(n)
    return (float(samples.mean()) - expected) / se
