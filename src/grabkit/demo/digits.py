"""The demo's data and models: scikit-learn's bundled digits (no download) and two small nets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from grabkit.demo.deps import require

__all__ = ["MODELS", "DigitsSplit", "load_digits_split", "make_model"]

# fraction of the 1,797 images used for training; the rest is the test set
TRAIN_FRACTION = 0.8
NUM_PIXELS = 64  # 8 x 8 grey levels 0..16
NUM_CLASSES = 10
HIDDEN = 64


@dataclass
class DigitsSplit:
    """A fixed train/test split of the digits, pixels scaled to [0, 1].

    Attributes:
        train_set: ``TensorDataset`` of (64,) float32 images and int64 labels.
        train_inputs / train_targets: the same tensors, for the full-batch training loss.
        test_inputs / test_targets: (m, 64) and (m,).
    """

    train_set: TensorDataset
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    test_inputs: torch.Tensor
    test_targets: torch.Tensor


def load_digits_split(split_seed: int = 0) -> DigitsSplit:
    """Load ``sklearn.datasets.load_digits`` and split it 80/20 with a fixed seed."""
    datasets = require("sklearn.datasets", "scikit-learn")
    images, labels = datasets.load_digits(return_X_y=True)
    inputs = torch.as_tensor(images, dtype=torch.float32) / 16.0
    targets = torch.as_tensor(labels, dtype=torch.int64)
    permutation = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(split_seed))
    cut = int(TRAIN_FRACTION * len(inputs))
    train, test = permutation[:cut], permutation[cut:]
    return DigitsSplit(
        train_set=TensorDataset(inputs[train], targets[train]),
        train_inputs=inputs[train],
        train_targets=targets[train],
        test_inputs=inputs[test],
        test_targets=targets[test],
    )


def _logistic_regression() -> nn.Module:
    return nn.Linear(NUM_PIXELS, NUM_CLASSES)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_PIXELS, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, NUM_CLASSES))


#: model name -> (description, constructor)
MODELS = {
    "logreg": ("logistic regression, 64 -> 10", _logistic_regression),
    "mlp": (f"MLP 64 -> {HIDDEN} (tanh) -> 10", _mlp),
}


def make_model(name: str, seed: int) -> nn.Module:
    """A freshly initialised model; the same ``seed`` gives the same weights for every ordering."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        return MODELS[name][1]()
