"""Shared fixtures: the location of the real datasets (tests that use them skip when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: ``../shared/data`` beside the checkout, or the folder ``GRABKIT_DATA`` names
SHARED_DATA = Path(
    os.environ.get("GRABKIT_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to the real datasets (``SHARED_DATA``); skips the test when the folder is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Distributed tests (spawned process groups) belong to the slow tier."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
