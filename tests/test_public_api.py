"""The top-level names resolve, lazily, to the subpackages that define them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import grabkit


@pytest.mark.parametrize("name", grabkit.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(grabkit, name) is not None
    assert name in dir(grabkit)


def test_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        grabkit.NotAThing  # noqa: B018


def test_import_is_lazy() -> None:
    code = "import sys, grabkit; print(any(m.startswith('grabkit.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
