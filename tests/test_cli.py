"""The ``grabkit`` command line and its demo, run with tiny settings."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
from torch import nn

from grabkit.cli import build_parser, main
from grabkit.demo import DemoOptions, MissingDemoDependency, run_demo
from grabkit.demo.deps import require
from grabkit.demo.digits import load_digits_split, make_model
from grabkit.demo.recipe import EpochResult, per_example_gradients
from grabkit.demo.report import (
    RELATIVE_LOSS,
    format_final_comparison,
    format_summary_line,
    format_table,
    summarize,
    write_plot,
)
from grabkit.order import GraBSampler

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_no_subcommand_prints_usage(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: grabkit")
    assert "demo" in out


def test_help_explains_every_demo_option(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # no line breaks inside the names checked below
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--epochs", "--seeds", "--orderings", "--models", "--batch-size", "--lr"):
        assert option in out
    assert "--out" in out and "grabkit-demo.png" in out
    assert 'pip install "grabkit[demo]"' in out


def test_python_dash_m_grabkit_prints_usage():
    done = subprocess.run(
        [sys.executable, "-m", "grabkit", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: grabkit" in done.stdout and "demo" in done.stdout


def test_unknown_demo_option_prints_the_demo_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: grabkit demo" in err and "unrecognized arguments: --bogus" in err


def test_demo_writes_png_and_table(tmp_path, capsys):
    out = tmp_path / "plots" / "demo.png"
    code = main(
        [
            "demo",
            "--epochs=1",
            "--seeds=1",
            "--orderings=rr,mean,pair",
            f"--out={out}",
            "--no-progress",
        ]
    )
    assert code == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    stdout = capsys.readouterr().out
    header = next(line for line in stdout.splitlines() if line.startswith("model"))
    assert header.split() == [
        "model",
        "epoch",
        "ordering",
        "train",
        "loss",
        "test",
        "acc",
        "herding",
        "bound",
        "seconds",
    ]
    rows = [line.split() for line in stdout.splitlines() if line.startswith(("logreg ", "mlp "))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (model, "1", ordering) for model in ("logreg", "mlp") for ordering in ("rr", "mean", "pair")
    ]
    for row in rows:
        loss, accuracy, bound, seconds = float(row[3]), float(row[4][:-1]), float(row[5]), row[6]
        assert 0 < loss < 2.5 and 50 < accuracy <= 100 and bound > 0 and float(seconds) >= 0
    assert f"plot written to {out}" in stdout
    assert "logreg, epoch 1, vs rr: mean train loss" in stdout
    # one epoch cannot show GraB: the user is told so, and what to run instead
    assert "warning: --epochs 1: epoch 1 visits a random permutation" in stdout
    summary = [line for line in stdout.splitlines() if line.startswith("In short:")]
    assert len(summary) == 1 and "mean/pair end with train loss" in summary[0]


def test_no_warning_from_two_epochs(tmp_path):
    stdout = io.StringIO()
    options = DemoOptions(
        epochs=2,
        seeds=1,
        orderings=("rr", "pair"),
        models=("logreg",),
        out=tmp_path / "x.png",
        progress=False,
    )
    run_demo(options, stdout=stdout)
    assert not any(line.startswith("warning:") for line in stdout.getvalue().splitlines())
    assert "In short: at epoch 2, pair end with train loss" in stdout.getvalue()


def test_run_demo_returns_every_epoch_and_restores_threads(tmp_path):
    threads = torch.get_num_threads()
    options = DemoOptions(
        epochs=2,
        seeds=2,
        orderings=("rr", "pair"),
        models=("logreg",),
        out=tmp_path / "x.png",
        progress=False,
    )
    results = run_demo(options, stdout=io.StringIO())
    assert torch.get_num_threads() == threads
    assert len(results) == 2 * 2 * 2
    assert {(r.ordering, r.seed, r.epoch) for r in results} == {
        (o, s, e) for o in ("rr", "pair") for s in (0, 1) for e in (1, 2)
    }
    # the first epoch's order is the seed's random permutation for every ordering but rr, and
    # the model's initial weights depend only on the seed
    first = {r.ordering: r for r in results if r.seed == 0 and r.epoch == 1}
    assert first["rr"].train_loss > 0 and first["pair"].herding_bound > 0


def test_per_example_gradients_match_torch_func():
    data = load_digits_split()
    model = make_model("mlp", seed=0).double()
    sampler = GraBSampler(data.train_set, model=model, balance_type="mean")
    inputs, targets = data.train_inputs[:9].double(), data.train_targets[:9]
    nn.functional.cross_entropy(model(inputs), targets).backward()
    sampler.step()
    observed = per_example_gradients(sampler)

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p, x, y):
        logits = torch.func.functional_call(model, p, (x[None],))
        return nn.functional.cross_entropy(logits, y[None])

    grads = torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0, 0))(
        params, inputs, targets
    )
    expected = torch.cat([g.reshape(9, -1) for g in grads.values()], dim=1)
    torch.testing.assert_close(observed, expected)
    sampler.stats.close()


def test_summary_means_and_bands_over_seeds():
    def result(seed, epoch, loss):
        return EpochResult("logreg", "mean", seed, epoch, loss, 0.5, 2.0 * loss, 0.1)

    rows = summarize([result(0, 1, 1.0), result(1, 1, 3.0), result(0, 2, 0.5), result(1, 2, 0.5)])
    assert [(r.epoch, r.seeds) for r in rows] == [(1, 2), (2, 2)]
    assert rows[0].mean["train_loss"] == 2.0
    assert (rows[0].low["herding_bound"], rows[0].high["herding_bound"]) == (2.0, 6.0)
    table = format_table(rows).splitlines()
    assert table[2].split() == ["logreg", "1", "mean", "2.0000", "50.0%", "4.000", "0.100"]
    assert format_final_comparison(rows) == ""  # no rr to compare with
    baseline = EpochResult("logreg", "rr", 0, 2, 1.0, 0.5, 4.0, 0.1)
    assert format_final_comparison(summarize([baseline, result(0, 2, 0.5)])) == (
        "logreg, epoch 2, vs rr: mean train loss -50.0%, herding bound 0.25x"
    )


def test_loss_relative_to_rr_is_taken_seed_by_seed():
    def result(ordering, seed, loss):
        return EpochResult("logreg", ordering, seed, 2, loss, 0.5, 1.0, 0.1)

    # seed 1's losses are 10x seed 0's: the absolute spread is wide, the relative gap is not
    rows = summarize(
        [
            result("rr", 0, 1.0),
            result("pair", 0, 0.9),
            result("rr", 1, 10.0),
            result("pair", 1, 9.0),
        ]
    )
    pair = next(r for r in rows if r.ordering == "pair")
    rr = next(r for r in rows if r.ordering == "rr")
    assert pair.mean[RELATIVE_LOSS] == pytest.approx(-10.0)
    assert pair.low[RELATIVE_LOSS] == pytest.approx(-10.0)
    assert pair.high[RELATIVE_LOSS] == pytest.approx(-10.0)
    assert rr.mean[RELATIVE_LOSS] == 0.0
    assert format_summary_line(rows).startswith(
        "In short: at epoch 2, pair end with train loss -10.0% to -10.0% vs rr"
    )
    # without rr there is nothing to be relative to: no key, and the summary says what is missing
    alone = summarize([result("pair", 0, 0.9)])
    assert RELATIVE_LOSS not in alone[0].mean
    assert "run rr and at least one other ordering" in format_summary_line(alone)


def test_plot_without_rr_still_writes_a_png(tmp_path):
    rows = summarize([EpochResult("mlp", "pair", 0, e, 1.0 / e, 0.5, 1.0, 0.1) for e in (1, 2)])
    write_plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs=0"], "`epochs` should be a positive integer, but got epochs=0"),
        (["--seeds=-1"], "`seeds` should be a positive integer"),
        (["--batch-size=0"], "`batch_size` should be a positive integer"),
        (["--lr=0"], "`lr` should be a positive number"),
        (["--orderings=rr,greedy"], "unknown name(s) ['greedy']"),
        (["--orderings=,"], "`orderings` should name at least one"),
        (["--orderings=rr,rr"], "lists a name twice"),
        (["--models=resnet"], "unknown name(s) ['resnet']"),
        (["--out=plot.jpg"], "`out` should be a path ending in .png"),
    ],
)
def test_bad_demo_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_demo_dependency_names_the_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` fail
    assert main(["demo", "--epochs=1", "--seeds=1", f"--out={tmp_path / 'x.png'}"]) == 1
    err = capsys.readouterr().err
    assert "needs tqdm" in err and 'pip install "grabkit[demo]"' in err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(MissingDemoDependency, match="scikit-learn"):
        monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
        require("sklearn.datasets", "scikit-learn")


def test_command_line_defaults_are_the_demo_defaults():
    args = build_parser().parse_args(["demo"])
    defaults = DemoOptions()
    assert (args.epochs, args.seeds, args.batch_size, args.lr) == (
        defaults.epochs,
        defaults.seeds,
        defaults.batch_size,
        defaults.lr,
    )
    assert tuple(args.orderings.split(",")) == defaults.orderings
    assert tuple(args.models.split(",")) == defaults.models
    assert args.out == str(defaults.out)
