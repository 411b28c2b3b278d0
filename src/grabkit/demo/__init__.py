"""``python -m grabkit demo``: GraB orderings against random reshuffling on scikit-learn's digits.

Trains each model with each ordering for each seed (``grabkit.demo.recipe`` is the training loop
to read), prints a per-epoch table of means over the seeds and writes a PNG of the curves. Needs
the demo extras (``pip install "grabkit[demo]"``: scikit-learn, matplotlib, tqdm), which are
imported only here, when the demo runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from grabkit.demo.deps import MissingDemoDependency, require
from grabkit.demo.digits import MODELS, DigitsSplit, load_digits_split
from grabkit.demo.recipe import EpochResult, RunSettings, train_run
from grabkit.demo.report import (
    SummaryRow,
    format_final_comparison,
    format_summary_line,
    format_table,
    summarize,
    write_plot,
)

__all__ = ["DEMO_ORDERINGS", "MODELS", "DemoOptions", "MissingDemoDependency", "run_demo"]

#: orderings that run on hook statistics alone (the others need dense per-example gradients
#: or a precomputed kernel, which the library accepts but this demo does not build)
DEMO_ORDERINGS = (
    "rr",
    "so",
    "swr",
    "fixed",
    "mean",
    "pair",
    "recursive",
    "recursive-pair",
    "batch",
    "ema",
    "norm",
    "flipflop",
)


def _check_names(option: str, names: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    if not names:
        raise ValueError(f"`{option}` should name at least one of {list(allowed)}, but got none")
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(
            f"`{option}` should be a comma-separated list drawn from {list(allowed)}, but got "
            f"unknown name(s) {unknown}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"`{option}` lists a name twice: {list(names)}")


@dataclass(frozen=True)
class DemoOptions:
    """The demo's settings (the command line's options); invalid values raise ValueError."""

    epochs: int = 8
    seeds: int = 3
    orderings: tuple[str, ...] = ("rr", "mean", "pair")
    models: tuple[str, ...] = ("logreg", "mlp")
    batch_size: int = 16
    lr: float = 0.1
    out: Path = Path("grabkit-demo.png")
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "seeds", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` should be a positive integer, but got {name}={value!r}")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not self.lr > 0:
            raise ValueError(f"`lr` should be a positive number, but got lr={self.lr!r}")
        _check_names("orderings", self.orderings, DEMO_ORDERINGS)
        _check_names("models", self.models, tuple(MODELS))
        if Path(self.out).suffix.lower() != ".png":
            raise ValueError(f"`out` should be a path ending in .png, but got out={self.out!s}")


def run_demo(options: DemoOptions, stdout: TextIO | None = None) -> list[EpochResult]:
    """Run every (model, seed, ordering), print the table, write the plot; returns all epochs.

    Runs of one seed follow each other ordering by ordering, so the machine's load drifts alike
    over all orderings and their seconds stay comparable.
    """
    stdout = sys.stdout if stdout is None else stdout
    tqdm = require("tqdm", "tqdm").tqdm
    data = load_digits_split()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 16 x 64 matrices: extra threads cost more than they save
    try:
        results = _train_all(data, options, tqdm)
    finally:
        torch.set_num_threads(threads)
    rows = summarize(results)
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_plot(rows, out, results=results)
    _print_report(data, options, rows, results, out, stdout)
    return results


def _train_all(data: DigitsSplit, options: DemoOptions, tqdm) -> list[EpochResult]:
    settings = RunSettings(epochs=options.epochs, batch_size=options.batch_size, lr=options.lr)
    runs = [
        (model, seed, ordering)
        for model in options.models
        for seed in range(options.seeds)
        for ordering in options.orderings
    ]
    results: list[EpochResult] = []
    with tqdm(total=len(runs) * options.epochs, unit="epoch", disable=not options.progress) as bar:
        for model, seed, ordering in runs:
            bar.set_description(f"{model} {ordering} seed {seed}")
            results += train_run(
                data, model, ordering, seed, settings, on_epoch=lambda _: bar.update()
            )
    return results


def _print_report(
    data: DigitsSplit,
    options: DemoOptions,
    rows: list[SummaryRow],
    results: list[EpochResult],
    out: Path,
    stdout: TextIO,
) -> None:
    n_train, n_test = len(data.train_set), len(data.test_targets)
    models = "; ".join(f"{name}: {MODELS[name][0]}" for name in options.models)
    print("grabkit demo: GraB example ordering vs random reshuffling (rr)", file=stdout)
    if options.epochs < 2:
        print(
            f"warning: --epochs {options.epochs}: epoch 1 visits a random permutation under "
            "every ordering (GraB's order first applies in epoch 2), so this run cannot show a "
            "difference; use --epochs 2 or more (default 8).",
            file=stdout,
        )
    print(
        f"scikit-learn digits, {n_train} train / {n_test} test images; {models}\n"
        f"orderings {', '.join(options.orderings)}; {options.seeds} seed(s) x {options.epochs} "
        f"epoch(s); batch {options.batch_size}, SGD lr {options.lr}; means over seeds\n",
        file=stdout,
    )
    print(format_table(rows), file=stdout)
    print(
        "\nherding bound: max over prefixes k of || sum_{t<=k} (g_t - mean g) ||_inf over the "
        "epoch's per-example\ngradients g_t in visit order (lower: the epoch's steps track the "
        "full gradient more closely).\nseconds: the epoch's training loop, measurement excluded. "
        "Epoch 1 is a random permutation under\nevery ordering: GraB decides the order of epoch "
        "2 onwards from the gradients it balanced the epoch before.",
        file=stdout,
    )
    comparison = format_final_comparison(rows)
    if comparison:
        print(f"\n{comparison}", file=stdout)
    print(f"\n{format_summary_line(rows, results=results)}", file=stdout)
    print(
        f"plot written to {out}: per model, train loss relative to rr, train loss against "
        "training seconds (per seed and their band), test accuracy and herding bound per epoch "
        "(lines: mean over seeds; bands: min-max over seeds)",
        file=stdout,
    )
