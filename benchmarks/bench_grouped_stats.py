"""Hook-mode GraB on grouped batches: the cost of exact (and sketched) per-item statistics when
the model runs group by group, against the padded run's.

Workload (asym's notebook shape): B token sequences of lengths {1, 4, 16, 64} with p
proportional to 1/length, Embedding -> Linear over positions -> masked max -> Linear, MSE, SGD.
Contenders, each with its own copy of the model, timed side by side (interleaved rounds,
medians):

* ``padded``: the batch padded to its longest item, one forward and backward;
* ``grouped``: ``GroupedBatch.run`` (length groups planned by ``plan_groups``), one backward;
* ``by-group``: ``backward_by_group`` (a forward and backward per group);

each plain and with a hook-mode ``GraBSampler`` (``balance_type="pair"``) stepped after the
backward, exact and sketched (k = 1024). The figures: each GraB step over its own plain step,
and grouped GraB over padded GraB (what the grouping saves once the statistics are included).

Run: ``python benchmarks/run.py grouped_stats`` (``--quick``, ``--threads=N``, ``--width=W``,
``--batch=B``, ``--rounds=N``).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from benchmarks.common import machine_description, time_side_by_side
from grabkit.group import backward_by_group, group_batch
from grabkit.order import GraBSampler

LENGTHS = np.array([1, 4, 16, 64])


class MaxPool(nn.Module):
    """Embedding -> Linear over positions -> masked max -> Linear (a finite fill, so rows of no
    item stay finite)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.emb, self.linear = nn.Embedding(8, width), nn.Linear(width, width)
        self.proj = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.linear(self.emb(x))).masked_fill(~mask[..., None], -1e4)
        return self.proj(h.max(1).values)[:, 0]


class Stepper:
    """One contender: a model copy, an optimizer, and optionally a hook-mode sampler fed the
    next positions of its own order (the batch itself is fixed: costs do not depend on it)."""

    def __init__(self, model: nn.Module, batch_size: int, statistics: str | None) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.sampler = None
        if statistics is not None:
            options = {"statistics": "sketch", "sketch_dim": 1024} if statistics == "sketch" else {}
            self.sampler = GraBSampler(
                range(64 * batch_size), model=model, balance_type="pair", batch_size=batch_size,
                **options,
            )  # fmt: skip
            self.batch_size = batch_size
            self.drawn = iter(self.sampler)

    def finish(self) -> None:
        if self.sampler is not None:
            if not list(itertools.islice(self.drawn, self.batch_size)):
                self.drawn = iter(self.sampler)  # the next epoch
                list(itertools.islice(self.drawn, self.batch_size))
            self.sampler.step()
        self.optimizer.step()
        self.optimizer.zero_grad()


def contenders(width: int, batch_size: int, seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    p = (1 / LENGTHS) / (1 / LENGTHS).sum()
    lengths = torch.tensor(rng.choice(LENGTHS, size=batch_size, p=p))
    tokens = [torch.randint(0, 8, (int(n),)) for n in lengths]
    padded = pad_sequence(tokens, batch_first=True)
    mask = torch.arange(padded.shape[1])[None] < lengths[:, None]
    target = torch.randn(batch_size)
    grouped = group_batch(padded, lengths)
    torch.manual_seed(seed)
    base = MaxPool(width)

    def copy() -> nn.Module:
        model = MaxPool(width)
        model.load_state_dict(base.state_dict())
        return model

    def padded_step(s: Stepper) -> None:
        ((s.model(padded, mask) - target) ** 2).mean().backward()
        s.finish()

    def grouped_step(s: Stepper) -> None:
        ((grouped.run(s.model, pass_mask=True) - target) ** 2).mean().backward()
        s.finish()

    def by_group_step(s: Stepper) -> None:
        backward_by_group(s.model, grouped, lambda o, i: (o - target[i]) ** 2, pass_mask=True)
        s.finish()

    steps = {"padded": padded_step, "grouped": grouped_step, "by-group": by_group_step}
    out = {}
    for run, step in steps.items():
        for statistics in (None, "exact", "sketch"):
            stepper = Stepper(copy(), batch_size, statistics)
            name = run if statistics is None else f"{run} + GraB {statistics}"
            out[name] = lambda step=step, stepper=stepper: step(stepper)
    out["_plan"] = (
        f"{len(grouped.plan)} groups, padding efficiency {grouped.padding_efficiency():.2f}"
    )
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="grouped_stats")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 3 if args.quick else args.rounds
    runs = contenders(args.width, args.batch)
    plan = runs.pop("_plan")
    times = time_side_by_side(runs, rounds=rounds, warmup=2)
    print(f"machine: {machine_description()}")
    print(f"width {args.width}, B = {args.batch}, {plan}, {rounds} rounds (medians)\n")
    print("| run | plain ms | GraB exact ms (/ plain) | GraB sketch ms (/ plain) |")
    print("|---|---|---|---|")
    for run in ("padded", "grouped", "by-group"):
        plain = times[run]
        exact, sketch = times[f"{run} + GraB exact"], times[f"{run} + GraB sketch"]
        print(
            f"| {run} | {plain * 1e3:.1f} | {exact * 1e3:.1f} ({exact / plain:.2f}x) | "
            f"{sketch * 1e3:.1f} ({sketch / plain:.2f}x) |"
        )
    for run in ("grouped", "by-group"):
        for kind in ("exact", "sketch"):
            ratio = times[f"{run} + GraB {kind}"] / times[f"padded + GraB {kind}"]
            print(f"\n{run} + GraB {kind} / padded + GraB {kind}: {ratio:.2f}x", end="")
    print()
