"""pytest plugin: keep only the CUDA test tier (``python -m pytest -p benchmarks.gpu_tier ...``).

A test belongs to the tier when it is skipped without a CUDA device: a ``skipif`` mark (on the
test, its class or its module's ``pytestmark``) whose reason names CUDA or an accelerator, or a
parametrization whose id names ``cuda``. Everything else is deselected, so the tier runs in
seconds wherever the test files are collected.
"""

from __future__ import annotations

import re

import pytest

_CUDA = re.compile(r"cuda|accelerator|gpu", re.IGNORECASE)


def is_cuda_test(item: pytest.Item) -> bool:
    for mark in item.iter_markers("skipif"):
        if _CUDA.search(str(mark.kwargs.get("reason", ""))):
            return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and bool(_CUDA.search(callspec.id))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [item for item in items if is_cuda_test(item)]
    dropped = [item for item in items if not is_cuda_test(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
