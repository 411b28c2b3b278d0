"""The first ten minutes: licence, type marker, and command-line help that says the right thing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import grabkit
from grabkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_licence_and_type_marker_ship_with_the_package():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert (Path(grabkit.__file__).parent / "py.typed").is_file()


def test_a_bad_demo_option_prints_the_demo_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--epochs=-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: grabkit demo")
    assert "epochs" in err


def test_benchmark_runner_help_prints_help_and_runs_nothing():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "python benchmarks/run.py" in done.stdout
    assert "available:" in done.stdout and "order" in done.stdout
    assert "##" not in done.stdout  # no benchmark started
