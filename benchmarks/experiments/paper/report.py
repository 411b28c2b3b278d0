"""Tables and figures from whatever run records exist: ``python -m benchmarks.experiments.paper
--report [--out DIR]``.

Per task, runs are compared at one epoch E: the planned number where some seed's rr run and
another ordering's run both finished, else the furthest epoch both reached; each ordering is
reported over its seeds whose run and rr's run of the same seed reached E (runs still short of it
are listed beside the table).
Writes ``<task>.md`` and ``<task>.png`` per task and ``README.md`` (the summary) into the folder.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.experiments.common import markdown_table, mean_spread, new_figure, save_figure
from benchmarks.experiments.paper.records import RESULTS, TASKS, RunRecord, read_records

TASK_TITLES = {
    "mnist": "MNIST logistic regression",
    "cifar": "LeNet on CIFAR-10",
    "lstm": "2-layer LSTM LM on Penn Treebank",
}
BASELINE = "rr"
ORDERING_NOTES = {
    "rr": "random reshuffling (plain loop)",
    "mean": "GraB, grabkit's default (single examples, random epoch 1)",
    "pair": "pair balance, grabkit's default (single examples, random epoch 1)",
    "mean-units": "GraB as the authors ran it (micro-batch units, epoch 1 in dataset order)",
    "pair-units": "pair balance on the authors' units (micro-batches, epoch 1 in dataset order)",
}
LSTM_NOTES = {
    "mean": "GraB over bptt chunks, epoch 1 in dataset order (the authors')",
    "pair": "pair balance over bptt chunks, epoch 1 in dataset order",
}


COMMANDS = """## Commands

Each task command runs its (ordering, seed) runs one after another and resumes any that stopped
(`--quick`: 2 epochs of one seed into `benchmarks/out/paper-quick`):

```bash
python -m benchmarks.experiments.paper mnist --orderings=rr,mean,pair,mean-units --seeds=0-4
python -m benchmarks.experiments.paper cifar --orderings=rr,pair,pair-units --seeds=0-2 --epochs=30
python -m benchmarks.experiments.paper lstm --orderings=rr,mean --seeds=0-2
```

The runs here went through the queue, two single-threaded runs at a time, seeds interleaved:

```bash
nice -n 19 python -m benchmarks.experiments.paper queue --jobs 2 --log queue.log \\
  "mnist --orderings=rr,mean,pair --seeds=0-4" "mnist --orderings=mean-units --seeds=0-2" \\
  "cifar --orderings=rr,pair --seeds=0-2 --epochs=30" "mnist --orderings=mean-units --seeds=3-4" \\
  "cifar --orderings=pair-units --seeds=0-2 --epochs=30" "lstm --orderings=rr,mean --seeds=0-2" \\
  "mnist --orderings=pair-units --seeds=0-4"
```

The authors' full 100 CIFAR-10 epochs on a GPU (its own results folder; then `--report --out`
that folder):

