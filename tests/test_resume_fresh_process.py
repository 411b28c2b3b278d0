"""A checkpoint taken anywhere, loaded in a fresh process with ``torch.load(weights_only=True)``,
continues exactly as the uninterrupted run: samplers and noise estimators (the stepping
wrappers have their own fresh-process test in tests/accumulate/test_resume_property.py)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.resume_cases import cases

REPO_ROOT = Path(__file__).resolve().parents[1]
CASES = cases()


def _checkpoint(name: str, cut: int) -> tuple[list, bytes]:
    case = CASES[name]
    first = case.make()
    head = case.run(first, 0, cut)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    return head, buffer.getvalue()


def _resume(name: str, blob: bytes, cut: int) -> list:
    case = CASES[name]
    resumed = case.make()
    resumed.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    return case.run(resumed, cut, case.events)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), data=st.data())
def test_resume_at_any_event_continues_exactly(name, data):
    case = CASES[name]
    cut = data.draw(st.integers(0, case.events), label="cut")
    head, blob = _checkpoint(name, cut)
    assert head + _resume(name, blob, cut) == case.run(case.make(), 0, case.events)


@pytest.mark.slow
def test_resume_in_a_fresh_process_continues_exactly(tmp_path):
    cuts = {name: case.events // 2 + 1 for name, case in CASES.items()}  # mid-epoch, mid-step
    heads = {}
    for name, cut in cuts.items():
        heads[name], blob = _checkpoint(name, cut)
        (tmp_path / f"{name}.pt").write_bytes(blob)
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path[:0] = [{str(REPO_ROOT)!r}, {str(REPO_ROOT / "src")!r}]
        from pathlib import Path
        from tests.test_resume_fresh_process import _resume
        folder, cuts = Path({str(tmp_path)!r}), {cuts!r}
        tails = {{n: _resume(n, (folder / f"{{n}}.pt").read_bytes(), c) for n, c in cuts.items()}}
        torch.save(tails, folder / "tails.pt")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT)
    tails = torch.load(tmp_path / "tails.pt", weights_only=True)
    for name, case in CASES.items():
        assert heads[name] + tails[name] == case.run(case.make(), 0, case.events), name
