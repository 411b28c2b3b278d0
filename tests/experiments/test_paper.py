"""``benchmarks.experiments.paper``: the runs at the GraB authors' settings.

Checked here on tiny synthetic data: a run resumed from its checkpoint (after a clean stop or a
crash) equals the uninterrupted run bitwise; the authors' micro-batch units give the optimizer
the same step as the whole batch and start in dataset order; the records carry what the report
needs; ``--report`` builds tables and figures from partial runs; smoke runs never write into the
committed results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.experiments import common  # noqa: E402
from benchmarks.experiments.paper import __main__ as cli  # noqa: E402
from benchmarks.experiments.paper import lstm, records, report, vision  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Checkpoints go to a temporary cache, never the user's."""
    monkeypatch.setattr(records, "CACHE", tmp_path / "cache")


def _run(task: str, ordering: str, epochs: int, out: Path, seed: int = 1):
    args = cli.resolve(
        cli.task_parser().parse_args(
            [task, "--synthetic", f"--epochs={epochs}", f"--out={out}", f"--seeds={seed}"]
        )
    )
    data = lstm.load_corpus(True) if task == "lstm" else vision.load_data(task, True)
    trainer, record = cli.make_trainer(args, ordering, seed, data)
    try:
        return records.run(record, trainer, out, log=lambda s: None), trainer
    finally:
        trainer.close()


def _losses(record: records.RunRecord) -> list[tuple[float, float]]:
    return [(e["train_loss"], e["test_metric"]) for e in record.epochs]


