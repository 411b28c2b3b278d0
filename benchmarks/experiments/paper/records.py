"""One run's record (a JSON file rewritten after every epoch) and its resumable training loop.

A run is one (task, ordering, seed). After every epoch the loop writes, atomically, a checkpoint
(model, optimizer, scheduler and sampler states plus the record so far) to the cache folder
outside the repository, then the run's JSON record to the results folder. A run started again
resumes from its checkpoint, or starts cleanly when there is none; a finished record is left
alone. Timing: the training loop of each epoch in wall seconds and in process CPU seconds
(``time.process_time()``; with one thread it barely moves when other processes load the machine),
and the evaluation after it separately.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from benchmarks.experiments.data import CACHE

ROOT = Path(__file__).resolve().parents[3]
#: the committed results: per-run records in runs/<task>/, reports beside them
RESULTS = Path(__file__).resolve().parents[1] / "results" / "paper"
TASKS = ("mnist", "cifar", "lstm")


class Trainer(Protocol):
    """What the loop needs of a task: one epoch of training, the evaluation, and its state."""

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Train epoch ``epoch`` (0-based); returns values to record (e.g. the learning rate)."""

    def evaluate(self) -> dict[str, float]:
        """``train_loss`` (full training set, eval mode), ``test_metric`` and any others."""

    def after_evaluation(self, metrics: dict[str, float]) -> None:
        """Anything that reads the evaluation (a plateau scheduler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def revision() -> str:
    """The grabkit commit the code runs from, ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


@dataclass
class RunRecord:
    """Everything about one run that a report needs; ``epochs`` grows by one dict per epoch."""

    task: str
    ordering: str
    seed: int
    epochs_planned: int
    metric: str
    higher_is_better: bool
    settings: dict[str, Any]
    revision: str = field(default_factory=revision)
    torch_version: str = torch.__version__
    host: str = field(default_factory=platform.node)
    threads: int = field(default_factory=torch.get_num_threads)
    epochs: list[dict[str, float]] = field(default_factory=list)
    finished: bool = False

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        return cls(**data)

    def series(self, key: str) -> list[float]:
        return [e[key] for e in self.epochs]


def run_name(ordering: str, seed: int) -> str:
    return f"{ordering}-seed{seed}"


def record_path(out: Path, task: str, ordering: str, seed: int) -> Path:
    return out / "runs" / task / f"{run_name(ordering, seed)}.json"


def checkpoint_path(out: Path, task: str, ordering: str, seed: int) -> Path:
    """In the cache, keyed by the results folder, so scratch and real runs never mix."""
    key = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
    return CACHE / "checkpoints" / key / task / f"{run_name(ordering, seed)}.pt"


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(partial)
    partial.replace(path)


def write_record(path: Path, record: RunRecord) -> None:
    _atomic_write(path, lambda p: p.write_text(json.dumps(asdict(record), indent=1) + "\n"))


def read_records(out: Path, task: str) -> list[RunRecord]:
    """Every run record of ``task`` under ``out`` (finished or not), sorted by ordering, seed."""
    folder = out / "runs" / task
    records = [RunRecord.from_json(json.loads(p.read_text())) for p in folder.glob("*.json")]
    return sorted(records, key=lambda r: (r.ordering, r.seed))


def _comparable(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k != "epochs"}


def resume_or_start(
    record: RunRecord, trainer: Trainer, json_path: Path, ckpt_path: Path
) -> RunRecord:
    """The record to continue: the checkpoint's (its states loaded into ``trainer``), a fresh
    one when there is no record or no checkpoint of these settings, or the finished one on
    disk. Refuses a run on disk made with other settings (a changed task definition), naming
    the file to move away."""
    if json_path.exists():
        on_disk = RunRecord.from_json(json.loads(json_path.read_text()))
        if _comparable(on_disk.settings) != _comparable(record.settings):
            raise SystemExit(
                f"{json_path} was made with other settings ({on_disk.settings}, now "
                f"{record.settings}); move it away (and {ckpt_path}) to run again."
            )
        if on_disk.finished and len(on_disk.epochs) >= record.epochs_planned:
            return on_disk
    if not (json_path.exists() and ckpt_path.exists()):
        return record  # a checkpoint without its record is a leftover: start cleanly
    saved = torch.load(ckpt_path, weights_only=True)
    resumed = RunRecord.from_json(json.loads(saved["record"]))
    if _comparable(resumed.settings) != _comparable(record.settings):
        return record
    trainer.load_state_dict(saved["trainer"])
    resumed.epochs_planned, resumed.finished = record.epochs_planned, False
    resumed.settings = record.settings
    return resumed


def run(record: RunRecord, trainer: Trainer, out: Path, log=print) -> RunRecord:
    """Train ``record``'s run to ``epochs_planned`` epochs, resuming where it stopped."""
    json_path = record_path(out, record.task, record.ordering, record.seed)
    ckpt_path = checkpoint_path(out, record.task, record.ordering, record.seed)
    record = resume_or_start(record, trainer, json_path, ckpt_path)
    if record.epochs:
        log(f"{json_path.name}: resuming after epoch {len(record.epochs)}")
    for epoch in range(len(record.epochs), record.epochs_planned):
        wall, cpu = time.perf_counter(), time.process_time()
        extra = trainer.train_epoch(epoch)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        eval_wall = time.perf_counter()
        metrics = trainer.evaluate()
        eval_wall = time.perf_counter() - eval_wall
        trainer.after_evaluation(metrics)
        record.epochs.append(
            {"epoch": epoch + 1, **metrics, **extra, "wall_s": wall, "cpu_s": cpu,
             "eval_wall_s": eval_wall, "load1": os.getloadavg()[0]}
        )  # fmt: skip
        state = {"trainer": trainer.state_dict(), "record": json.dumps(asdict(record))}
        _atomic_write(ckpt_path, lambda p, s=state: torch.save(s, p))
        write_record(json_path, record)
        log(
            f"{record.task} {record.ordering} seed {record.seed} epoch {epoch + 1}/"
            f"{record.epochs_planned}: train loss {metrics['train_loss']:.4f}, "
            f"{record.metric} {metrics['test_metric']:.3f}, {wall:.1f} s wall / {cpu:.1f} s CPU"
        )
    record.finished = True
    write_record(json_path, record)
    return record
