"""The demo against wall-clock time: elapsed seconds, the loss at rr's time, the summary's verdict
per epoch and per second, and a legend that names orderings without "(mean)"."""

from __future__ import annotations

import pytest

from grabkit.demo.recipe import EpochResult
from grabkit.demo.report import (
    ELAPSED,
    format_summary_line,
    loss_at_baseline_time,
    summarize,
    write_plot,
)


def _run(ordering: str, seed: int, losses: list[float], seconds: float) -> list[EpochResult]:
    return [
        EpochResult("logreg", ordering, seed, e + 1, loss, 0.9, 1.0, seconds)
        for e, loss in enumerate(losses)
    ]


def test_elapsed_seconds_accumulate_per_seed():
    rows = summarize(_run("rr", 0, [1.0, 0.8, 0.6], 1.0) + _run("rr", 1, [1.0, 0.8, 0.6], 3.0))
    assert [r.mean[ELAPSED] for r in rows] == [2.0, 4.0, 6.0]
    assert [(r.low[ELAPSED], r.high[ELAPSED]) for r in rows] == [(1, 3), (2, 6), (3, 9)]


def test_loss_at_rr_time_interpolates_between_epochs():
    # rr: 4 epochs of 1 s, final loss 0.5. GraB: 2 s per epoch, at 4 s it has done 2 epochs
    results = _run("rr", 0, [0.8, 0.7, 0.6, 0.5], 1.0) + _run("mean", 0, [0.7, 0.6, 0.4, 0.3], 2.0)
    assert loss_at_baseline_time(results) == {("logreg", "mean"): [pytest.approx(20.0)]}
    # 3 s per epoch: at 4 s it is a third of the way from epoch 1 (0.7) to epoch 2 (0.6)
    slower = _run("rr", 0, [0.8, 0.7, 0.6, 0.5], 1.0) + _run("mean", 0, [0.7, 0.6], 3.0)
    expected = 100 * ((0.7 - 0.1 / 3) / 0.5 - 1)
    assert loss_at_baseline_time(slower)[("logreg", "mean")] == [pytest.approx(expected)]
    # 5 s per epoch: not one epoch done when rr has finished
    slowest = _run("rr", 0, [0.8, 0.7, 0.6, 0.5], 1.0) + _run("mean", 0, [0.7], 5.0)
    assert loss_at_baseline_time(slowest) == {("logreg", "mean"): [None]}


def test_summary_says_whether_grab_wins_per_epoch_and_per_second():
    # GraB ahead per epoch (0.3 vs 0.5) but at twice the cost: behind at rr's time (0.6 vs 0.5)
    results = _run("rr", 0, [0.8, 0.7, 0.6, 0.5], 1.0) + _run("mean", 0, [0.7, 0.6, 0.4, 0.3], 2.0)
    line = format_summary_line(summarize(results), results=results)
    assert "GraB wins per epoch" in line
    assert "train loss +20.0% to +20.0% vs rr's final, so GraB does not win per second" in line
    assert "2.0x to 2.0x rr's time per epoch" in line
    cheap = _run("rr", 0, [0.8, 0.7, 0.6, 0.5], 1.0) + _run("mean", 0, [0.7, 0.6, 0.4, 0.3], 1.0)
    assert "GraB wins per second" in format_summary_line(summarize(cheap), results=cheap)
    slowest = _run("rr", 0, [0.8, 0.7], 1.0) + _run("mean", 0, [0.7, 0.6], 5.0)
    assert "does not win per second" in format_summary_line(summarize(slowest), results=slowest)


def test_legend_names_orderings_without_mean_in_brackets(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    labels: list[str] = []
    original = Figure.legend

    def spy(self, handles, names, **kwargs):
        labels.extend(names)
        return original(self, handles, names, **kwargs)

    monkeypatch.setattr(Figure, "legend", spy)
    results = _run("rr", 0, [0.8, 0.7], 1.0) + _run("mean", 0, [0.7, 0.6], 2.0)
    write_plot(summarize(results), tmp_path / "p.png", results=results)
    assert labels == ["rr", "mean"]
