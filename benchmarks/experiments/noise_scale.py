"""Noise scale: does B_simple predict the critical batch size (McCandlish et al. 2018)?

``python -m benchmarks.experiments.noise_scale [--quick]``

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training" (2018): to reach
a fixed loss, the optimizer steps S and the examples E = B * S trade off as
``(S / S_min - 1) (E / E_min - 1) = 1``, i.e. ``S(B) = S_min (1 + B_crit / B)`` with the critical
batch size ``B_crit = E_min / S_min``; the simple noise scale ``B_simple = tr(Sigma) / |G|^2``,
measured during training, should predict B_crit.

Here: an MLP 784-64-10 (ReLU) on the first 10,000 MNIST training images. For each batch size
(8 ... 1024; batches drawn by random reshuffling), plain SGD with the best learning rate of a
grid, trained until the full-train cross-entropy first reaches the target (evaluated every few
steps); S is that step count. ``S(B) = S_min + S_min B_crit / B`` is fitted by least squares on
relative error. B_simple comes from grabkit's ``PerExampleNoiseScale`` on hook statistics
(``PerSampleStats``), read during the batch-64 run at the step the target is reached, over
three seeds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.common import machine_description
from benchmarks.experiments import data as datasets
from benchmarks.experiments.common import (
    command_line,
    markdown_table,
    new_figure,
    parse_args,
    run_main,
    save_figure,
    write_report,
)
from grabkit.noise import PerExampleNoiseScale
from grabkit.stats import PerSampleStats

MEASURE_BATCH = 64  # the run in which B_simple is read during training


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))


@dataclass
class Run:
    """One (batch size, lr, seed) run: full-train loss every ``eval_every`` steps; ``steps`` is
    the first evaluated step at or below the target (None if never within the budget);
    ``b_simple`` the (step, loss, B_simple) readings when measured."""

    batch: int
    lr: float
    seed: int
    eval_steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    steps: int | None = None
    b_simple: list[tuple[int, float, float]] = field(default_factory=list)


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


def train_to_target(
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    lr: float,
    seed: int,
    target: float,
    max_examples: int,
    measure: bool = False,
    max_steps: int | None = None,
) -> Run:
    """SGD with random reshuffling until the full-train loss reaches ``target``.

    Evaluated every ``max(1, 256 // batch)`` steps (every ~256 examples, so S is resolved to a
    few percent at every batch size). With ``measure``, B_simple is read at every step from
    the per-example statistics of the hooked model (EMA over steps, update rate 0.05).
    """
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1000 + seed)
    stats = PerSampleStats(model, loss_reduction="mean") if measure else None
    gns = PerExampleNoiseScale(update_rate=0.05, population_size=len(x)) if measure else None
    eval_every = max(1, 256 // batch)
    run = Run(batch, lr, seed)
    step, order, position = 0, torch.randperm(len(x), generator=generator), 0
    while step * batch < max_examples and (max_steps is None or step < max_steps):
        if position + batch > len(x):
            order, position = torch.randperm(len(x), generator=generator), 0
        index = order[position : position + batch]
        position += batch
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[index]), y[index])
        loss.backward()
        if gns is not None:
            result = gns.observe_stats(stats)
            if result is not None:
                run.b_simple.append((step + 1, loss.item(), result.b_simple))
        optimizer.step()
        step += 1
        if step % eval_every == 0:
            current = full_loss(model, x, y)
            if current != current or current > 50:  # diverged
                break
            run.eval_steps.append(step)
            run.losses.append(current)
            if current <= target:
                run.steps = step
                break
    if stats is not None:
        stats.close()
    return run


def fit_critical(batches: Sequence[int], steps: Sequence[int]) -> tuple[float, float]:
    """(S_min, B_crit) of ``S(B) = S_min + S_min B_crit / B``, least squares on S_i relative
    error (rows divided by S_i)."""
    b = torch.tensor(batches, dtype=torch.float64)
    s = torch.tensor(steps, dtype=torch.float64)
    design = torch.stack([torch.ones_like(b), 1.0 / b], dim=1) / s[:, None]
    solution = torch.linalg.lstsq(design, torch.ones_like(s)[:, None]).solution[:, 0]
    s_min, slope = solution.tolist()
    return s_min, slope / s_min


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__, argv, {"--target": {"type": float, "default": None}})
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 784, generator=g)
        y = (x[:, :10].argmax(1) + (torch.rand(512, generator=g) < 0.2).long()) % 10
        batches, lrs, target, budget = [8, 32, 128], [0.1, 0.4], 1.5, 20_000
    else:
        x, y, _, _ = datasets.mnist(2000 if args.quick else 10_000, 1)
        batches = [16, 64, 256] if args.quick else [8, 16, 32, 64, 128, 256, 512, 1024]
        lrs = [0.1, 0.3] if args.quick else [0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6]
        target, budget = (0.35, 200_000) if args.quick else (0.2, 1_000_000)
    target = args.target or target
    seeds = args.seeds or (1 if args.quick or args.synthetic else 3)

    best: dict[int, Run] = {}
    grid_rows = []
    for batch in batches:
        for lr in lrs:
            beaten = best[batch].steps if batch in best else None
            run = train_to_target(x, y, batch, lr, 0, target, budget, max_steps=beaten)
            grid_rows.append(
                [
                    batch,
                    lr,
                    run.steps
                    or f"not reached in {run.eval_steps[-1] if run.eval_steps else 0} steps",
                ]
            )
            print(f"B={batch} lr={lr}: steps {run.steps}", flush=True)
            if run.steps is not None and (batch not in best or run.steps < best[batch].steps):
                best[batch] = run
    reached = sorted(best)
    if len(reached) < 2:
        raise SystemExit(f"target loss {target} reached at fewer than 2 batch sizes; lower it")
    s_min, b_crit = fit_critical(reached, [best[b].steps for b in reached])
    if not (s_min > 0 and b_crit > 0):
        raise SystemExit(
            f"the fit S(B) = S_min (1 + B_crit / B) failed (S_min {s_min:.3g}, B_crit "
            f"{b_crit:.3g}): the steps do not fall with the batch size; pick another target"
        )
    e_min = s_min * b_crit

    # B_simple during training, in the measured run at the best lr of that batch size
    measure_batch = MEASURE_BATCH if MEASURE_BATCH in best else reached[0]
    measured = [
        train_to_target(
            x, y, measure_batch, best[measure_batch].lr, seed, target, budget, measure=True
        )
        for seed in range(seeds)
    ]
    at_target = [m.b_simple[-1][2] for m in measured if m.b_simple]
    b_simple = statistics.fmean(at_target)
    # the EMA over the run's second half, and its lowest and highest reading after warm-up
    second_half = [v for m in measured for _, _, v in m.b_simple[len(m.b_simple) // 2 :]]
    after_warmup = [v for m in measured for _, _, v in m.b_simple[20:]] or second_half
    ratio = b_crit / b_simple

    rows = []
    for b in reached:
        r = best[b]
        predicted = s_min * (1 + b_crit / b)
        rows.append(
            [
                b,
                f"{r.lr}" + (" (grid edge)" if r.lr in (lrs[0], lrs[-1]) else ""),
                r.steps,
                r.steps * b,
                f"{r.steps / s_min:.2f}",
                f"{r.steps * b / e_min:.2f}",
                f"{predicted:.0f}",
            ]
        )
    table = markdown_table(
        ["batch B", "best lr", "steps S", "examples E", "S / S_min", "E / E_min", "fit S(B)"],
        rows,
    )
    spread = f"{min(at_target):.1f}-{max(at_target):.1f}" if len(at_target) > 1 else ""
    verdict = (
        f"B_crit / B_simple = {ratio:.2f}: "
        + ("within" if 0.1 <= ratio <= 10 else "outside")
        + " an order of magnitude"
    )
    plot = plot_results(best, reached, s_min, e_min, b_crit, measured, target, args)
    grid = markdown_table(["batch", "lr", "steps to target"], grid_rows)
    text = (
        "## Noise scale: B_simple vs the critical batch size\n\n"
        f"Command: `{command_line('noise_scale', args, ['target', 'seeds'])}`  \n"
        f"Machine: {machine_description()}\n\n"
        f"MLP 784-64-10 on {len(x)} MNIST training images, plain SGD, target full-train "
        f"cross-entropy {target}; best learning rate of {lrs} per batch size (seed 0).\n\n"
        f"- fit S(B) = S_min (1 + B_crit / B): **S_min = {s_min:.0f} steps, E_min = "
        f"{e_min:.0f} examples, B_crit = {b_crit:.0f}**\n"
        f"- B_simple at the target loss (batch {measure_batch}, lr {best[measure_batch].lr}, "
        f"PerExampleNoiseScale EMA, {len(at_target)} seed(s)): **{b_simple:.0f}** {spread}; "
        f"its readings after the first 20 steps span {min(after_warmup):.0f} to "
        f"{max(after_warmup):.0f}, mean {statistics.fmean(second_half):.0f} over the "
        "second half (B_crit here is a property of the whole run to the target, B_simple of "
        "one point of it)\n"
        f"- {verdict}. McCandlish et al. report B_simple and B_crit agreeing to within roughly "
        "an order of magnitude across their tasks (B_simple approximates their B_noise, which "
        "assumes a well-conditioned Hessian), so that is the test applied here.\n\n"
        f"{table}\n\n![noise scale]({plot.name})\n\n"
        f"<details><summary>learning-rate grid (steps to the target, seed 0)</summary>\n\n"
        f"{grid}\n\n</details>\n"
    )
    write_report(args.out, "noise_scale.md", text)


def plot_results(best, reached, s_min, e_min, b_crit, measured, target, args):
    figure, axes = new_figure(1, 3, width=4.6, height=3.6)
    ax = axes[0][0]
    for k, b in enumerate(reached):
        r = best[b]
        ax.plot(r.eval_steps, r.losses, color=f"C{k % 10}", label=f"B={b} (lr {r.lr})")
    ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("full-train loss (log)")
    ax.set_title("loss vs steps, best lr per batch size", fontsize=10)
    ax.legend(fontsize=7, ncol=2)

    ax = axes[0][1]
    ratio = torch.logspace(-1.5, 2.2, 200, dtype=torch.float64)
    ax.plot(1 + ratio, 1 + 1 / ratio, "k-", lw=1, label="(S/S_min - 1)(E/E_min - 1) = 1")
    for k, b in enumerate(reached):
        r = best[b]
        ax.plot(r.steps * b / e_min, r.steps / s_min, "o", color=f"C{k % 10}", label=f"B={b}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("E / E_min (examples, log)")
    ax.set_ylabel("S / S_min (steps, log)")
    ax.set_title(f"steps-examples trade-off, B_crit = {b_crit:.0f}", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[0][2]
    for k, m in enumerate(measured):
        steps = [s for s, _, _ in m.b_simple]
        ax.plot(
            steps,
            [v for _, _, v in m.b_simple],
            color=f"C{k}",
            lw=1,
            label=f"B_simple, seed {m.seed}",
        )
    ax.axhline(b_crit, color="k", ls="--", lw=1, label=f"B_crit (fit) = {b_crit:.0f}")
    ax.set_yscale("log")
    ax.set_xlabel(f"optimizer steps (batch {measured[0].batch})")
    ax.set_ylabel("batch size (log)")
    ax.set_title("B_simple during training vs B_crit", fontsize=10)
    ax.legend(fontsize=7)
    for a in axes[0]:
        a.grid(alpha=0.3, which="both")
    figure.suptitle(
        "Critical batch size on MNIST (McCandlish et al. 2018), grabkit.noise", fontsize=11
    )
    return save_figure(
        figure,
        args.out,
        "noise_scale.png",
        "Left: each batch size's run at its best learning rate until the target loss. Middle: "
        "each batch size's steps and examples to the target,\nnormalised by the fit; the curve "
        "is the paper's trade-off. Right: the EMA of B_simple read every step of the batch-"
        f"{measured[0].batch} run, ending at the target.",
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
