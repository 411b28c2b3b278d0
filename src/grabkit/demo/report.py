"""The demo's outputs: a per-epoch table (means over seeds) and a PNG of the curves."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grabkit.demo.deps import require
from grabkit.demo.recipe import EpochResult

__all__ = [
    "BASELINE",
    "METRICS",
    "RELATIVE_LOSS",
    "SummaryRow",
    "format_final_comparison",
    "format_summary_line",
    "format_table",
    "summarize",
    "write_plot",
]

#: the ordering every other one is compared with: random reshuffling
BASELINE = "rr"

#: metric attribute -> (column heading, plot title)
METRICS = {
    "train_loss": ("train loss", "training loss (full train set)"),
    "test_accuracy": ("test acc", "test accuracy"),
    "herding_bound": ("herding bound", "herding bound of the epoch"),
    "seconds": ("seconds", "seconds per epoch"),
}

#: derived metric: 100 * (train loss / the baseline's train loss of the same seed and epoch - 1),
#: present in a row's dicts only when the baseline ran for every seed of that row
RELATIVE_LOSS = "train_loss_vs_baseline"


@dataclass(frozen=True)
class SummaryRow:
    """One (model, ordering, epoch): each metric's mean, min and max over the seeds.

    The dicts hold every key of ``METRICS`` and, where the baseline ran, ``RELATIVE_LOSS``.
    """

    model: str
    ordering: str
    epoch: int
    seeds: int
    mean: dict[str, float]
    low: dict[str, float]
    high: dict[str, float]


def summarize(results: Sequence[EpochResult], baseline: str = BASELINE) -> list[SummaryRow]:
    """Group the epochs of all runs by (model, ordering, epoch), keeping first-seen order.

    The relative loss is taken seed by seed (same initial weights, same first epoch) before
    averaging, so the seed-to-seed spread of the absolute loss does not hide a consistent gap.
    """
    groups: dict[tuple[str, str, int], list[EpochResult]] = defaultdict(list)
    base_loss: dict[tuple[str, int, int], float] = {}
    for result in results:
        groups[(result.model, result.ordering, result.epoch)].append(result)
        if result.ordering == baseline:
            base_loss[(result.model, result.seed, result.epoch)] = result.train_loss
    rows = []
    for (model, ordering, epoch), members in groups.items():
        values = {m: [getattr(r, m) for r in members] for m in METRICS}
        bases = [base_loss.get((r.model, r.seed, r.epoch)) for r in members]
        if all(b is not None and b > 0 for b in bases):
            values[RELATIVE_LOSS] = [
                100.0 * (r.train_loss / b - 1.0) for r, b in zip(members, bases, strict=True)
            ]
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


def _last_epoch_against(
    rows: Sequence[SummaryRow], baseline: str
) -> tuple[dict[str, int], dict[str, dict[str, float]], list[SummaryRow]]:
    """(model -> its last epoch, model -> ``baseline``'s means there, the other orderings'
    rows at that epoch, for models where ``baseline`` ran)."""
    models = {r.model for r in rows}
    last = {model: max(r.epoch for r in rows if r.model == model) for model in models}
    final = [r for r in rows if r.epoch == last[r.model]]
    base = {r.model: r.mean for r in final if r.ordering == baseline}
    return last, base, [r for r in final if r.ordering != baseline and r.model in base]


def format_summary_line(rows: Sequence[SummaryRow], baseline: str = BASELINE) -> str:
    """One line saying what the run shows: the other orderings' last-epoch train loss and
    herding bound relative to ``baseline``, ranges over models and orderings (means over seeds).

    Says what is missing instead when the baseline or a second ordering was not run.
    """
    last, base, others = _last_epoch_against(rows, baseline)
    if not others:
        return (
            f"In short: no comparison to show (run {baseline} and at least one other ordering "
            "to see GraB against random reshuffling)."
        )
    losses = [r.mean[RELATIVE_LOSS] for r in others]
    bounds = [r.mean["herding_bound"] / base[r.model]["herding_bound"] for r in others]
    epochs = sorted(set(last.values()))
    epoch = f"epoch {epochs[0]}" if len(epochs) == 1 else "the last epoch"
    return (
        f"In short: at {epoch}, {'/'.join(dict.fromkeys(r.ordering for r in others))} end with "
        f"train loss {min(losses):+.1f}% to "
        f"{max(losses):+.1f}% vs {baseline} (negative = better) and their herding bound is "
        f"{min(bounds):.2f}x to {max(bounds):.2f}x {baseline}'s (lower = the order tracks the "
        "full gradient more closely); means over seeds."
    )


def write_plot(rows: Sequence[SummaryRow], path: Path, baseline: str = BASELINE) -> None:
    """PNG: one row of panels per model, a line per ordering, the band explained in a caption.

    Panels: train loss relative to ``baseline`` (seed by seed, so a gap shows even when the
    absolute curves overlap; the absolute loss when the baseline did not run), test accuracy and
    the herding bound. Lines are means over the seeds; the shaded band spans the seeds' min to
    max. Uses matplotlib's Agg canvas directly, so no display and no global pyplot state.
    """
    require("matplotlib", "matplotlib")
    backend_agg = require("matplotlib.backends.backend_agg", "matplotlib")
    figure_module = require("matplotlib.figure", "matplotlib")

    models = list(dict.fromkeys(row.model for row in rows))
    orderings = list(dict.fromkeys(row.ordering for row in rows))
    seeds = max(row.seeds for row in rows)
    panels = _panels(rows, baseline)
    figure = figure_module.Figure(figsize=(4.6 * len(panels), 3.4 * len(models) + 1.3), dpi=100)
    backend_agg.FigureCanvasAgg(figure)
    axes = figure.subplots(len(models), len(panels), squeeze=False)
    colors = {o: f"C{k}" for k, o in enumerate(orderings)}
    for i, model in enumerate(models):
        series = {o: [r for r in rows if (r.model, r.ordering) == (model, o)] for o in orderings}
        for j, (metric, (ylabel, title)) in enumerate(panels.items()):
            ax = axes[i][j]
            _draw_metric(ax, series, metric, colors, baseline)
            ax.axvspan(0.5, 1.5, color="0.85", alpha=0.5, lw=0)
            ax.set_title(f"{model}: {title}", fontsize=9.5)
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
            if metric == "train_loss":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(
        handles,
        labels,
        loc="lower center",
        ncol=min(len(labels), 6),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    figure.suptitle(
        f"GraB example orderings vs random reshuffling ({baseline}), {', '.join(models)}",
        fontsize=12,
    )
    figure.text(
        0.5,
        0.055,
        f"Lines: mean over {seeds} seed(s); shaded bands: min to max over the seeds. Grey: epoch 1 "
        "visits a random permutation under every ordering (GraB's order starts at epoch 2).\n"
        "Herding bound: max over prefixes of ||sum of centred per-example gradients||_inf in "
        "visit order; GraB lowers it, and a lower bound is what makes each epoch track the full "
        "gradient.",
        ha="center",
        va="bottom",
        fontsize=8,
        color="0.25",
    )
    figure.tight_layout(rect=(0, 0.12 + 0.02 * (len(models) == 1), 1, 0.95))
    figure.savefig(path, format="png")


def _panels(rows: Sequence[SummaryRow], baseline: str) -> dict[str, tuple[str, str]]:
    """metric -> (y label, title) of each panel: the train loss relative to ``baseline`` when
    every row has it (else the absolute loss), test accuracy, herding bound."""
    relative = all(RELATIVE_LOSS in row.mean for row in rows)
    loss = (
        (
            RELATIVE_LOSS,
            f"train loss vs {baseline} (%)",
            f"train loss relative to {baseline}\n(below 0 = lower loss than {baseline})",
        )
        if relative
        else ("train_loss", "train loss (log scale)", "train loss (full train set)")
    )
    return {
        loss[0]: loss[1:],
        "test_accuracy": ("test accuracy (%)", "test accuracy"),
        "herding_bound": (
            "herding bound",
            "herding bound of the epoch's order\n(lower = better balanced; GraB's target)",
        ),
    }


def _draw_metric(
    ax: Any,
    series: dict[str, list[SummaryRow]],
    metric: str,
    colors: dict[str, str],
    baseline: str,
) -> None:
    """One panel: per ordering, the mean over seeds as a line and the min-max as a band."""
    factor = 100.0 if metric == "test_accuracy" else 1.0
    for ordering, rows in series.items():
        epochs = [r.epoch for r in rows]
        ax.plot(
            epochs,
            [factor * r.mean[metric] for r in rows],
            "--" if ordering == baseline else "-",
            marker="o",
            ms=3,
            color=colors[ordering],
            label=f"{ordering} (mean)",
        )
        ax.fill_between(
            epochs,
            [factor * r.low[metric] for r in rows],
            [factor * r.high[metric] for r in rows],
            color=colors[ordering],
            alpha=0.18,
            label=f"{ordering} (min-max over seeds)",
        )
