"""``import grabkit`` never imports a training framework; only the integration modules do."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "torchdata")


def test_importing_grabkit_imports_no_framework():
    code = (
        "import sys, grabkit, grabkit.integrations, grabkit.integrations.resume, "
        "grabkit.integrations.schedule, grabkit.integrations.accelerate\n"
        f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