RESUMABLE = [
    ("mnist", "rr"),
    ("mnist", "pair"),
    ("mnist", "mean-units"),
    pytest.param("cifar", "pair-units", marks=pytest.mark.slow),
    pytest.param("lstm", "mean", marks=pytest.mark.slow),
    pytest.param("lstm", "pair", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("task", "ordering"), RESUMABLE)
def test_a_resumed_run_equals_the_uninterrupted_one_bitwise(task, ordering, tmp_path):
    whole, whole_trainer = _run(task, ordering, 4, tmp_path / "whole")
    _run(task, ordering, 2, tmp_path / "split")
    resumed, resumed_trainer = _run(task, ordering, 4, tmp_path / "split")
    assert _losses(resumed) == _losses(whole)
    for a, b in zip(
        whole_trainer.model.state_dict().values(),
        resumed_trainer.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_a_run_killed_mid_epoch_resumes_from_its_last_epoch(tmp_path, monkeypatch):
    whole, _ = _run("mnist", "pair-units", 3, tmp_path / "whole")
    calls = {"n": 0}
    original = vision.VisionTrainer.train_epoch

    def crash_in_third(self, epoch):
        calls["n"] += 1
        if calls["n"] == 3:
            self.optimizer.step()  # half an epoch's damage, then the crash
            raise KeyboardInterrupt
        return original(self, epoch)

    monkeypatch.setattr(vision.VisionTrainer, "train_epoch", crash_in_third)
    with pytest.raises(KeyboardInterrupt):
        _run("mnist", "pair-units", 3, tmp_path / "crashed")
    monkeypatch.setattr(vision.VisionTrainer, "train_epoch", original)
    on_disk = json.loads(
        records.record_path(tmp_path / "crashed", "mnist", "pair-units", 1).read_text()
    )
    assert len(on_disk["epochs"]) == 2 and not on_disk["finished"]
    resumed, _ = _run("mnist", "pair-units", 3, tmp_path / "crashed")
    assert _losses(resumed) == _losses(whole)


def test_a_finished_run_is_not_run_again(tmp_path):
    first, _ = _run("mnist", "rr", 2, tmp_path)
    again, _ = _run("mnist", "rr", 2, tmp_path)
    assert again.epochs == first.epochs


def test_a_record_made_with_other_settings_is_refused(tmp_path):
    _run("mnist", "rr", 2, tmp_path)
    path = records.record_path(tmp_path, "mnist", "rr", 1)
    data = json.loads(path.read_text())
    data["settings"]["lr"] = 0.5
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="other settings"):
        _run("mnist", "rr", 2, tmp_path)


@pytest.mark.slow
def test_records_carry_times_revision_and_settings(tmp_path):
    _run("lstm", "mean", 2, tmp_path)
    on_disk = json.loads(records.record_path(tmp_path, "lstm", "mean", 1).read_text())
    assert on_disk["finished"] and on_disk["revision"] and on_disk["settings"]["clip"] == 0.25
    for epoch in on_disk["epochs"]:
        assert {"train_loss", "test_metric", "valid_ppl", "lr", "wall_s", "cpu_s"} <= set(epoch)
        assert epoch["cpu_s"] > 0 and epoch["wall_s"] > 0


def test_units_step_on_the_whole_batch_mean_and_start_in_dataset_order():
    """The authors accumulate the mean gradients of micro-batches of equal size: the step is the
    whole batch's mean gradient. Their GraB visits the units in dataset order in epoch 1."""
    task = vision.TASKS["mnist"]
    tensors = vision.load_data("mnist", True)
    units = vision.VisionTrainer(task, "mean-units", 3, tensors)
    plain = vision.VisionTrainer(task, "rr", 3, tensors)
    assert units.sampler.order.tolist() == list(range(len(tensors[0]) // task.unit))
    units.task = plain.task = vision.VisionTask(**{**task.__dict__, "batch": 64})
    order = torch.arange(64)
    units._train_units(order[: 64 // task.unit])
    plain._train_examples(order)
    for a, b in zip(units.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_lstm_schedule_drops_tenfold_every_six_epochs(tmp_path):
    """ReduceLROnPlateau with threshold=5 never sees an improvement (the authors' setting)."""
    record, _ = _run("lstm", "rr", 8, tmp_path)
    assert record.series("lr") == [5.0] * 6 + [pytest.approx(0.5)] * 2


def test_report_builds_tables_and_figures_from_partial_runs(tmp_path):
    for seed in (0, 1):
        _run("mnist", "rr", 3, tmp_path, seed=seed)
    _run("mnist", "pair", 3, tmp_path, seed=0)
    _run("mnist", "pair", 2, tmp_path, seed=1)  # still short of epoch 3: pending
    _run("mnist", "mean-units", 1, tmp_path, seed=0)  # a later ordering, just started
    summary = report.build(tmp_path, ["mnist", "cifar", "lstm"])
    text = (tmp_path / "mnist.md").read_text()
    assert "| rr | 2 |" in text and "| pair | 1 |" in text and "|---|" in text
    assert "Still running" in text and "pair seed 1 (2/2)" in text
    assert "mean-units seed 0 (1/1)" in text
    assert (tmp_path / "mnist.png").read_bytes()[:8] == PNG_MAGIC
    assert any("pair vs rr at epoch 3" in line for line in summary)
    assert "mnist.md" in (tmp_path / "README.md").read_text()
    assert not (tmp_path / "cifar.md").exists()


@pytest.mark.parametrize("name", ["ordering", "noise_scale", "stepping", "grouping"])
def test_quick_runs_of_the_experiments_write_to_the_scratch_folder(name):
    args = common.parse_args(__doc__, ["--quick"])
    assert args.out != common.RESULTS and common.SCRATCH in args.out.parents
    assert common.parse_args(__doc__, []).out == common.RESULTS


def test_quick_paper_runs_write_to_the_scratch_folder():
    args = cli.resolve(cli.task_parser().parse_args(["mnist", "--quick"]))
    assert common.SCRATCH in args.out.parents and args.epochs == 2 and args.seeds == [0]
    assert cli.resolve(cli.task_parser().parse_args(["mnist"])).out == records.RESULTS


def test_the_queue_expands_seeds_outermost():
    runs = cli.expand("cifar --orderings=rr,pair --seeds=0-1 --epochs=30 --out=/x")
    assert [r[-2:] for r in runs] == [
        ["--orderings=rr", "--seeds=0"],
        ["--orderings=pair", "--seeds=0"],
        ["--orderings=rr", "--seeds=1"],
        ["--orderings=pair", "--seeds=1"],
    ]
    assert all("--epochs=30" in r for r in runs)


@pytest.mark.data
@pytest.mark.slow
def test_cifar_jpegs_come_back_in_the_original_order(shared_data):
    """The k-th training image is the lossless subset's k-th, up to JPEG error (PSNR 30 dB)."""
    import numpy as np
    from benchmarks.experiments import data
    from PIL import Image

    x, _, x_test, y_test = data.cifar10_full((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert x.shape == (50000, 3, 32, 32) and x_test.shape == (10000, 3, 32, 32)
    image = Image.open(shared_data / "cifar10" / "lossless_subset" / "cifar10_batch_0.png")
    exact = torch.as_tensor(np.asarray(image.convert("RGB")).reshape(1000, 32, 32, 3) / 255.0)
    error = (x[:1000].permute(0, 2, 3, 1).double() - exact).abs().mean(dim=(1, 2, 3))
    assert error.max() < 0.06  # a misplaced image differs by about 0.2
    assert torch.bincount(y_test).tolist() == [1000] * 10
