"""Ordering tests run their many tiny matrix products on one intra-op thread.

Balancing a test-sized batch is a handful of microsecond products; with several threads on a
busy 2-core machine each one can wait milliseconds on thread hand-off, which made these tests
slow without testing anything more. The previous setting is restored after each test.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
