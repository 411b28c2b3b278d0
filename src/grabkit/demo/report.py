"""The demo's outputs: a per-epoch table (means over seeds) and a PNG of the curves."""

from __future__ import annotations

import itertools
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
    "ELAPSED",
    "METRICS",
    "RELATIVE_LOSS",
    "SummaryRow",
    "format_final_comparison",
    "format_summary_line",
    "format_table",
    "loss_at_baseline_time",
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

#: derived metric: training seconds from the run's start to the end of this epoch (the sum of
#: ``seconds`` over epochs 1..epoch of the same seed), the x axis of loss against time
ELAPSED = "elapsed_seconds"


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
    elapsed = _elapsed(results)
    for result in results:
        groups[(result.model, result.ordering, result.epoch)].append(result)
        if result.ordering == baseline:
            base_loss[(result.model, result.seed, result.epoch)] = result.train_loss
    rows = []
    for (model, ordering, epoch), members in groups.items():
        values = {m: [getattr(r, m) for r in members] for m in METRICS}
        values[ELAPSED] = [elapsed[id(r)] for r in members]
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


def _elapsed(results: Sequence[EpochResult]) -> dict[int, float]:
    """id(result) -> seconds of its run (model, ordering, seed) up to the end of its epoch."""
    runs: dict[tuple[str, str, int], list[EpochResult]] = defaultdict(list)
    for result in results:
        runs[(result.model, result.ordering, result.seed)].append(result)
    out = {}
    for members in runs.values():
        total = 0.0
        for result in sorted(members, key=lambda r: r.epoch):
            total += result.seconds
            out[id(result)] = total
    return out


def loss_at_baseline_time(
    results: Sequence[EpochResult], baseline: str = BASELINE
) -> dict[tuple[str, str], list[float | None]]:
    """(model, ordering) -> per seed, 100 * (its train loss once it has trained as many seconds
    as ``baseline`` took for all its epochs / ``baseline``'s final train loss - 1).

    The loss at that time is interpolated linearly between the ends of the two epochs around
    it (the last epoch's loss when the ordering finished sooner); ``None`` for a seed whose
    first epoch ended after the baseline had finished, where nothing can be said.
    """
    elapsed = _elapsed(results)
    runs: dict[tuple[str, str, int], list[EpochResult]] = defaultdict(list)
    for result in results:
        runs[(result.model, result.ordering, result.seed)].append(result)
    out: dict[tuple[str, str], list[float | None]] = defaultdict(list)
    for (model, ordering, seed), members in runs.items():
        base = runs.get((model, baseline, seed))
        if ordering == baseline or not base:
            continue
        base_last = max(base, key=lambda r: r.epoch)
        budget = elapsed[id(base_last)]
        curve = [(elapsed[id(r)], r.train_loss) for r in sorted(members, key=lambda r: r.epoch)]
        out[(model, ordering)].append(
            None
            if curve[0][0] > budget
            else 100.0 * (_interpolate(curve, budget) / base_last.train_loss - 1.0)
        )
    return dict(out)


def _interpolate(curve: list[tuple[float, float]], x: float) -> float:
    """y at ``x`` on the polyline ``curve`` ((x, y) with x increasing, x >= curve[0][0])."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1]


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


def format_summary_line(
    rows: Sequence[SummaryRow],
    baseline: str = BASELINE,
    results: Sequence[EpochResult] | None = None,
) -> str:
    """One line saying what the run shows: the other orderings' last-epoch train loss and
    herding bound relative to ``baseline``, ranges over models and orderings (means over seeds),
    whether they win per epoch, and, given the ``results``, per second of training as well
    (``loss_at_baseline_time``) with their time per epoch relative to ``baseline``'s.

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
    line = (
        f"In short: at {epoch}, {'/'.join(dict.fromkeys(r.ordering for r in others))} end with "
        f"train loss {min(losses):+.1f}% to "
        f"{max(losses):+.1f}% vs {baseline} (negative = better; {_verdict(losses)} per epoch) "
        f"and their herding bound is {min(bounds):.2f}x to {max(bounds):.2f}x {baseline}'s "
        "(lower = the order tracks the full gradient more closely); means over seeds."
    )
    if results is None:
        return line
    return line + " " + _per_second_sentence(results, rows, base, others, baseline)


def _verdict(relative_losses: Sequence[float]) -> str:
    if max(relative_losses) < 0:
        return "GraB wins"
    if min(relative_losses) >= 0:
        return "GraB does not win"
    return "GraB wins in some settings only"


