"""Ordering: GraB herding against random reshuffling on real data (Lu, Guo, De Sa, NeurIPS 2022).

``python -m benchmarks.experiments.ordering [--task mnist,cifar,wikitext] [--quick]``

Three tasks, as in the GraB paper's experiments (sizes cut to a 2-core CPU):

* ``mnist``: logistic regression (784 -> 10) on the first 10,000 MNIST training images
  (all 10,000 test images), SGD lr 0.05, batch 16, 10 epochs;
* ``cifar``: LeNet-5 on the lossless CIFAR-10 subset (4,000 train / 1,000 test images),
  SGD lr 0.02 momentum 0.9, batch 16, 10 epochs;
* ``wikitext``: a 1-block causal transformer LM (d 64, 4 heads, vocabulary: the 4,999 most
  frequent words + ``<unk>``) on WikiText-2; an example is a 32-token window of the valid split
  (the training text here; the first 1,024 windows), perplexity on the first 16,384 test tokens;
  AdamW lr 3e-3, batch 16, 5 epochs.

Contenders: ``rr`` (a fresh random permutation each epoch, torch's ``RandomSampler``) and ``so``
(one permutation, kept) run a plain loop without hooks, so their wall time is plain training;
``mean``, ``pair`` and ``recursive`` (MNIST only by default: see ``WITHOUT_RECURSIVE``) run
grabkit's exact hook mode, and ``mean-sketch`` / ``pair-sketch`` its sketched statistics
(``statistics="sketch"``, k = 1024),
``GraBSampler(train_set, model=model, balance_type=...)`` with ``sampler.step()`` after each
backward. Every contender of a seed starts from the same weights.

Reported per task: full-train loss after each epoch, the test metric, the first epoch at which
each ordering reaches rr's final train loss (per seed), and wall time per epoch (the training
loop only); mean ± half-range over the seeds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

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
from benchmarks.experiments.models import LeNet, TinyLM
from grabkit.order import GraBSampler

#: contender label -> GraBSampler keywords (hook mode); ``None``: a plain loop without hooks.
#: A further GraB variant is one more entry here. ``-sketch``: the same ordering balanced on
#: (B, 1024) random sketches of the per-example gradients instead of exact inner products.
CONTENDERS: dict[str, dict | None] = {
    "rr": None,
    "so": None,
    "mean": {"balance_type": "mean"},
    "pair": {"balance_type": "pair"},
    "recursive": {"balance_type": "recursive"},
    "mean-sketch": {"balance_type": "mean", "statistics": "sketch"},
    "pair-sketch": {"balance_type": "pair", "statistics": "sketch"},
}
BASELINE = "rr"
#: tasks whose default contenders leave ``recursive`` out: in hook mode it balances each example
#: at 5 tree levels against up to 63 running sums; a --quick run took 23-29 s per LeNet run
#: (mean: 3 s) and over two minutes per LM run (mean: 9 s), too long for 5 seeds here. Name it
#: in --orderings to run it
WITHOUT_RECURSIVE = {"cifar", "wikitext"}


# ------------------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """A dataset, a model and how to train and score it.

    ``loss(model, inputs, targets)`` is the mean training loss of a batch; ``metric`` names the
    test metric and ``score(model)`` computes it; ``higher_is_better`` orients the metric.
    """

    name: str
    description: str
    train_set: TensorDataset
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    score: Callable[[nn.Module], float]
    metric: str
    higher_is_better: bool
    batch_size: int
    epochs: int
    eval_batch: int = 1000

    def full_train_loss(self, model: nn.Module) -> float:
        x, y = self.train_set.tensors
        with torch.no_grad():
            total = sum(
                self.loss(model, x[i : i + self.eval_batch], y[i : i + self.eval_batch]).item()
                * len(x[i : i + self.eval_batch])
                for i in range(0, len(x), self.eval_batch)
            )
        return total / len(x)


def _classification(logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits_fn(model, x), y)

    return loss


def _accuracy(x_test: torch.Tensor, y_test: torch.Tensor) -> Callable[[nn.Module], float]:
    def score(model: nn.Module) -> float:
        with torch.no_grad():
            return 100.0 * (model(x_test).argmax(1) == y_test).float().mean().item()

    return score


def _lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _windows(ids: torch.Tensor, context: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` non-overlapping (input, next-token target) windows of ``context`` tokens."""
    count = min(count, (len(ids) - 1) // context)
    x = ids[: count * context].view(count, context)
    y = ids[1 : count * context + 1].view(count, context)
    return x, y


def make_task(name: str, quick: bool, synthetic: bool) -> Task:
    """The task ``name`` (``mnist``, ``cifar``, ``wikitext``); ``quick`` shrinks it to seconds,
    ``synthetic`` replaces the data by a tiny random set of the same shapes."""
    g = torch.Generator().manual_seed(0)
    if name == "mnist":
        n = 2000 if quick else 10_000
        if synthetic:
            x, y = torch.randn(256, 784, generator=g), torch.randint(0, 10, (256,), generator=g)
            xt, yt = x[:64], y[:64]
        else:
            x, y, xt, yt = datasets.mnist(n, 2000 if quick else 10_000)
        return Task(
            name,
            f"logistic regression on MNIST ({len(x)} train / {len(xt)} test images)",
            TensorDataset(x, y),
            lambda: nn.Linear(784, 10),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
            _classification(lambda m, v: m(v)),
            _accuracy(xt, yt),
            "test accuracy (%)",
            True,
            batch_size=16,
            epochs=2 if synthetic else (4 if quick else 10),
        )
    if name == "cifar":
        if synthetic:
            x = torch.randn(128, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (128,), generator=g)
            xt, yt = x[:32], y[:32]
        else:
            x, y, xt, yt = datasets.cifar10_subset()
            if quick:
                x, y = x[:1000], y[:1000]
        return Task(
            name,
            f"LeNet-5 on the CIFAR-10 lossless subset ({len(x)} train / {len(xt)} test)",
            TensorDataset(x, y),
            LeNet,
            lambda m: torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9),
            _classification(lambda m, v: m(v)),
            _accuracy(xt, yt),
            "test accuracy (%)",
            True,
            batch_size=16,
            epochs=2 if synthetic else (3 if quick else 10),
        )
    if name == "wikitext":
        context = 32
        if synthetic:
            vocab = 50
            train_ids = torch.randint(0, vocab, (64 * context + 1,), generator=g)
            test_ids = torch.randint(0, vocab, (16 * context + 1,), generator=g)
        else:
            train_ids, test_ids, vocab = datasets.word_corpus("wikitext2", 5000)
        x, y = _windows(train_ids, context, 128 if quick else 1024)
        xt, yt = _windows(test_ids, context, 128 if quick else 512)

        def perplexity(model: nn.Module) -> float:
            with torch.no_grad():
                losses = [
                    _lm_loss(model, xt[i : i + 256], yt[i : i + 256])
                    for i in range(0, len(xt), 256)
                ]
            return math.exp(statistics.fmean(v.item() for v in losses))

        return Task(
            name,
            f"1-block transformer LM on WikiText-2 ({len(x)} windows of {context} tokens from "
            f"the valid split / {xt.numel()} test tokens, vocabulary {vocab})",
            TensorDataset(x, y),
            lambda: TinyLM(vocab, context=context),
            lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
            _lm_loss,
            perplexity,
            "test perplexity",
            False,
            batch_size=16,
            epochs=2 if synthetic else (3 if quick else 5),
            eval_batch=256,
        )
    raise ValueError(f"unknown task {name!r}; expected mnist, cifar or wikitext")


