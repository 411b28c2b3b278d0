"""``python -m benchmarks.gpu_check``: a clean exit without CUDA, the CUDA tier's selection, and
a check that reports how far it got when stopped, skips what does not fit and survives a failing
stage. The stages' own code runs on the CPU in the slow tier (``--allow-cpu --quick``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_and_exits_cleanly(tmp_path):
    out = tmp_path / "gpu.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", f"--out={out}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and not out.exists()


def test_the_tier_is_the_tests_that_skip_without_cuda():
    files = ["tests/order/test_cuda.py", "tests/stats/test_engine.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "benchmarks.gpu_tier", "--collect-only", "-q",
         *files],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids and all(
        i.startswith("tests/order/test_cuda.py::") or i.endswith("::test_runs_on_cuda") for i in ids
    )
    assert any(i.endswith("::test_runs_on_cuda") for i in ids)
    assert "tests/order/test_cuda.py" in gpu_check.cuda_test_files()


def _stages(monkeypatch, *stages):
    monkeypatch.setattr(gpu_check, "STAGES", list(stages))


def test_a_stopped_check_says_how_far_it_got_and_keeps_finished_stages(
    tmp_path, monkeypatch, capsys
):
    def first(device, quick, budget):
        return "first figures\n"

    def terminated(device, quick, budget):
        os.kill(os.getpid(), signal.SIGTERM)
        return "never\n"

    _stages(monkeypatch, ("one", first, 0.0), ("two", terminated, 0.0), ("three", first, 0.0))
    out = tmp_path / "gpu.md"
    code = gpu_check.run_check(out, gpu_check.Budget(60), torch.device("cpu"), quick=True)
    printed = capsys.readouterr().out
    assert code == 130
    assert "cut short" in printed and "during stage 2/3 (two)" in printed
    assert "finished: one" in printed and str(out) in printed
    text = out.read_text()
    assert "### one" in text and "first figures" in text and "### two" not in text
    assert signal.getsignal(signal.SIGTERM) is not gpu_check._stop


def test_a_failing_stage_is_reported_and_one_without_time_is_skipped(tmp_path, monkeypatch):
    def broken(device, quick, budget):
        raise RuntimeError("CUDA error: out of memory")

    def fine(device, quick, budget):
        return "ok\n"

    _stages(monkeypatch, ("broken", broken, 0.0), ("long", fine, 1e6), ("fine", fine, 0.0))
    out = tmp_path / "gpu.md"
    assert gpu_check.run_check(out, gpu_check.Budget(60), torch.device("cpu"), True) == 0
    text = out.read_text()
    assert "**failed**: `RuntimeError: CUDA error: out of memory`" in text
    assert "### long\n\nskipped:" in text and "### fine\n\nok" in text


@pytest.mark.slow
def test_every_stage_runs_on_the_cpu_when_allowed(tmp_path):
    out = tmp_path / "gpu.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--allow-cpu", "--quick", f"--out={out}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert "failed" not in text
    for title, _, _ in gpu_check.STAGES:
        assert f"### {title}" in text
    assert "| MLP 784-784-64-10 | 8 | sketch hook pair (k=1024) |" in text
