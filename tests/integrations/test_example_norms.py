"""Per-example gradient-norm logging as a callback in a Hugging Face Trainer and in Lightning,
against per-example ``torch.autograd.grad`` norms, and bitwise harmless to training."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

from tests.integrations.test_huggingface import arguments  # noqa: E402
from tests.integrations.test_lightning import Module, trainer  # noqa: E402
from tests.integrations.tiny import B, batch, dataset, params, tiny_bert  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import Trainer  # noqa: E402

from grabkit.integrations.huggingface import ExampleGradientNormsCallback, GrabkitTrainer  # noqa: E402
from grabkit.integrations.lightning import ExampleGradientNormsCallback as NormsCallback  # noqa: E402
from grabkit.integrations.lightning import GraBCallback  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow
QUANTILES = {"min": 0.0, "q10": 0.1, "median": 0.5, "q90": 0.9, "max": 1.0}


def reference_norms(rows) -> torch.Tensor:
    """|grad of example i's own loss| for the initial tiny BERT, one example at a time."""
    model, data = tiny_bert(), dataset()
    norms = []
    for i in rows:
        grads = torch.autograd.grad(model(**batch(data, [i])).loss, list(model.parameters()))
        norms.append(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    return torch.stack(norms)


def _check(logged: dict, norms: torch.Tensor) -> None:
    for name, q in QUANTILES.items():
        expected = float(torch.quantile(norms, q))
        assert logged[f"grad_norm_per_example/{name}"] == pytest.approx(expected, rel=1e-4), name
    assert logged["grad_norm_per_example/count"] == len(norms)


@pytest.mark.parametrize("cls", [GrabkitTrainer, Trainer])
def test_trainer_logs_the_first_steps_norms_and_trains_bitwise_the_same(tmp_path, cls):
    """Logged at every step: the first covers the first window, 2 microbatches of B (BERT's
    Trainer loss is each microbatch's mean, so a norm is |grad loss_i|)."""

    def run(root, callbacks):
        args = arguments(root, train_sampling_strategy="sequential", num_train_epochs=1)
        fit = cls(tiny_bert(), args, train_dataset=dataset(), callbacks=callbacks)
        fit.train()
        return fit

    plain = run(tmp_path / "plain", [])
    measured = run(tmp_path / "norms", [ExampleGradientNormsCallback()])
    for name, value in params(measured.model).items():
        assert torch.equal(value, params(plain.model)[name]), name
    logged = [e for e in measured.state.log_history if "grad_norm_per_example/median" in e]
    assert len(logged) == 3  # every optimizer step of the epoch
    _check(logged[0], reference_norms(range(2 * B)))


def test_lightning_logs_each_steps_norms_and_shares_grab_hooks(tmp_path):
    """lr=0, so every step's norms are the initial model's; the GraB sampler's statistics on
    the model serve both callbacks (one set of hooks)."""

    class Frozen(Module):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    module, data = Frozen(), dataset()
    sampler = GraBSampler(data, model=module.net, seed=0, record_orders=True)
    norms = NormsCallback(module=module.net)
    fit = trainer(tmp_path, [GraBCallback(sampler), norms], max_epochs=1)
    fit.fit(module, DataLoader(data, sampler=sampler, batch_size=B))
    last_window = sampler.orders_history[0][-2 * B :]  # the epoch's last step, in visit order
    _check(norms.last, reference_norms(last_window))
    assert float(fit.callback_metrics["grad_norm_per_example/max"]) == pytest.approx(
        norms.last["grad_norm_per_example/max"]
    )
    assert sampler.state_dict()["live"]["stepped"] == len(data)  # GraB still saw everything
