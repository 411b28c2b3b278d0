"""torch-gqc's README loops run with only the import changed, and GNTS decides as GQC does."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import cross_entropy

from grabkit import (
    NormWarmupScheduler,
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    get_norm_threshold_cosine_annealing_with_warmup,
)


def classification_task(seed: int = 0, batches: int = 120, batch_size: int = 16):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 10, generator=gen) * 2
    loader = []
    for _ in range(batches):
        labels = torch.randint(0, 3, (batch_size,), generator=gen)
        inputs = centers[labels] + 2 * torch.randn(batch_size, 10, generator=gen)
        flipped = torch.rand(batch_size, generator=gen) < 0.2
        labels = torch.where(flipped, torch.randint(0, 3, (batch_size,), generator=gen), labels)
        loader.append((inputs, labels))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    return model, loader


def constant_schedule_with_warmup(optimizer, warmup_steps):
    """Stand-in for transformers' get_constant_schedule_with_warmup (a stock LambdaLR)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps))


def mean_loss(model, loader):
    with torch.no_grad():
        return sum(float(cross_entropy(model(x), y)) for x, y in loader) / len(loader)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_readme_loop_plain():
    model, train_loader = classification_task()
    before = mean_loss(model, train_loader)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = constant_schedule_with_warmup(optimizer, warmup_steps=10)
    optimizer = OptimizerWrapperGNTS(optimizer)
    norm_scheduler = get_norm_threshold_cosine_annealing_with_warmup(
        optimizer,
        num_warmup_steps=10,
        num_training_steps=len(train_loader),
        start_norm=0.8,
        end_norm=0.2,
    )
    for inputs, labels in train_loader:
        logits = model(inputs)
        loss = cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        norm_scheduler.step()

    assert mean_loss(model, train_loader) < 0.8 * before
    assert optimizer.norm_threshold == pytest.approx(0.2)
    assert 0 < optimizer.statistics()["steps"] < len(train_loader)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_readme_loop_with_statistics_and_tqdm():
    tqdm = pytest.importorskip("tqdm").tqdm
    model, train_loader = classification_task(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = constant_schedule_with_warmup(optimizer, warmup_steps=10)
    optimizer = OptimizerWrapperGNTS(optimizer)
    norm_scheduler = get_norm_threshold_cosine_annealing_with_warmup(
        optimizer, num_warmup_steps=10, num_training_steps=len(train_loader)
    )
    step_batches = []
    num_batches_sampled = []
    pbar = tqdm(train_loader, desc="Training", disable=True)
    for inputs, labels in pbar:
        stats = optimizer.statistics()
        logits = model(inputs)
        loss = cross_entropy(logits, labels)
        loss.backward()
        stepped = optimizer.step()
        lr_scheduler.step()
        norm_scheduler.step()
        if stepped:
            step_batches.append(stats["batches"])
            num_batches_sampled.append(stats["num_draws"])
        pbar.set_postfix(stats)

    final = optimizer.statistics()
    assert len(step_batches) == final["steps"]
    assert sum(num_batches_sampled) == final["batches"] - final["num_draws"]
    assert num_batches_sampled[-1] == final["last_step_num_draws"]
    assert {"batches", "steps", "num_draws", "last_mean_grad_norm", "last_step_num_draws"} <= set(
        final
    )
    assert {"norm_threshold", "reason"} <= set(final)


def test_norm_warmup_scheduler_loop():
    model, train_loader = classification_task(batches=20)
    optimizer = OptimizerWrapperGNTS(torch.optim.AdamW(model.parameters(), lr=1e-2))
    base = get_norm_threshold_cosine_annealing_with_warmup(optimizer, 0, len(train_loader))
    norm_scheduler = NormWarmupScheduler(base, num_warmup_steps=5)
    assert optimizer.norm_threshold == 10.0
    for inputs, labels in train_loader:
        cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        norm_scheduler.step()
    assert optimizer.norm_threshold == pytest.approx(0.0, abs=1e-12)


def test_gnts_makes_the_same_decisions_as_torch_gqc():
    gqc = pytest.importorskip("gradient_quality_control")
    decisions = {}
    finals = {}
    for name, cls in (("grabkit", OptimizerWrapperGNTS), ("gqc", gqc.OptimizerWrapperGNTS)):
        model, loader = classification_task(seed=2, batches=60)
        optimizer = cls(torch.optim.SGD(model.parameters(), lr=0.1), max_batch_draws=6)
        schedule = get_norm_threshold_cosine_annealing_with_warmup
        if name == "gqc":
            schedule = gqc.get_norm_threshold_cosine_annealing_with_warmup
        norm_scheduler = schedule(optimizer, 5, 60, start_norm=0.5, end_norm=0.1)
        decisions[name] = []
        for inputs, labels in loader:
            cross_entropy(model(inputs), labels).backward()
            decisions[name].append(optimizer.step())
            norm_scheduler.step()
        finals[name] = [p.detach().clone() for p in model.parameters()]
    assert decisions["grabkit"] == decisions["gqc"]
    assert 3 < sum(decisions["grabkit"]) < 60
    for a, b in zip(finals["grabkit"], finals["gqc"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_gns_with_the_gqc_signature():
    model, loader = classification_task(batches=30)
    optimizer = OptimizerWrapperGNS(torch.optim.SGD(model.parameters(), lr=0.1), 1.0, 8)
    for inputs, labels in loader:
        cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    stats = optimizer.statistics()
    assert stats["noise_multiplier"] == 1.0 and stats["estimated_gns"] is not None
