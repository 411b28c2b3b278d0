"""Every Python example in the README runs as written, on its own.

Each ```python block runs alone: in this process, in a fresh namespace and a scratch directory,
or, when an HTML comment ``<!-- readme: subprocess -->`` stands on the line before it, as a
script of its own (``python example.py``), for blocks that launch processes (a Lightning
``strategy="ddp"`` Trainer re-runs its script on every rank). Blocks that import a training
framework, and every subprocess block, belong to the slow tier. No block may lean on another:
a name defined in one block is undefined in the next.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import grabkit

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(?:<!-- readme: (?P<tag>[a-z-]+) -->\n)?```python\n(?P<code>.*?)```", re.S)
EXAMPLES = [(m["tag"], m["code"]) for m in BLOCK.finditer(README.read_text())]
TAGS = {None, "subprocess"}
FRAMEWORKS = ("transformers", "lightning", "accelerate")


def test_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 5


def test_readme_tags_are_known() -> None:
    assert {tag for tag, _ in EXAMPLES} <= TAGS


def test_the_readme_test_command_is_what_ci_runs() -> None:
    text = README.read_text()
    command = re.search(r"Install and run the tests.*?```bash\n(.*?)\n```", text, re.S)[1]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()[-1]
    assert ci.replace("pip install -q ", "pip install ") == command


def _example(i: int, tag: str | None, code: str) -> object:
    """A README example; the ones that start a framework or a process run in the slow tier."""
    framework = any(f"import {name}" in code or f"from {name}" in code for name in FRAMEWORKS)
    marks = [pytest.mark.slow] if framework or tag == "subprocess" else []
    return pytest.param(tag, code, id=f"example{i}", marks=marks)


@pytest.mark.parametrize(
    ("tag", "code"), [_example(i, tag, code) for i, (tag, code) in enumerate(EXAMPLES)]
)
def test_readme_example_runs(
    tag: str | None, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # examples may write files (a sampler checkpoint)
    if tag == "subprocess":
        _run_script(code, tmp_path)
    else:
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})


def _run_script(code: str, where: Path) -> None:
    """``python example.py`` in ``where``, importing this checkout's grabkit."""
    script = where / "example.py"
    script.write_text(code)
    source = str(Path(grabkit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    # a generous bound against a hung launcher, not a speed test
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, (
        f"{script.name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
