"""One epoch-end rule for every framework: a checkpoint taken at an epoch's last optimizer step
resumes with the next epoch, through each framework's documented resume recipe.

A sampler state is a position inside an epoch (``StatefulDataLoader`` restores it that way: a
snapshot taken at the epoch's last batch resumes with an empty pass, as torchdata's own samplers
do; ``tests/order/test_guarantees.py``). The integrations take their states at optimizer steps,
where an epoch whose every example was stepped is over: the framework's next ``iter()`` starts the
next epoch, as the framework itself does.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from tests.integrations.test_huggingface import arguments  # noqa: E402
from tests.integrations.tiny import B, N, dataset, params, tiny_bert  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from grabkit.integrations.accelerate import SamplerCheckpoint  # noqa: E402
from grabkit.integrations.huggingface import GrabkitTrainer  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow


def grab_trainer_run(tmp_path, resume=None, **overrides) -> GrabkitTrainer:
    """A tiny BERT trained by ``GrabkitTrainer(grab=...)`` (orders recorded), resumed from the
    checkpoint folder ``resume`` when given."""
    trainer = GrabkitTrainer(
        tiny_bert(), arguments(tmp_path, **overrides), train_dataset=dataset(),
        grab={"record_orders": True},
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_trainer_resumed_from_an_epoch_end_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """save_strategy="epoch": 3 updates an epoch, checkpoint-3 is epoch 0's last step."""
    options = {"save_strategy": "epoch", "num_train_epochs": 3}
    full = grab_trainer_run(tmp_path, **options)
    resumed = grab_trainer_run(tmp_path, str(tmp_path / "checkpoint-3"), **options)
    assert resumed.state.global_step == full.state.global_step == 9
    assert resumed.grab_sampler.orders_history == full.grab_sampler.orders_history
    for name, value in params(resumed.model).items():
        assert torch.equal(value, params(full.model)[name]), name


@pytest.fixture
def fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerate_run(
    root, *, stop_after=None, resume=None, epochs=3, batch_size=B, drop_last=False,
    number_by="loader", **sampler_options,
):  # fmt: skip
    """accelerate's checkpointing recipe: ``save_state`` to ``step_<n>``; on resume
    ``load_state``, then the epoch loop from ``n // len(loader)`` (saved epoch + 1 at an epoch
    end), with no ``skip_first_batches`` (``SamplerCheckpoint`` resumes the rest of an epoch)."""
    accelerator = Accelerator(cpu=True, project_dir=str(root))
    model, data = tiny_bert(), dataset()
    sampler = GraBSampler(data, model=model, seed=0, record_orders=True, **sampler_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, sampler=sampler, batch_size=batch_size, drop_last=drop_last)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(SamplerCheckpoint(sampler))
    updates, trained, first_epoch = 0, 0, 0
    if resume is not None:
        accelerator.load_state(str(root / f"step_{resume}"))
        updates, first_epoch = resume, resume // len(loader)
    for epoch in range(first_epoch, epochs):
        # the prepared loader's count, with which accelerate renumbers the sampler at iter()
        if number_by != "none":  # "none": accelerate's count alone numbers the epochs
            (loader if number_by == "loader" else sampler).set_epoch(epoch)
        for batch in loader:
            accelerator.backward(model(**batch).loss)
            sampler.step()
            optimizer.step()
            optimizer.zero_grad()
            trained, updates = trained + len(batch["labels"]), updates + 1
            if updates == stop_after:
                accelerator.save_state(str(root / f"step_{updates}"))
    return model, sampler, trained


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_accelerate_resume_recipe_at_an_epoch_end(tmp_path):
    """6 batches an epoch: step 6 is epoch 0's last (mid-epoch: test_accelerate.py)."""
    stop = N // B
    full_model, full_sampler, _ = accelerate_run(tmp_path, stop_after=stop)
    model, sampler, trained = accelerate_run(tmp_path, resume=stop)
    assert trained == 3 * N - stop * B  # nothing lost, nothing repeated
    assert sampler.orders_history == full_sampler.orders_history
    for name, value in params(model).items():
        assert torch.equal(value, params(full_model)[name]), name


@pytest.mark.usefixtures("fresh_accelerator_state")
@pytest.mark.parametrize("stop", [N // B, N // B + 2])  # epoch 0's last step; inside epoch 1
def test_accelerate_resume_numbers_the_epochs_of_the_uninterrupted_run(tmp_path, stop):
    """prob_balance seeds each epoch's signs with its number: loader.set_epoch keeps accelerate's
    count (which restarts at 0 after load_state) equal to the epoch."""
    full_model, full_sampler, _ = accelerate_run(tmp_path, stop_after=stop, prob_balance=True)
    model, sampler, _ = accelerate_run(tmp_path, resume=stop, prob_balance=True)
    assert sampler.epoch == full_sampler.epoch == 2
    assert sampler.orders_history[-1] == full_sampler.orders_history[-1]
    for name, value in params(model).items():
        assert torch.equal(value, params(full_model)[name]), name


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_sampler_set_epoch_that_accelerate_renumbers_after_a_resume_is_refused(tmp_path):
    """sampler.set_epoch(1), then accelerate's set_epoch(0) from its restarted count: raised,
    where the epoch was silently seeded as epoch 0 again."""
    stop = N // B
    accelerate_run(tmp_path, stop_after=stop, number_by="sampler", prob_balance=True)
    with pytest.raises(ValueError, match=r"set_epoch\(0\) after set_epoch\(1\).*loader\.set_epoch"):
        accelerate_run(tmp_path, resume=stop, number_by="sampler", prob_balance=True)


@pytest.mark.usefixtures("fresh_accelerator_state")
@pytest.mark.parametrize("stop", [2, N // B, N // B + 2])  # inside epoch 0, its end, inside 1
def test_accelerate_loop_that_numbers_no_epochs_resumes_exactly_or_is_refused(tmp_path, stop):
    """A loop that calls no set_epoch: the prepared loader numbers the sampler with its own
    count, 0 again after load_state. Inside epoch 0 that is the epoch's number (exact); at
    epoch 0's end it would number epoch 1 as 0 again, and inside epoch 1 abandon its untrained
    rest and train a whole epoch in its place (2 * N examples after the checkpoint where the
    uninterrupted run trains 3 * N - 8 * B): raised at the resumed loader's first iter(), naming
    loader.set_epoch."""
    full_model, full_sampler, _ = accelerate_run(
        tmp_path, stop_after=stop, number_by="none", prob_balance=True
    )
    if stop > 2:
        with pytest.raises(ValueError, match=r"set_epoch\(0\) after load_state_dict.*loader"):
            accelerate_run(tmp_path, resume=stop, number_by="none", prob_balance=True)
        return
    model, sampler, trained = accelerate_run(
        tmp_path, resume=stop, number_by="none", prob_balance=True
    )
    assert trained == 3 * N - stop * B
    assert sampler.orders_history == full_sampler.orders_history
    for name, value in params(model).items():
        assert torch.equal(value, params(full_model)[name]), name
