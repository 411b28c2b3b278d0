"""What every experiment shares: its command line, the results folder, tables and figures.

Every experiment runs single-threaded (``torch.set_num_threads(1)``: the machines are small and
shared, and one thread makes wall times comparable between contenders run one after another),
prints a markdown report and writes it, with its PNG figures, to ``results/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.experiments.data import DataMissing

RESULTS = Path(__file__).resolve().parent / "results"
#: where --quick and --synthetic runs write unless --out says otherwise (git-ignored), so that a
#: smoke run never overwrites the committed results
SCRATCH = Path(__file__).resolve().parents[1] / "out"


def parse_args(
    doc: str, argv: Sequence[str] | None, extra: dict | None = None
) -> argparse.Namespace:
    """``--quick`` (a smoke run of about a minute), ``--synthetic`` (tiny random data instead of
    ``../shared/data``, for tests), ``--out`` (folder for the report and figures) and
    ``--seeds``; ``extra`` maps further option names to ``add_argument`` keywords."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    parser.add_argument(
        "--synthetic", action="store_true", help="tiny random data instead of ../shared/data"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the .md and .png (default: results/, or benchmarks/out/experiments-quick "
        "for --quick and --synthetic runs)",
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per contender")
    for name, kwargs in (extra or {}).items():
        parser.add_argument(name, **kwargs)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.out is None:
        args.out = SCRATCH / "experiments-quick" if args.quick or args.synthetic else RESULTS
    return args


def command_line(module: str, args: argparse.Namespace, keys: Sequence[str] = ()) -> str:
    """The exact command that reproduces this report."""
    flags = [
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys if getattr(args, k) is not None
    ]
    flags += ["--quick"] * args.quick + ["--synthetic"] * args.synthetic
    return " ".join([f"python -m benchmarks.experiments.{module}", *flags])


def mean_spread(values: Sequence[float], fmt: str = "{:.4f}") -> str:
    """``mean ± half-range`` over seeds (min to max), or the value alone for one seed."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ± {fmt.format((max(values) - min(values)) / 2)}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def new_figure(rows: int, cols: int, width: float = 4.8, height: float = 3.6):
    """A matplotlib figure on the Agg canvas (no display, no global pyplot state) and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * cols, height * rows + 0.8), dpi=100)
    FigureCanvasAgg(figure)
    return figure, figure.subplots(rows, cols, squeeze=False)


def save_figure(figure, out: Path, name: str, caption: str | None = None) -> Path:
    """Add ``caption`` under the panels, lay out and write ``out/name``."""
    bottom = 0.0
    if caption:
        lines = caption.count("\n") + 1
        bottom = min(0.25, (0.25 + 0.16 * lines) / figure.get_figheight())
        figure.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=8, color="0.25")
    figure.tight_layout(rect=(0, bottom, 1, 0.96))
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    figure.savefig(path, format="png")
    return path


def write_report(out: Path, name: str, text: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(text.rstrip() + "\n", encoding="utf-8")
    print(text)
    print(f"\nwritten: {path}")
    return path


def run_main(main, argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` single-threaded; a missing dataset prints why and exits 0 (a skip)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        main(argv)
    except DataMissing as missing:
        print(f"skipped: {missing}")
        return 0
    finally:
        torch.set_num_threads(threads)
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    return 0
