"""``benchmarks/hook_step_ab.py --against`` times two checkouts of grabkit in one process: here
the same checkout twice, so both loops must run and the report must name both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "lenet"])
def test_two_checkouts_are_timed_in_one_process(model):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    script = "benchmarks/hook_step_ab.py"
    done = subprocess.run(
        [sys.executable, script, "sketch", "2", f"--against={ROOT / 'src'}", f"--model={model}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"{model} sketch:")
    assert "(this checkout)" in done.stdout and f"({ROOT / 'src'})" in done.stdout
    assert "this / other median" in done.stdout and "(2 blocks of 8 steps each)" in done.stdout
