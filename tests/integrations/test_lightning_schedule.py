"""``AdaptiveAccumulationCallback`` and a step-interval LR scheduler with ``frequency`` > 1.

Lightning calls such a scheduler every ``frequency`` batches (microbatches, under the wrapper);
the callback counts the schedule in real updates, so it must advance once every ``frequency``
real updates, whatever the wrapper's windows. Reference: the hand loop that steps the scheduler
after every ``frequency``-th update; the parameters must be bitwise the same.
"""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from tests.integrations.lightning_hooks import classified_rows, small_classifier  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from grabkit import OptimizerWrapperGNTS  # noqa: E402
from grabkit.integrations.lightning import AdaptiveAccumulationCallback  # noqa: E402

pytestmark = pytest.mark.slow

N, BATCH = 48, 4


def _decay(step: int) -> float:
    return 1.0 / (1 + step)


def _wrapper(parameters, window: int) -> OptimizerWrapperGNTS:
    """Steps after every ``window`` microbatches (a threshold never met, ``window`` draws)."""
    return OptimizerWrapperGNTS(torch.optim.SGD(parameters, lr=0.5), window, norm_threshold=0.0)


class Scheduled(L.LightningModule):
    def __init__(self, frequency: int, window: int) -> None:
        super().__init__()
        self.net = small_classifier(8)
        self.frequency, self.window = frequency, window

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        wrapper = _wrapper(self.parameters(), self.window)
        decay = torch.optim.lr_scheduler.LambdaLR(wrapper, _decay)
        schedule = {"scheduler": decay, "interval": "step", "frequency": self.frequency}
        return {"optimizer": wrapper, "lr_scheduler": schedule}


def _hand_loop(frequency: int, window: int) -> tuple[dict[str, torch.Tensor], int]:
    net = small_classifier(8)
    x, y, _ = classified_rows(N)
    wrapper = _wrapper(net.parameters(), window)
    decay = torch.optim.lr_scheduler.LambdaLR(wrapper, _decay)
    for _epoch in range(2):
        for start in range(0, N, BATCH):
            part = slice(start, start + BATCH)
            torch.nn.functional.cross_entropy(net(x[part]), y[part]).backward()
            if wrapper.step(count=BATCH) and wrapper.num_steps % frequency == 0:
                decay.step()
            wrapper.zero_grad()
    wrapper.flush()
    return dict(net.state_dict()), decay.last_epoch


@pytest.mark.parametrize(("frequency", "window"), [(1, 2), (2, 2), (2, 1), (3, 2), (2, 3)])
def test_the_schedule_advances_every_frequency_real_updates(tmp_path, frequency, window):
    module = Scheduled(frequency, window)
    x, y, _ = classified_rows(N)
    fit = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(tmp_path), callbacks=[AdaptiveAccumulationCallback()],
    )  # fmt: skip
    fit.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    want, advanced = _hand_loop(frequency, window)
    assert fit.lr_scheduler_configs[0].scheduler.last_epoch == advanced
    for (name, value), expected in zip(module.net.state_dict().items(), want.values(), strict=True):
        assert torch.equal(value, expected), name
