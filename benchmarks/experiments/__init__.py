"""Real-data experiments: does each grabkit capability pay off, when, and by how much.

Each module is one experiment (``ordering``, ``noise_scale``, ``stepping``, ``grouping``), run as
``python -m benchmarks.experiments.NAME [--quick]`` from the repository root. It trains on the
public datasets in ``../shared/data`` (skipping cleanly when they are absent), writes a markdown
report and PNG plots under ``benchmarks/experiments/results/`` and prints the report.
``--synthetic`` runs it on tiny random data (the tests do), ``--out`` writes elsewhere.
Shared pieces: ``data`` (loaders), ``models`` (LeNet-5, a one-block transformer LM), ``common``
(command line, tables, figures).
"""
