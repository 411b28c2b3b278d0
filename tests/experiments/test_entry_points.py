"""Each real-data experiment runs end to end from its command on tiny synthetic data.

The experiments' figures come from ``../shared/data``; these tests only check that every entry
point runs, writes its markdown report and PNG figure, and prints a table (``--synthetic``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

EXPERIMENTS = {
    "ordering": (
        ["--task=mnist,cifar,wikitext", "--seeds=1"],
        "ordering.md",
        ["ordering_mnist.png", "ordering_cifar.png", "ordering_wikitext.png"],
    ),
    "noise_scale": ([], "noise_scale.md", ["noise_scale.png"]),
    "stepping": ([], "stepping.md", ["stepping.png"]),
    "grouping": ([], "grouping.md", ["grouping.png"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_runs_on_synthetic_data(name, tmp_path):
    extra, report, figures = EXPERIMENTS[name]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            f"benchmarks.experiments.{name}",
            "--synthetic",
            f"--out={tmp_path}",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / report).read_text()
    assert text.startswith("## ") and "| ---" not in text and "|---|" in text
    assert "Command: `python -m benchmarks.experiments." in text
    for figure in figures:
        assert (tmp_path / figure).read_bytes()[:8] == PNG_MAGIC
    assert f"written: {tmp_path / report}" in done.stdout


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_missing_data_is_a_clean_skip(name, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    import importlib

    data = importlib.import_module("benchmarks.experiments.data")
    common = importlib.import_module("benchmarks.experiments.common")
    module = importlib.import_module(f"benchmarks.experiments.{name}")
    monkeypatch.setattr(data, "DATA", tmp_path / "absent")
    assert common.run_main(module.main, [f"--out={tmp_path}", "--quick"]) == 0
    assert "skipped: " in capsys.readouterr().out
    assert not list(tmp_path.glob("*.md"))
