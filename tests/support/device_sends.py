"""Counting sends of host values to a device, on the CPU (where nothing waits).

On a GPU a send from pageable host memory (``x.to(device)``, ``torch.tensor(...,
device=...)``) waits for the device: a hidden host synchronisation. grabkit sends through
``grabkit.stats.transfer.to_device`` (pinned memory, no wait); ``DeviceSends`` records every
explicit move to a device that grabkit makes anywhere else, so a CPU test can hold the line.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import grabkit

#: the package's own folder: sends made by code there are counted, the tests' own are not
PACKAGE = os.path.dirname(os.path.realpath(grabkit.__file__)) + os.sep
TRANSFER = os.path.join(PACKAGE, "stats", "transfer.py")


class DeviceSends:
    """Counts tensors sent to an explicit device (``x.to(device)``, ``torch.tensor(...,
    device=...)``) anywhere but in ``grabkit.stats.transfer``: on a GPU each one from pageable
    host memory waits for the device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sites: list[str] = []
        to = torch.Tensor.to
        monkeypatch.setattr(torch.Tensor, "to", self._counting(to, self._to_names_device))
        for name in ("tensor", "as_tensor"):
            made = getattr(torch, name)
            monkeypatch.setattr(torch, name, self._counting(made, self._keyword_device))

    @staticmethod
    def _to_names_device(args, kwargs) -> bool:
        return "device" in kwargs or any(
            isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:]
        )

    @staticmethod
    def _keyword_device(args, kwargs) -> bool:
        return kwargs.get("device") is not None

    def _counting(self, original, sends):
        def call(*args, **kwargs):
            if sends(args, kwargs):
                caller = os.path.realpath(sys._getframe(1).f_code.co_filename)
                if caller.startswith(PACKAGE) and caller != TRANSFER:
                    self.sites.append(f"{caller}:{sys._getframe(1).f_lineno}")
            return original(*args, **kwargs)

        return call