def _per_second_sentence(
    results: Sequence[EpochResult],
    rows: Sequence[SummaryRow],
    base: dict[str, dict[str, float]],
    others: Sequence[SummaryRow],
    baseline: str,
) -> str:
    """Per second: the loss at ``baseline``'s training time and the cost per epoch."""
    timed = loss_at_baseline_time(results, baseline)
    per_setting = [
        statistics.fmean(v) if all(x is not None for x in v) else None for v in timed.values() if v
    ]
    cost = [
        statistics.fmean(r.mean["seconds"] for r in rows if (r.model, r.ordering) == key)
        / statistics.fmean(
            r.mean["seconds"] for r in rows if (r.model, r.ordering) == (key[0], baseline)
        )
        for key in {(r.model, r.ordering) for r in others}
        if base.get(key[0], {}).get("seconds")
    ]
    costs = f"{min(cost):.1f}x to {max(cost):.1f}x {baseline}'s time per epoch" if cost else ""
    if not per_setting or any(v is None for v in per_setting):
        return (
            f"Per second: some runs had not finished one epoch in the time {baseline} took for "
            f"all of them ({costs}), so GraB does not win per second here."
        )
    return (
        f"Per second of training (at the time {baseline} took for all its epochs): train loss "
        f"{min(per_setting):+.1f}% to {max(per_setting):+.1f}% vs {baseline}'s final, so "
        f"{_verdict(per_setting)} per second ({costs})."
    )


def write_plot(
    rows: Sequence[SummaryRow],
    path: Path,
    baseline: str = BASELINE,
    results: Sequence[EpochResult] | None = None,
) -> None:
    """PNG: one row of panels per model, a line per ordering, the band explained in a caption.

    Panels: train loss relative to ``baseline`` (seed by seed, so a gap shows even when the
    absolute curves overlap; the absolute loss when the baseline did not run), train loss
    against training seconds (each ordering at its own cost; given the ``results``, one thin
    line per seed too), test accuracy and the herding bound. Lines are means over the seeds;
    the shaded band spans the seeds' min to max. Uses matplotlib's Agg canvas directly, so no
    display and no global pyplot state.
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
            if metric == ELAPSED:
                _draw_against_time(ax, series, colors, baseline, results or (), model)
                ax.set_xlabel("training seconds (cumulative)")
                ax.set_yscale("log")
            else:
                _draw_metric(ax, series, metric, colors, baseline)
                ax.axvspan(0.5, 1.5, color="0.85", alpha=0.5, lw=0)
                ax.set_xlabel("epoch")
            ax.set_title(f"{model}: {title}", fontsize=9.5)
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
        title="ordering (line: average over seeds; band: min to max over seeds)",
        title_fontsize=8,
    )
    figure.suptitle(
        f"GraB example orderings vs random reshuffling ({baseline}), {', '.join(models)}",
        fontsize=12,
    )
    figure.text(
        0.5,
        0.055,
        f"Lines: mean over {seeds} seed(s); shaded bands: min to max over the seeds; thin lines "
        "(against seconds): one seed each. Grey: epoch 1 visits a random permutation under every "
        "ordering (GraB's order starts at epoch 2).\n"
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
        ELAPSED: (
            "train loss (log scale)",
            "train loss against training seconds\n(each ordering at its own cost per epoch)",
        ),
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
            label=ordering,
        )
        ax.fill_between(
            epochs,
            [factor * r.low[metric] for r in rows],
            [factor * r.high[metric] for r in rows],
            color=colors[ordering],
            alpha=0.18,
            label="_band",
        )


def _draw_against_time(
    ax: Any,
    series: dict[str, list[SummaryRow]],
    colors: dict[str, str],
    baseline: str,
    results: Sequence[EpochResult],
    model: str,
) -> None:
    """Train loss against cumulative training seconds: per ordering, the mean over seeds at
    the seeds' mean time with the min-max band, and each seed's own curve as a thin line."""
    elapsed = _elapsed(results)
    for ordering, rows in series.items():
        style = "--" if ordering == baseline else "-"
        seconds = [r.mean[ELAPSED] for r in rows]
        ax.plot(
            seconds,
            [r.mean["train_loss"] for r in rows],
            style,
            marker="o",
            ms=3,
            color=colors[ordering],
            label=ordering,
        )
        ax.fill_between(
            seconds,
            [r.low["train_loss"] for r in rows],
            [r.high["train_loss"] for r in rows],
            color=colors[ordering],
            alpha=0.18,
            label="_band",
        )
        runs: dict[int, list[EpochResult]] = defaultdict(list)
        for result in results:
            if (result.model, result.ordering) == (model, ordering):
                runs[result.seed].append(result)
        for members in runs.values():
            members.sort(key=lambda r: r.epoch)
            ax.plot(
                [elapsed[id(r)] for r in members],
                [r.train_loss for r in members],
                style,
                lw=0.6,
                alpha=0.6,
                color=colors[ordering],
                label="_seed",
            )