```bash
python -m benchmarks.experiments.paper cifar --orderings=rr,pair,pair-units --seeds=0-2 \\
  --epochs=100 --device=cuda --out=benchmarks/experiments/results/paper-gpu
```
"""


@dataclass
class Comparison:
    """The runs of one task compared at ``epoch``: ``by[ordering][seed]``, every run there has
    reached ``epoch`` and (but for rr's own) so has rr's run of the same seed."""

    task: str
    epoch: int
    planned: int
    by: dict[str, dict[int, RunRecord]]
    pending: list[RunRecord]

    @property
    def seeds(self) -> list[int]:
        """Every seed in the comparison."""
        return sorted({s for runs in self.by.values() for s in runs})


def compare(task: str, records: list[RunRecord]) -> Comparison | None:
    """Compare at the planned epoch when some seed has rr and another ordering there, else at
    the furthest epoch that some seed's rr and other ordering both reached."""
    base = {r.seed: r for r in records if r.ordering == BASELINE}
    paired = [
        min(len(r.epochs), len(base[r.seed].epochs))
        for r in records
        if r.ordering != BASELINE and r.seed in base
    ]
    if not paired or max(paired) == 0:
        return None
    planned = max(r.epochs_planned for r in records)
    epoch = min(max(paired), planned)
    orderings = sorted({r.ordering for r in records}, key=lambda o: (o != BASELINE, o))
    by: dict[str, dict[int, RunRecord]] = {o: {} for o in orderings}
    pending = []
    for r in records:
        ready = len(r.epochs) >= epoch and len(base.get(r.seed, r).epochs) >= epoch
        if ready and r.seed in base:
            by[r.ordering][r.seed] = r
        else:
            pending.append(r)
    by = {o: dict(sorted(runs.items())) for o, runs in by.items() if runs}
    return Comparison(task, epoch, planned, by, pending)


def _epoch_reaching(losses: list[float], target: float, upto: int) -> int | None:
    return next((e + 1 for e, v in enumerate(losses[:upto]) if v <= target), None)


def _time_to_reach(run: RunRecord, base: RunRecord, upto: int) -> float | None:
    """CPU seconds ``run`` trained until its loss first reached ``base``'s at epoch ``upto``, as
    a fraction of ``base``'s CPU seconds over those ``upto`` epochs (None: never reached)."""
    epoch = _epoch_reaching(run.series("train_loss"), base.epochs[upto - 1]["train_loss"], upto)
    if epoch is None:
        return None
    return sum(run.series("cpu_s")[:epoch]) / sum(base.series("cpu_s")[:upto])


def _signed_spread(values: list[float]) -> str:
    """``+mean ± half-range`` with the sign on the mean only."""
    if len(values) == 1:
        return f"{values[0]:+.2f}"
    return f"{statistics.fmean(values):+.2f} ± {(max(values) - min(values)) / 2:.2f}"


def _per_epoch_mean(runs: list[RunRecord], key: str, upto: int) -> float:
    return statistics.fmean(statistics.fmean(r.series(key)[:upto]) for r in runs)


def summary_rows(c: Comparison) -> tuple[list[list[str]], list[str]]:
    """The main table's rows and one summary sentence per GraB ordering."""
    E = c.epoch
    base = c.by.get(BASELINE, {})
    base_cpu = _per_epoch_mean(list(base.values()), "cpu_s", E) if base else None
    metric = next(iter(next(iter(c.by.values())).values())).metric
    rows, sentences = [], []
    for o, runs in c.by.items():
        seeds = list(runs)
        final = [runs[s].epochs[E - 1]["train_loss"] for s in seeds]
        test = [runs[s].epochs[E - 1]["test_metric"] for s in seeds]
        rel = [
            100 * (f / base[s].epochs[E - 1]["train_loss"] - 1)
            for f, s in zip(final, seeds, strict=True)
        ]
        below = sum(v < 0 for v in rel)
        reach = [
            _epoch_reaching(runs[s].series("train_loss"), base[s].epochs[E - 1]["train_loss"], E)
            for s in seeds
        ]
        got = [e for e in reach if e is not None]
        fractions = [_time_to_reach(runs[s], base[s], E) for s in seeds] if base else []
        timed = [f for f in fractions if f is not None]
        cpu = _per_epoch_mean(list(runs.values()), "cpu_s", E)
        wall = _per_epoch_mean(list(runs.values()), "wall_s", E)
        is_base = o == BASELINE
        rows.append([
            o, str(len(seeds)), mean_spread(final),
            "-" if is_base else _signed_spread(rel) + " %",
            "-" if is_base else f"{below}/{len(rel)}", mean_spread(test, "{:.2f}"),
            "-" if is_base else (
                f"{statistics.fmean(got):.1f} ({min(got)}-{max(got)}), {len(got)}/{len(reach)}"
                if got else f"never (0/{len(reach)})"
            ),
            "-" if is_base else (mean_spread(timed, "{:.2f}") + f"x, {len(timed)}/{len(reach)}"
                                 if timed else "never"),
            f"{cpu:.2f}", f"{wall:.2f}", f"{cpu / base_cpu:.2f}x" if base_cpu else "-",
        ])  # fmt: skip
        if not is_base and base:
            sentences.append(
                f"{TASK_TITLES[c.task]}, {o} vs rr at epoch {E} ({len(seeds)} seed"
                f"{'s' if len(seeds) != 1 else ''}): final "
                f"train loss {statistics.fmean(rel):+.2f}% (lower in {below}/{len(rel)} seeds), "
                f"{metric} {statistics.fmean(test):.2f} vs "
                f"{statistics.fmean(base[s].epochs[E - 1]['test_metric'] for s in seeds):.2f}, "
                f"rr's final loss reached in {len(got)}/{len(reach)} seeds"
                + (
                    f" (epoch {statistics.fmean(got):.1f} on average, after "
                    f"{statistics.fmean(timed):.2f}x rr's CPU time for {E} epochs)"
                    if got
                    else ""
                )
                + f", {cpu / base_cpu:.2f}x rr's CPU time per epoch"
            )
    return rows, sentences


def task_section(c: Comparison, figure: Path) -> tuple[str, list[str]]:
    rows, sentences = summary_rows(c)
    first = next(iter(next(iter(c.by.values())).values()))
    E = c.epoch
    header = [
        "ordering", "seeds", f"train loss, epoch {E}", "vs rr (same seed)", "GraB below rr",
        first.metric, "first epoch at rr's final loss (mean, range, seeds)",
        "CPU time to rr's final loss / rr's CPU time",
        "CPU s / epoch", "wall s / epoch", "CPU vs rr",
    ]  # fmt: skip
    marks = sorted({1, 2, 5, *range(10, E + 1, 10), E} & set(range(1, E + 1)))
    per_epoch = markdown_table(
        ["ordering", *(f"epoch {e}" for e in marks)],
        [
            [o, *(f"{statistics.fmean(r.epochs[e - 1]['train_loss'] for r in runs.values()):.4f}"
                  for e in marks)]
            for o, runs in c.by.items()
        ],
    )  # fmt: skip
    notes = LSTM_NOTES if c.task == "lstm" else {}
    legend = "\n".join(f"- `{o}`: {notes.get(o, ORDERING_NOTES.get(o, o))}" for o in c.by)
    settings = ", ".join(f"{k} {v}" for k, v in first.settings.items() if k != "synthetic")
    revisions = sorted({r.revision[:12] for runs in c.by.values() for r in runs.values()})
    pending = (
        "\n\nStill running or incomplete (not in the table): "
        + ", ".join(
            f"{r.ordering} seed {r.seed} ({len(r.epochs)}/{r.epochs_planned})" for r in c.pending
        )
        if c.pending
        else ""
    )
    status = "" if c.planned == E else f" **(partial: {E} of {c.planned} epochs so far)**"
    where = (
        f"on {first.settings['device']} (wall seconds; CPU seconds are the host process's)"
        if "device" in first.settings
        else "one thread, at low priority on a shared 2-core machine (process CPU seconds barely "
        "depend on the other load; wall seconds do)"
    )
    text = (
        f"## {TASK_TITLES[c.task]}{status}\n\n"
        f"Settings: {settings}.  \n"
        f"Seeds {c.seeds} (each ordering: the seeds whose run and rr's reached epoch {E}); ± is "
        f"half the min-max range over seeds; every ordering of a seed starts "
        f"from the same weights. Time: the training loop of each epoch (evaluation excluded), "
        f"mean over epochs 1-{E}, {where}. grabkit revision (where each run started) "
        f"{', '.join(revisions)}; host {first.host}, torch {first.torch_version}.\n\n"
        f"{legend}\n\n{markdown_table(header, rows)}\n\n"
        f"Full-train loss (mean over seeds):\n\n{per_epoch}{pending}\n\n"
        f"![{c.task}]({figure.name})\n"
    )
    return text, sentences


def _band(ax, x: list[float], columns: list[tuple[float, ...]], color: str, style: str, label):
    ax.plot(x, [statistics.fmean(c) for c in columns], style, color=color, label=label, lw=1.4)
    ax.fill_between(x, [min(c) for c in columns], [max(c) for c in columns],
                    color=color, alpha=0.15, lw=0)  # fmt: skip


def plot(c: Comparison, out: Path) -> Path:
    """Loss against epochs and against CPU seconds, loss relative to rr, the test metric."""
    figure, axes = new_figure(1, 4, width=4.3, height=3.4)
    E = c.epoch
    epochs = list(range(1, E + 1))
    base = c.by.get(BASELINE, {})
    metric = ""
    for k, (o, runs) in enumerate(c.by.items()):
        color, style = f"C{k}", "--" if o == BASELINE else "-"
        seeds = list(runs)
        loss = list(zip(*(runs[s].series("train_loss")[:E] for s in seeds), strict=True))
        _band(axes[0][0], epochs, loss, color, style, o)
        cpu = [list(_cumulative(runs[s].series("cpu_s")[:E])) for s in seeds]
        seconds = [statistics.fmean(col) for col in zip(*cpu, strict=True)]
        _band(axes[0][1], seconds, loss, color, style, o)
        if base:
            rel = [
                [100 * (v / b - 1) for v, b in zip(runs[s].series("train_loss")[:E],
                                                    base[s].series("train_loss")[:E], strict=True)]
                for s in seeds
            ]  # fmt: skip
            _band(axes[0][2], epochs, list(zip(*rel, strict=True)), color, style, o)
        test = list(zip(*(runs[s].series("test_metric")[:E] for s in seeds), strict=True))
        _band(axes[0][3], epochs, test, color, style, o)
        metric = runs[seeds[0]].metric
    titles = ["full-train loss vs epochs", "full-train loss vs CPU seconds",
              "train loss vs rr, same seed (%)", metric]  # fmt: skip
    xlabels = ["epoch", "training CPU seconds (cumulative, mean over seeds)", "epoch", "epoch"]
    for ax, title, xlabel in zip(axes[0], titles, xlabels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_yscale("log")
    axes[0][1].set_yscale("log")
    axes[0][2].axhline(0, color="0.5", lw=0.8)
    axes[0][0].legend(title="ordering", fontsize=8)
    counts = ", ".join(f"{o} {len(runs)}" for o, runs in c.by.items())
    figure.suptitle(f"{TASK_TITLES[c.task]}, {E} epochs; seeds: {counts}", fontsize=11)
    return save_figure(
        figure, out, f"{c.task}.png",
        "Lines: mean over seeds; bands: min to max over seeds. Second panel: x is each "
        "ordering's own cumulative training CPU time (one thread), so a costlier ordering's "
        "curve is stretched to the right.",
    )  # fmt: skip


def _cumulative(values: list[float]):
    total = 0.0
    for v in values:
        total += v
        yield total


def _siblings(out: Path) -> str:
    """Links to the other results folders beside ``out`` (runs made elsewhere, a GPU say)."""
    others = sorted(p.name for p in out.parent.iterdir() if p != out and (p / "runs").is_dir())
    links = ", ".join(f"[{name}](../{name}/README.md)" for name in others)
    return f"\n\nOther results folders: {links}." if others else ""


def build(out: Path, tasks: Sequence[str]) -> list[str]:
    """Write every task's section and figure and the summary; returns the summary lines."""
    summary, sections = [], []
    for task in tasks:
        comparison = compare(task, read_records(out, task))
        if comparison is None:
            continue
        figure = plot(comparison, out)
        text, sentences = task_section(comparison, figure)
        (out / f"{task}.md").write_text(text)
        sections.append(f"- [{TASK_TITLES[task]}]({task}.md)")
        summary += sentences
    # a results folder made elsewhere (a GPU host) says how in its NOTES.md, which replaces the
    # commands of the CPU runs
    notes = out / "NOTES.md"
    settings = "SETTINGS.md" if (out / "SETTINGS.md").exists() else f"../{RESULTS.name}/SETTINGS.md"
    readme = (
        "# GraB at its authors' settings\n\n"
        f"Settings, their sources and how grabkit's defaults differ: [SETTINGS.md]({settings}). "
        "Rebuild from the run records (`runs/<task>/<ordering>-seed<k>.json`, one per run, "
        "rewritten after every epoch): `python -m benchmarks.experiments.paper --report`.\n\n"
        + "\n".join(f"- {line}" for line in summary)
        + "\n\nPer task:\n\n"
        + "\n".join(sections)
        + _siblings(out)
        + "\n\n"
        + (notes.read_text() if notes.exists() else COMMANDS)
    )
    (out / "README.md").write_text(readme)
    print(readme)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.paper --report")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args(list(argv or []))
    build(args.out, [t for t in args.tasks.split(",") if t])
    return 0
