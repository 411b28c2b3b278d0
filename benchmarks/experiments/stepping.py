"""Stepping: adaptive gradient accumulation against fixed batches, at equal tokens (GQC).

``python -m benchmarks.experiments.stepping [--quick]``

torch-gqc's claim is that stepping when the accumulated gradient is good enough (GNTS: when its
norm falls below a scheduled threshold) beats fixed batches at equal data. Here every contender
sees the same microbatches in the same order: WikiText-2's valid split (the training text here;
vocabulary: the 4,999 most frequent words + ``<unk>``) cut into 32-token windows, the first
4,096 of them (131,072 tokens) in a seeded random order, one pass in microbatches of 8 windows
(256 tokens); the model is the experiments' one-block transformer LM
(``benchmarks.experiments.models.TinyLM``), AdamW lr 3e-3 for all. Validation: cross-entropy on
the first 16,384 tokens of the test split, read eight times per run.

Contenders (``count`` = tokens per microbatch):

* ``fixed``: a step per microbatch (256 tokens);
* ``fixed x4``: a step every 4 microbatches (1,024 tokens, gradients averaged);
* ``GNTS default``: ``OptimizerWrapperGNTS`` with ``get_norm_threshold_cosine_annealing_with_
  warmup``'s defaults (start_norm 1.0, end_norm 0.0, warm-up x10 over the first 10%), as
  torch-gqc's README sets it up;
* ``GNTS calibrated``: the same schedule started at 0.6x the median gradient norm of five
  probe microbatches and ending at 0.3x that start (GNTS thresholds are in gradient-norm units,
  so the defaults fit one scale only);
* ``noise scale``: ``OptimizerWrapperGNS``, step when the window holds 1 x B_simple tokens;
* ``norm test``: ``AdaptiveAccumulationWrapper(opt, NormTest(theta=1.0))``.

All adaptive contenders cap a window at 64 microbatches (the wrappers' default).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.common import machine_description
from benchmarks.experiments import data as datasets
from benchmarks.experiments.common import (
    command_line,
    markdown_table,
    mean_spread,
    new_figure,
    parse_args,
    run_main,
    save_figure,
    write_report,
)
from benchmarks.experiments.models import TinyLM
from grabkit.accumulate import (
    AdaptiveAccumulationWrapper,
    NormTest,
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    get_norm_threshold_cosine_annealing_with_warmup,
)

CONTEXT = 32
MICRO = 8  # windows per microbatch
CONTENDERS = ["fixed", "fixed x4", "GNTS default", "GNTS calibrated", "noise scale", "norm test"]


@dataclass
class Run:
    """One (contender, seed): validation loss at checkpoints, with tokens and steps so far."""

    name: str
    seed: int
    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    valid: list[float] = field(default_factory=list)
    seconds: float = 0.0


def validation_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        losses = [
            nn.functional.cross_entropy(
                model(x[i : i + 128]).flatten(0, 1), y[i : i + 128].flatten()
            )
            for i in range(0, len(x), 128)
        ]
    model.train()
    return statistics.fmean(v.item() for v in losses)


def windows(ids: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    count = min(count, (len(ids) - 1) // CONTEXT)
    return ids[: count * CONTEXT].view(count, CONTEXT), ids[1 : count * CONTEXT + 1].view(
        count, CONTEXT
    )


def train(name: str, seed: int, data, passes: int, checkpoints: int) -> Run:
    (x, y), (vx, vy), vocab = data
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(x), generator=generator) for _ in range(passes)])
    micro = order[: len(order) // MICRO * MICRO].view(-1, MICRO)
    torch.manual_seed(seed)
    model = TinyLM(vocab, context=CONTEXT)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    count = MICRO * CONTEXT

    def loss_of(i: int) -> torch.Tensor:
        logits = model(x[micro[i]])
        return nn.functional.cross_entropy(logits.flatten(0, 1), y[micro[i]].flatten())

    schedule, opt = None, None
    n = len(micro)
    if name in ("GNTS default", "GNTS calibrated"):
        opt = OptimizerWrapperGNTS(inner)
        kwargs = {}
        if name == "GNTS calibrated":
            probe = []
            for i in range(5):
                grads = torch.autograd.grad(loss_of(i), list(model.parameters()))
                probe.append(float(torch.stack([g.norm() for g in grads]).norm()))
            start = 0.6 * statistics.median(probe)
            kwargs = {"start_norm": start, "end_norm": 0.3 * start, "warmup_multiplier": 3.0}
        schedule = get_norm_threshold_cosine_annealing_with_warmup(opt, n // 10, n, **kwargs)
    elif name == "noise scale":
        opt = OptimizerWrapperGNS(inner, noise_multiplier=1.0)
    elif name == "norm test":
        opt = AdaptiveAccumulationWrapper(inner, NormTest(theta=1.0))
    elif name not in ("fixed", "fixed x4"):
        raise ValueError(f"unknown contender {name!r}; expected one of {CONTENDERS}")
    every = {n * k // checkpoints for k in range(1, checkpoints + 1)}
    run = Run(name, seed)
    steps = 0
    start = time.perf_counter()
    for i in range(n):
        if name == "fixed x4":
            (loss_of(i) / 4).backward()
            if (i + 1) % 4 == 0:
                inner.step()
                inner.zero_grad()
                steps += 1
        elif opt is None:
            loss_of(i).backward()
            inner.step()
            inner.zero_grad()
            steps += 1
        else:
            loss_of(i).backward()
            steps += bool(opt.step(count=count))
        if schedule is not None:
            schedule.step()
        if i + 1 in every:
            if opt is not None and i + 1 == n:
                steps += bool(opt.flush())
            run.seconds += time.perf_counter() - start
            run.tokens.append((i + 1) * count)
            run.steps.append(steps)
            run.valid.append(validation_loss(model, vx, vy))
            start = time.perf_counter()
    return run


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        vocab = 50
        train_ids = torch.randint(0, vocab, (128 * CONTEXT + 1,), generator=g)
        test_ids = torch.randint(0, vocab, (16 * CONTEXT + 1,), generator=g)
        passes, n_train, n_valid = 1, 128, 16
    else:
        train_ids, test_ids, vocab = datasets.word_corpus("wikitext2", 5000)
        passes, n_train, n_valid = (1, 1024, 128) if args.quick else (1, 4096, 512)
    data = (windows(train_ids, n_train), windows(test_ids, n_valid), vocab)
    seeds = args.seeds or (1 if args.quick or args.synthetic else 3)
    checkpoints = 4 if args.quick or args.synthetic else 8
    runs: list[Run] = []
    for seed in range(seeds):
        for name in CONTENDERS:
            runs.append(train(name, seed, data, passes, checkpoints))
            r = runs[-1]
            print(
                f"seed {seed} {name}: valid {r.valid[-1]:.4f}, {r.steps[-1]} steps, "
                f"{r.seconds:.0f} s",
                flush=True,
            )
    by = {name: [r for r in runs if r.name == name] for name in CONTENDERS}
    fixed = {r.seed: r.valid[-1] for r in by["fixed"]}
    rows = []
    for name, rs in by.items():
        tokens = rs[0].tokens[-1]
        steps = [r.steps[-1] for r in rs]
        rows.append(
            [
                name,
                mean_spread([r.valid[-1] for r in rs]),
                mean_spread([r.valid[-1] - fixed[r.seed] for r in rs], "{:+.4f}"),
                mean_spread(steps, "{:.0f}"),
                f"{tokens / statistics.fmean(steps):.0f}",
                mean_spread([r.seconds for r in rs], "{:.0f}"),
            ]
        )
    table = markdown_table(
        [
            "contender",
            "final validation loss (nats/token)",
            "vs fixed, same seed",
            "optimizer steps",
            "tokens / step",
            "train seconds",
        ],
        rows,
    )
    ranked = sorted(by, key=lambda k: statistics.fmean(r.valid[-1] for r in by[k]))
    plot = plot_runs(by, seeds, args)
    text = (
        "## Stepping: adaptive accumulation vs fixed batches at equal tokens\n\n"
        f"Command: `{command_line('stepping', args, ['seeds'])}`  \n"
        f"Machine: {machine_description()}\n\n"
        f"One-block transformer LM (d 64), WikiText-2 valid split as training text "
        f"({len(data[0][0])} windows of {CONTEXT} tokens, {passes} pass(es), microbatch "
        f"{MICRO * CONTEXT} tokens), validation on {data[1][0].numel()} test tokens; AdamW "
        f"3e-3 for every contender; {seeds} seed(s), ± is half the min-max range.\n\n"
        f"Ranked by final validation loss (lower is better): {', '.join(ranked)}.\n\n"
        f"{table}\n\n![stepping]({plot.name})\n"
    )
    write_report(args.out, "stepping.md", text)


def plot_runs(by: dict[str, list[Run]], seeds: int, args) -> object:
    from matplotlib import ticker  # imported with the figure, as in common.new_figure

    figure, axes = new_figure(1, 2, width=5.4, height=3.8)
    for k, (name, rs) in enumerate(by.items()):
        color = f"C{k}"
        tokens = rs[0].tokens
        columns = list(zip(*(r.valid for r in rs), strict=True))
        mean = [statistics.fmean(c) for c in columns]
        axes[0][0].plot(tokens, mean, color=color, marker="o", ms=3, label=name)
        axes[0][0].fill_between(
            tokens, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.15
        )
        steps = [statistics.fmean(c) for c in zip(*(r.steps for r in rs), strict=True)]
        axes[0][1].plot(steps, mean, color=color, marker="o", ms=3, label=name)
    axes[0][0].set_xlabel("training tokens")
    axes[0][0].set_title("validation loss vs tokens seen", fontsize=10)
    axes[0][1].set_xlabel("optimizer steps (log)")
    axes[0][1].set_xscale("log")
    axes[0][1].xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes[0][1].xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0][1].xaxis.set_minor_formatter(ticker.NullFormatter())
    axes[0][1].set_title("validation loss vs optimizer steps", fontsize=10)
    for ax in axes[0]:
        ax.set_ylabel("validation loss (nats / token)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle("Stepping at equal tokens: WikiText-2, one-block transformer LM", fontsize=11)
    return save_figure(
        figure,
        args.out,
        "stepping.png",
        f"Lines: mean over {seeds} seed(s); band (left): min to max over the seeds. Every "
        "contender sees the same microbatches in the same order.",
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