# -------------------------------------------------------------------------------------- runs
@dataclass
class Run:
    """One (task, ordering, seed): per-epoch full-train loss, test metric and loop seconds."""

    ordering: str
    seed: int
    train_loss: list[float] = field(default_factory=list)
    metric: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def train(task: Task, ordering: str, seed: int) -> Run:
    """Train one model with one ordering; the weights depend only on the seed."""
    torch.manual_seed(seed)
    model = task.make_model()
    optimizer = task.make_optimizer(model)
    options = CONTENDERS[ordering]
    n = len(task.train_set)
    sampler: GraBSampler | None = None
    if options is not None:
        sampler = GraBSampler(
            task.train_set, model=model, seed=seed, batch_size=task.batch_size, **options
        )
        order_source = sampler
    elif ordering == "so":
        order_source = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        order_source = RandomSampler(task.train_set, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(task.train_set, batch_size=task.batch_size, sampler=order_source)
    run = Run(ordering, seed)
    for _ in range(task.epochs):
        model.train()
        start = time.perf_counter()
        for inputs, targets in loader:
            optimizer.zero_grad()
            task.loss(model, inputs, targets).backward()
            if sampler is not None:
                sampler.step()
            optimizer.step()
        run.seconds.append(time.perf_counter() - start)
        model.eval()
        run.train_loss.append(task.full_train_loss(model))
        run.metric.append(task.score(model))
    if sampler is not None:
        sampler.close()
    return run


def epoch_reaching(run: Run, target: float) -> int | None:
    """The first epoch (1-based) whose full-train loss is at or below ``target``, else None."""
    return next((e + 1 for e, loss in enumerate(run.train_loss) if loss <= target), None)


# ----------------------------------------------------------------------------------- reports
def report_task(task: Task, runs: list[Run], out: Path, tag: str | None) -> tuple[str, list[str]]:
    """The task's markdown section and its summary lines; writes its figure."""
    orderings = list(dict.fromkeys(r.ordering for r in runs))
    by = {o: [r for r in runs if r.ordering == o] for o in orderings}
    base = {r.seed: r for r in by[BASELINE]} if BASELINE in by else {}
    rows, summary = [], []
    base_seconds = (
        statistics.fmean(s for r in by.get(BASELINE, []) for s in r.seconds[1:] or r.seconds)
        if base
        else None
    )
    for o in orderings:
        final = [r.train_loss[-1] for r in by[o]]
        rel = [
            100 * (r.train_loss[-1] / base[r.seed].train_loss[-1] - 1)
            for r in by[o]
            if r.seed in base
        ]
        reach = [epoch_reaching(r, base[r.seed].train_loss[-1]) for r in by[o] if r.seed in base]
        reached = [e for e in reach if e is not None]
        secs = [statistics.fmean(r.seconds[1:] or r.seconds) for r in by[o]]
        reach_text = (
            f"{statistics.fmean(reached):.1f} ({min(reached)}-{max(reached)}), "
            f"{len(reached)}/{len(reach)} seeds"
            if reached
            else f"never (0/{len(reach)} seeds)"
        )
        rows.append(
            [
                o,
                mean_spread(final),
                mean_spread(rel, "{:+.2f}") + " %" if rel else "-",
                mean_spread([r.metric[-1] for r in by[o]], "{:.2f}"),
                reach_text,
                mean_spread(secs, "{:.2f}"),
                f"{statistics.fmean(secs) / base_seconds:.2f}x" if base_seconds else "-",
            ]
        )
        if o != BASELINE and rel:
            wins = sum(v < 0 for v in rel)
            summary.append(
                f"{task.name} {o}: final train loss {statistics.fmean(rel):+.2f}% vs rr "
                f"(lower in {wins}/{len(rel)} seeds), {task.metric} "
                f"{statistics.fmean(r.metric[-1] for r in by[o]):.2f} vs "
                f"{statistics.fmean(r.metric[-1] for r in by[BASELINE]):.2f}, "
                f"{statistics.fmean(secs) / base_seconds:.2f}x rr's time per epoch"
            )
    seeds = len(by[orderings[0]])
    table = markdown_table(
        [
            "ordering",
            f"final train loss (epoch {task.epochs})",
            "vs rr, same seed",
            task.metric,
            f"first epoch at rr's final loss (mean, range; of {seeds})",
            "s / epoch",
            "time vs rr",
        ],
        rows,
    )
    per_epoch = markdown_table(
        ["ordering", *(str(e + 1) for e in range(task.epochs))],
        [
            [
                o,
                *(
                    f"{statistics.fmean(r.train_loss[e] for r in by[o]):.4f}"
                    for e in range(task.epochs)
                ),
            ]
            for o in orderings
        ],
    )
    plot = plot_task(task, by, out, seeds, tag)
    text = (
        f"### {task.name}: {task.description}\n\n"
        f"Batch {task.batch_size}, {task.epochs} epochs, {seeds} seeds (0-{seeds - 1}); "
        "± is half the min-max range over seeds; seconds: the training loop of epochs 2 onward "
        "(epoch 1 where there is one), 1 thread.\n\n"
        f"{table}\n\nFull-train loss after each epoch (mean over seeds):\n\n{per_epoch}\n\n"
        f"![{task.name}]({plot.name})\n"
    )
    return text, summary


def plot_task(
    task: Task, by: dict[str, list[Run]], out: Path, seeds: int, tag: str | None = None
) -> Path:
    figure, axes = new_figure(1, 3, width=4.6, height=3.4)
    base = {r.seed: r for r in by.get(BASELINE, [])}
    epochs = list(range(1, task.epochs + 1))
    for k, (o, runs) in enumerate(by.items()):
        color, style = f"C{k}", "--" if o == BASELINE else "-"
        series = {
            0: [r.train_loss for r in runs],
            1: [
                [
                    100 * (v / b - 1)
                    for v, b in zip(r.train_loss, base[r.seed].train_loss, strict=True)
                ]
                for r in runs
                if r.seed in base
            ],
            2: [r.metric for r in runs],
        }
        for j, values in series.items():
            if not values:
                continue
            columns = list(zip(*values, strict=True))
            mean = [statistics.fmean(c) for c in columns]
            axes[0][j].plot(epochs, mean, style, color=color, marker="o", ms=3, label=o)
            axes[0][j].fill_between(
                epochs,
                [min(c) for c in columns],
                [max(c) for c in columns],
                color=color,
                alpha=0.15,
            )
    titles = ["full-train loss", "train loss relative to rr (same seed)", task.metric]
    ylabels = ["loss (log scale)", "% vs rr (below 0 = lower loss)", task.metric]
    for j in range(3):
        ax = axes[0][j]
        ax.set_title(titles[j], fontsize=10)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabels[j])
        ax.grid(alpha=0.3)
    axes[0][0].set_yscale("log")
    axes[0][0].legend(title="ordering", fontsize=8)
    figure.suptitle(f"Ordering, {task.description}", fontsize=11)
    return save_figure(
        figure,
        out,
        f"ordering_{task.name}{'_' + tag if tag else ''}.png",
        f"Lines: mean over {seeds} seeds; bands: min to max over the seeds. Epoch 1 is a random "
        "permutation for every ordering (GraB orders from epoch 2 on).",
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(
        __doc__,
        argv,
        {
            "--task": {"default": "mnist,cifar,wikitext", "help": "comma-separated tasks"},
            "--tag": {"default": None, "help": "suffix for the report and figure names"},
            "--orderings": {
                "default": None,
                "help": f"comma-separated contenders (default: all of {list(CONTENDERS)}, "
                f"recursive only on mnist)",
            },
        },
    )
    seeds = args.seeds or (1 if args.quick or args.synthetic else 5)
    chosen = [o for o in (args.orderings or ",".join(CONTENDERS)).split(",") if o]
    unknown = sorted(set(chosen) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"unknown ordering(s) {unknown}; available: {list(CONTENDERS)}")
    sections, summary = [], []
    tasks = [t for t in args.task.split(",") if t]
    for name in tasks:
        task = make_task(name, args.quick, args.synthetic)
        orderings = chosen
        if args.orderings is None and name in WITHOUT_RECURSIVE:
            orderings = [o for o in chosen if o != "recursive"]
        runs = []
        for seed in range(seeds):
            for ordering in orderings:
                start = time.perf_counter()
                runs.append(train(task, ordering, seed))
                print(
                    f"{name} seed {seed} {ordering}: final loss {runs[-1].train_loss[-1]:.4f} "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
        text, lines = report_task(task, runs, args.out, args.tag)
        sections.append(text)
        summary += lines
    header = (
        "## Ordering: GraB vs random reshuffling on real data\n\n"
        f"Command: `{command_line('ordering', args, ['task', 'orderings', 'seeds', 'tag'])}`  \n"
        f"Machine: {machine_description()}\n\n"
        + "\n".join(f"- {line}" for line in summary)
        + "\n\n"
    )
    stem = (
        "ordering"
        if set(tasks) == {"mnist", "cifar", "wikitext"}
        else f"ordering_{'_'.join(tasks)}"
    )
    write_report(
        args.out, f"{stem}{'_' + args.tag if args.tag else ''}.md", header + "\n".join(sections)
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
