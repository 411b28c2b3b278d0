"""torchdata's StatefulDataLoader with workers and a hook-mode GraBSampler: resume from the
loader's own state_dict."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchdata")
pytest.importorskip("transformers")

from tests.integrations.tiny import B, N, dataset, params, tiny_bert
from torchdata.stateful_dataloader import StatefulDataLoader

from grabkit.order import GraBSampler

pytestmark = pytest.mark.slow
STOP = 8  # batches trained before the snapshot: mid-epoch 1 (6 batches an epoch)


def run(snapshot=None, stop=None, epochs=2):
    """Train; return (model, sampler, indices trained after the resume, states at ``stop``).

    torchdata's recipe: the snapshot is a position inside the epoch in progress, so the resumed
    loop starts with that epoch (one taken at an epoch's last batch: its empty rest).
    """
    torch.manual_seed(0)
    model, data = tiny_bert(), dataset()
    for i, item in enumerate(data):
        item["index"] = torch.tensor(i)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = GraBSampler(data, model=model, seed=0)
    loader = StatefulDataLoader(
        data, sampler=sampler, batch_size=B, num_workers=2, persistent_workers=True
    )
    if snapshot is not None:
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        loader.load_state_dict(snapshot["loader"])
    seen, done = [], 0 if snapshot is None else snapshot["done"]
    for _ in range(max(done - 1, 0) // (N // B), epochs):
        for batch in loader:
            index = batch.pop("index")
            model(**batch).loss.backward()
            sampler.step()
            optimizer.step()
            optimizer.zero_grad()
            seen += index.tolist()
            done += 1
            if done == stop:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                return model, sampler, seen, {**state, "loader": loader.state_dict(), "done": done}
    return model, sampler, seen, None


def test_data_position_is_exact_with_workers():
    _, _, full_seen, _ = run()
    *_, snapshot = run(stop=STOP)
    _, _, resumed_seen, _ = run(snapshot)
    assert resumed_seen == full_seen[STOP * B :]


@pytest.mark.parametrize("stop", [STOP, N // B])  # mid-epoch 1; epoch 0's last batch
def test_in_flight_grab_decisions_survive_a_worker_snapshot(stop):
    """At an epoch's last batch the snapshot resumes with that epoch's empty rest, as
    torchdata's own samplers do, and the run still equals the uninterrupted one."""
    full_model, full_sampler, _, _ = run(epochs=3)
    *_, snapshot = run(stop=stop)
    model, sampler, _, _ = run(snapshot, epochs=3)
    assert torch.equal(sampler.order, full_sampler.order)
    for name, value in params(model).items():
        assert torch.equal(value, params(full_model)[name]), name
