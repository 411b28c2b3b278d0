"""Lightning callbacks the resume tests share: a checkpoint at any batch, the estimates per step."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L

from grabkit.integrations.lightning import NoiseScaleCallback


class SaveAfterBatch(L.Callback):
    """``trainer.save_checkpoint`` after the ``at``-th batch of the run (0-based): mid-window."""

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop.total_batch_idx == self.at:
            trainer.save_checkpoint(self.path)


class Estimates(L.Callback):
    """The noise callback's estimate after every optimizer step (it runs first)."""

    def __init__(self) -> None:
        self.values: list[tuple | None] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        noise = next(c for c in trainer.callbacks if isinstance(c, NoiseScaleCallback))
        self.values.append(triple(noise.result))


def triple(result) -> tuple | None:
    if result is None:
        return None
    return result.grad_norm_sq, result.trace_sigma, result.observations
