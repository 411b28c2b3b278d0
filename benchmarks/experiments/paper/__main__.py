"""Command line: one command per task, a queue of runs, and the report.

    python -m benchmarks.experiments.paper mnist [--orderings rr,mean,pair] [--seeds 0-4]
    python -m benchmarks.experiments.paper cifar --orderings rr,pair --seeds 0-2 --epochs 30
    python -m benchmarks.experiments.paper lstm --orderings rr,mean --seeds 0-2
    python -m benchmarks.experiments.paper queue --jobs 2 --log FILE -- "mnist ..." "cifar ..."
    python -m benchmarks.experiments.paper --report
    python -m benchmarks.experiments.paper cifar --orderings rr,pair,pair-units --seeds 0-2 \
        --epochs 100 --device cuda --out benchmarks/experiments/results/paper-gpu  # on a GPU

A task command trains each (ordering, seed) in turn, seeds outermost, resuming any run that
stopped. ``queue`` runs task commands' single runs as subprocesses, at most ``--jobs`` at once,
in the order given (each argument is one task command's options, expanded to single runs).
``--quick``: 2 epochs, one seed, into the scratch folder ``benchmarks/out/paper-quick``;
``--synthetic``: tiny random data (for tests), into ``benchmarks/out/paper-synthetic``.
Results: ``--out`` (default ``benchmarks/experiments/results/paper``).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.experiments.common import SCRATCH
from benchmarks.experiments.data import DataMissing
from benchmarks.experiments.paper import lstm, records, vision
from benchmarks.experiments.paper.records import RESULTS, TASKS

DEFAULTS = {
    "mnist": ("rr,mean,pair", "0-4"),
    "cifar": ("rr,pair", "0-2"),
    "lstm": ("rr,mean", "0-2"),
}


def seed_list(text: str) -> list[int]:
    """``"0-4"`` or ``"0,2,5"`` -> seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += list(range(int(low), int(high or low) + 1))
    return seeds


def task_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.paper TASK")
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--orderings", default=None, help="comma-separated (default per task)")
    parser.add_argument("--seeds", default=None, help="e.g. 0-4 or 0,3 (default per task)")
    parser.add_argument("--epochs", type=int, default=None, help="default: the authors'")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda (a GPU run: give it its own --out)"
    )
    parser.add_argument("--quick", action="store_true", help="2 epochs, 1 seed, scratch folder")
    parser.add_argument("--synthetic", action="store_true", help="tiny random data (tests)")
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    orderings, seeds = DEFAULTS[args.task]
    args.orderings = [o for o in (args.orderings or orderings).split(",") if o]
    args.seeds = seed_list(args.seeds or ("0" if args.quick else seeds))
    if args.out is None:
        scratch = "paper-synthetic" if args.synthetic else "paper-quick"
        args.out = SCRATCH / scratch if args.quick or args.synthetic else RESULTS
    if args.epochs is None and (args.quick or args.synthetic):
        args.epochs = 2
    known = lstm.ORDERINGS if args.task == "lstm" else vision.ORDERINGS
    unknown = sorted(set(args.orderings) - set(known))
    if unknown:
        raise SystemExit(f"unknown ordering(s) {unknown} for {args.task}; known: {known}")
    return args


def make_trainer(args: argparse.Namespace, ordering: str, seed: int, data):
    """The trainer and a fresh record for one run."""
    if args.task == "lstm":
        settings = dict(lstm.SETTINGS, epochs=args.epochs or lstm.SETTINGS["epochs"])
        settings["synthetic"] = args.synthetic
        trainer = lstm.LSTMTrainer(ordering, seed, data, device=args.device)
        metric, higher = "test perplexity", False
    else:
        task = vision.TASKS[args.task]
        settings = task.settings(args.synthetic)
        settings["epochs"] = args.epochs or task.epochs
        trainer = vision.VisionTrainer(task, ordering, seed, data, device=args.device)
        metric, higher = "test accuracy (%)", True
    if args.device != "cpu":
        settings["device"] = args.device  # a CPU run's settings stay as they were
    record = records.RunRecord(
        task=args.task, ordering=ordering, seed=seed, epochs_planned=settings["epochs"],
        metric=metric, higher_is_better=higher, settings=settings,
    )  # fmt: skip
    return trainer, record


def run_task(argv: Sequence[str]) -> int:
    args = resolve(task_parser().parse_args(list(argv)))
    torch.set_num_threads(1)
    try:
        if args.task == "lstm":
            data = lstm.load_corpus(args.synthetic)
        else:
            data = vision.load_data(args.task, args.synthetic)
    except DataMissing as missing:
        print(f"skipped: {missing}")
        return 0
    for seed in args.seeds:
        for ordering in args.orderings:
            trainer, record = make_trainer(args, ordering, seed, data)
            try:
                records.run(record, trainer, args.out, log=lambda s: print(s, flush=True))
            finally:
                trainer.close()
    print(f"records: {args.out / 'runs' / args.task}")
    return 0


def expand(spec: str) -> list[list[str]]:
    """A task command's options -> one option list per single run, seeds outermost."""
    args = resolve(task_parser().parse_args(shlex.split(spec)))
    common = [args.task, f"--out={args.out}", f"--device={args.device}"]
    common += [f"--epochs={args.epochs}"] * (args.epochs is not None)
    common += ["--synthetic"] * args.synthetic
    return [
        [*common, f"--orderings={o}", f"--seeds={s}"] for s in args.seeds for o in args.orderings
    ]


def run_queue(argv: Sequence[str]) -> int:
    """Run the single runs of the given task commands, ``--jobs`` at a time, in order."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.paper queue")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--log", type=Path, default=None, help="progress log (default: stdout)")
    parser.add_argument("specs", nargs="+", help='task commands, e.g. "mnist --seeds=0-4"')
    args = parser.parse_args(list(argv))
    pending = [run for spec in args.specs for run in expand(spec)]
    log = open(args.log, "a", buffering=1) if args.log else sys.stdout  # noqa: SIM115
    running: list[tuple[subprocess.Popen, list[str]]] = []
    print(f"{time.strftime('%F %T')} queue of {len(pending)} runs", file=log)
    while pending or running:
        while pending and len(running) < args.jobs:
            options = pending.pop(0)
            command = [sys.executable, "-m", "benchmarks.experiments.paper", *options]
            print(f"{time.strftime('%F %T')} start {' '.join(options)}", file=log)
            running.append((subprocess.Popen(command, stdout=log, stderr=log), options))
        time.sleep(5)
        for process, options in list(running):
            if process.poll() is not None:
                running.remove((process, options))
                print(
                    f"{time.strftime('%F %T')} exit {process.returncode}: {' '.join(options)}",
                    file=log,
                )
    print(f"{time.strftime('%F %T')} queue done", file=log)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "queue":
        return run_queue(argv[1:])
    if argv and argv[0] in ("--report", "report"):
        from benchmarks.experiments.paper.report import main as report_main

        return report_main(argv[1:])
    return run_task(argv)


if __name__ == "__main__":
    raise SystemExit(main())
