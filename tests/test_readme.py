"""Every Python example in the README runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 5


FRAMEWORKS = ("transformers", "lightning", "accelerate")


# Examples that launch several processes continue the example before them and cannot run in
# this one; the test named beside each runs the same code under DDP.
MULTI_PROCESS = {'strategy="ddp"': "tests/integrations/test_lightning_ddp.py"}


def _example(i: int, code: str) -> object:
    """A README example; the ones that start a training framework run in the slow tier."""
    slow = any(f"import {name}" in code or f"from {name}" in code for name in FRAMEWORKS)
    marks = [pytest.mark.slow] if slow else []
    for marker, test in MULTI_PROCESS.items():
        if marker in code:
            marks.append(pytest.mark.skip(reason=f"several processes: run by {test}"))
    return pytest.param(code, id=f"example{i}", marks=marks)


@pytest.mark.parametrize("code", [_example(i, code) for i, code in enumerate(EXAMPLES)])
def test_readme_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples may write files (a sampler checkpoint)
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
