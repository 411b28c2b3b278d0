"""The demo's outputs: a per-epoch table (means over seeds) and a PNG of the curves."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grabkit.demo.deps import require
from grabkit.demo.recipe import EpochResult

__all__ = [
    "METRICS",
    "SummaryRow",
    "format_final_comparison",
    "format_table",
    "summarize",
    "write_plot",
]

#: metric attribute -> (column heading, plot title)
METRICS = {
    "train_loss": ("train loss", "training loss (full train set)"),
    "test_accuracy": ("test acc", "test accuracy"),
    "herding_bound": ("herding bound", "herding bound of the epoch"),
    "seconds": ("seconds", "seconds per epoch"),
}


@dataclass(frozen=True)
class SummaryRow:
    """One (model, ordering, epoch): each metric's mean, min and max over the seeds."""

    model: str
    ordering: str
    epoch: int
    seeds: int
    mean: dict[str, float]
    low: dict[str, float]
    high: dict[str, float]


def summarize(results: Sequence[EpochResult]) -> list[SummaryRow]:
    """Group the epochs of all runs by (model, ordering, epoch), keeping first-seen order."""
    groups: dict[tuple[str, str, int], list[EpochResult]] = defaultdict(list)
    for result in results:
        groups[(result.model, result.ordering, result.epoch)].append(result)
    rows = []
    for (model, ordering, epoch), members in groups.items():
        values = {m: [getattr(r, m) for r in members] for m in METRICS}
        rows.append(
            SummaryRow(
                model=model,
                ordering=ordering,
                epoch=epoch,
                seeds=len(members),
                mean={m: statistics.fmean(v) for m, v in values.items()},
                low={m: min(v) for m, v in values.items()},
                high={m: max(v) for m, v in values.items()},
            )
        )
    rows.sort(key=lambda row: (row.model, row.epoch))  # stable: orderings keep their order
    return rows


def format_table(rows: Sequence[SummaryRow]) -> str:
    """A plain-text table, one line per (model, epoch, ordering), means over the seeds."""
    header = ["model", "epoch", "ordering", *(heading for heading, _ in METRICS.values())]
    lines = []
    for row in rows:
        m = row.mean
        lines.append(
            [
                row.model,
                str(row.epoch),
                row.ordering,
                f"{m['train_loss']:.4f}",
                f"{100 * m['test_accuracy']:.1f}%",
                f"{m['herding_bound']:.3f}",
                f"{m['seconds']:.3f}",
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    left = {0, 2}  # text columns; numbers are right-aligned

    def render(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [render(header), render(["-" * w for w in widths])]
    previous = None
    for row, line in zip(rows, lines, strict=True):
        if previous is not None and (row.model, row.epoch) != previous:
            out.append("")
        out.append(render(line))
        previous = (row.model, row.epoch)
    return "\n".join(out)


def format_final_comparison(rows: Sequence[SummaryRow], baseline: str = "rr") -> str:
    """One line per model: each ordering's last-epoch train loss and herding bound vs ``baseline``.

    Empty when the baseline ordering was not run.
    """
    lines = []
    for model in dict.fromkeys(row.model for row in rows):
        last = max(row.epoch for row in rows if row.model == model)
        final = {row.ordering: row.mean for row in rows if row.model == model and row.epoch == last}
        if baseline not in final or len(final) < 2:
            continue
        base = final[baseline]
        parts = [
            f"{ordering} train loss {100 * (m['train_loss'] / base['train_loss'] - 1):+.1f}%, "
            f"herding bound {m['herding_bound'] / base['herding_bound']:.2f}x"
            for ordering, m in final.items()
            if ordering != baseline
        ]
        lines.append(f"{model}, epoch {last}, vs {baseline}: " + "; ".join(parts))
    return "\n".join(lines)


def write_plot(rows: Sequence[SummaryRow], path: Path) -> None:
    """PNG: one row of panels per model (loss, accuracy, herding bound), a line per ordering.

    Lines are means over the seeds; the shaded band spans the seeds' min to max. Uses
    matplotlib's Agg canvas directly, so no display and no global pyplot state is involved.
    """
    require("matplotlib", "matplotlib")
    backend_agg = require("matplotlib.backends.backend_agg", "matplotlib")
    figure_module = require("matplotlib.figure", "matplotlib")

    models = list(dict.fromkeys(row.model for row in rows))
    orderings = list(dict.fromkeys(row.ordering for row in rows))
    panels = ["train_loss", "test_accuracy", "herding_bound"]
    figure = figure_module.Figure(figsize=(4.2 * len(panels), 3.2 * len(models)), dpi=100)
    backend_agg.FigureCanvasAgg(figure)
    axes = figure.subplots(len(models), len(panels), squeeze=False)
    for i, model in enumerate(models):
        for j, metric in enumerate(panels):
            ax = axes[i][j]
            for ordering in orderings:
                series = [r for r in rows if r.model == model and r.ordering == ordering]
                epochs = [r.epoch for r in series]
                ax.plot(epochs, [r.mean[metric] for r in series], marker="o", ms=3, label=ordering)
                ax.fill_between(
                    epochs,
                    [r.low[metric] for r in series],
                    [r.high[metric] for r in series],
                    alpha=0.2,
                )
            ax.set_title(f"{model}: {METRICS[metric][1]}", fontsize=10)
            ax.set_xlabel("epoch")
            if metric == "train_loss":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    axes[0][0].legend(title="ordering")
    figure.tight_layout()
    figure.savefig(path, format="png")
