"""Real-data experiments: does each grabkit capability pay off, when, and by how much.

Each module is one experiment, run as ``python -m benchmarks.experiments.NAME [--quick]`` from
the repository root (or ``python benchmarks/run.py experiments.NAME``). It trains on the public
datasets in ``../shared/data`` (skipping cleanly when they are absent), writes a markdown table
and PNG plots under ``benchmarks/experiments/results/`` and prints the table.
"""
