"""Run grabkit's benchmarks: ``python benchmarks/run.py [NAME ...]`` (default: all).

Each NAME is a module ``benchmarks/bench_NAME.py`` with a ``main(argv: list[str]) -> None`` that
prints a markdown table of ratios measured side by side in one run. ``--quick`` is passed through
for a fast smoke run.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def main(argv: list[str]) -> None:
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        print(f"\navailable: {' '.join(available())}")
        return
    flags = [a for a in argv if a.startswith("-")]
    names = [a for a in argv if not a.startswith("-")] or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; available: {available()}")
    sys.path.insert(0, str(HERE.parent))
    for name in names:
        print(f"\n## {name}\n", flush=True)
        importlib.import_module(f"benchmarks.bench_{name}").main(flags)


if __name__ == "__main__":
    main(sys.argv[1:])
