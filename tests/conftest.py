"""Shared fixtures: the location of the real datasets (tests that use them skip when absent), and
the property tests' reproducible Hypothesis profile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run, so that a CI run reproduces a local one;
# ``HYPOTHESIS_PROFILE=explore pytest ...`` draws fresh examples to look for new failures.
settings.register_profile("reproducible", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

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
