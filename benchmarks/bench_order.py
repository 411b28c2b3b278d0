"""Example ordering: balancing cost per batch, and the herding bound each ordering reaches.

Part 1 times one balancing step on a (B, d) CPU batch of per-example gradients: grabkit's
``GraBSampler.step`` (blocks of a few rows, each read from memory once: its products with the
running sum, its small Gram matrix, the signs decided on host scalars, one in-place update; one
row per block for long gradients) against the obvious per-example loop (one <s, x>, one Python
decision and one update per example), side by side and interleaved, for mean, pair and
probabilistic balancing at B = 64 and d in {1e4, 1e6}. grab-sampler is put alongside when it
installs and imports.

Part 2 measures the herding bound (max over prefixes of the inf-norm of the centred prefix sums)
of every ordering's epochs on real per-example gradients: multinomial logistic regression on the
first 2,000 MNIST training images (d = 7,850), at a point reached by a few full-batch gradient
steps and then held fixed, so every ordering balances the same vectors epoch after epoch.

Run: ``python benchmarks/run.py order`` (writes benchmarks/results/order.md) or ``--quick``.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from pathlib import Path

import torch

from benchmarks.common import DATA, machine_description, read_idx, time_side_by_side
from grabkit.order import GraBSampler, herding_bound

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "order.md"
MNIST = DATA / "mnist"
COMMAND = ".venv/bin/python benchmarks/run.py order"

GRAB_SAMPLER_INSTALL = (
    "`pip install grab-sampler torch==2.13.0` fails: grab-sampler 0.1.3 requires torch-sparse, "
    "which PyPI ships as source only, and its build stops with "
    "`ModuleNotFoundError: No module named 'torch'` (\"Failed to build 'torch-sparse' when "
    'getting requirements to build wheel"). Without it, `import grabsampler` fails '
    "(it imports torch_sparse, absl, pandas at import time)."
)


# -- part 1: balancing time per batch -----------------------------------------------------------
def sequential_step(state: dict, X: torch.Tensor, kind: str, generator: torch.Generator) -> None:
    """The per-example loop: one <s, z>, one decision on the host, one update per example.

    ``state`` holds s (the signed running sum), the stale mean and the running sum for the next
    mean. ``kind``: "mean" (z = x - stale mean), "pair" (z = difference of consecutive examples)
    or "probabilistic" (mean balancing with the self-balancing walk, scale-aware c).
    """
    s = state["s"]
    if kind == "pair":
        for i in range(0, X.shape[0] - 1, 2):
            z = X[i] - X[i + 1]
            if float(torch.dot(s, z)) <= 0:
                s += z
            else:
                s -= z
        return
    for i in range(X.shape[0]):
        z = X[i] - state["stale_mean"]
        value = float(torch.dot(s, z))
        if kind == "probabilistic":
            state["c"] = max(state["c"], abs(value))
            p_plus = 0.5 - value / (2 * state["c"]) if state["c"] > 0 else 0.5
            plus = float(torch.rand((), generator=generator)) < p_plus
        else:
            plus = value <= 0
        if plus:
            s += z
        else:
            s -= z
        state["next_mean_sum"] += X[i]


def grabkit_contender(kind: str, X: torch.Tensor, calls: int):
    """A closure stepping a GraBSampler with X in its second epoch, sized so it never runs out.

    The first epoch is stepped through beforehand, so mean balancing centres on a real stale
    mean, as the loop it is compared with does.
    """
    B = X.shape[0]
    balance_type = "pair" if kind == "pair" else "mean"
    sampler = GraBSampler(
        range(B * (calls + 1)),
        balance_type=balance_type,
        probabilistic=kind == "probabilistic",
        seed=0,
    )
    list(sampler)
    for _ in range(calls + 1):  # epoch 1: builds the stale mean
        sampler.step(X)
    list(sampler)  # epoch 2 starts: the timed steps below

    def run() -> None:
        sampler.step(X)

    return run


def sequential_contender(kind: str, X: torch.Tensor):
    d = X.shape[1]
    state = {
        "s": torch.zeros(d, dtype=X.dtype),
        "stale_mean": X.mean(dim=0) * 0.5,
        "next_mean_sum": torch.zeros(d, dtype=X.dtype),
        "c": 0.0,
    }
    generator = torch.Generator().manual_seed(0)
    return lambda: sequential_step(state, X, kind, generator)


def grab_sampler_status() -> str:
    """Why grab-sampler is not in the table (it is put alongside only if it imports)."""
    try:
        importlib.import_module("grabsampler")
    except Exception as error:  # any failure to import is reported, not raised
        return f"{GRAB_SAMPLER_INSTALL} Here: `{type(error).__name__}: {error}`."
    return "grabsampler imports, but its per-example API needs a full training loop; not timed."


def cpu_ms_per_call(fn, calls: int) -> float:
    """Process CPU time per call in ms: less sensitive than wall time to other jobs' load."""
    start = time.process_time()
    for _ in range(calls):
        fn()
    return 1e3 * (time.process_time() - start) / calls


def time_balancing(dims: list[int], batch: int, rounds: int) -> list[str]:
    lines = [
        f"Balancing one batch of B = {batch} per-example gradients (float32, CPU), in the "
        "sampler's second epoch (mean balancing centred on a stale mean, as in the loop). "
        f"Wall: median of {rounds} interleaved rounds after warm-up. CPU: process CPU time per "
        f"call over {rounds} further calls (robust to other jobs' load with one torch thread).",
        "",
        "| balancing | d | grabkit `step` wall (ms) | loop wall (ms) | loop / grabkit wall "
        "| grabkit CPU (ms) | loop CPU (ms) | loop / grabkit CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    warmup = 2
    for d in dims:
        X = torch.randn(batch, d, generator=torch.Generator().manual_seed(d))
        for kind in ("mean", "pair", "probabilistic"):
            contenders = {
                "grabkit": grabkit_contender(kind, X, warmup + 2 * rounds),
                "loop": sequential_contender(kind, X),
            }
            wall = time_side_by_side(contenders, rounds=rounds, warmup=warmup)
            cpu = {name: cpu_ms_per_call(fn, rounds) for name, fn in contenders.items()}
            lines.append(
                f"| {kind} | {d:.0e} | {1e3 * wall['grabkit']:.2f} | {1e3 * wall['loop']:.2f} "
                f"| {wall['loop'] / wall['grabkit']:.2f}x | {cpu['grabkit']:.2f} "
                f"| {cpu['loop']:.2f} | {cpu['loop'] / cpu['grabkit']:.2f}x |"
            )
            print(lines[-1], flush=True)
    return lines


# -- part 2: herding bound per ordering on MNIST logistic-regression gradients --------------------
def mnist_logistic_gradients(folder: Path, n: int, gd_steps: int) -> torch.Tensor:
    """(n, 7850) per-example gradients of softmax regression on the first n MNIST images.

    The point: ``gd_steps`` full-batch gradient steps (lr 0.5) from zero. For example i with
    p_i = softmax(W x_i + b), g_i = (p_i - onehot(y_i)) outer [x_i, 1], flattened.
    """
    images = read_idx(folder / "train-images-idx3-ubyte.gz")[:n].reshape(n, -1)
    labels = read_idx(folder / "train-labels-idx1-ubyte.gz")[:n]
    x = torch.as_tensor(images, dtype=torch.float64) / 255.0
    x = torch.cat([(x - 0.1307) / 0.3081, torch.ones(n, 1, dtype=torch.float64)], dim=1)
    onehot = torch.nn.functional.one_hot(torch.as_tensor(labels, dtype=torch.int64), 10).double()
    W = torch.zeros(10, x.shape[1], dtype=torch.float64)
    for _ in range(gd_steps):
        residual = torch.softmax(x @ W.T, dim=1) - onehot  # (n, 10)
        W -= 0.5 * residual.T @ x / n
    residual = torch.softmax(x @ W.T, dim=1) - onehot
    return (residual[:, :, None] * x[:, None, :]).reshape(n, -1)


# label -> GraBSampler keywords
ORDERING_CONFIGS: dict[str, dict] = {
    "rr": {"balance_type": "rr"},
    "so": {"balance_type": "so"},
    "swr": {"balance_type": "swr"},
    "flipflop": {"balance_type": "flipflop"},
    "mean": {"balance_type": "mean"},
    "pair": {"balance_type": "pair"},
    "recursive": {"balance_type": "recursive"},
    "recursive-pair": {"balance_type": "recursive-pair"},
    "batch": {"balance_type": "batch"},
    "ema": {"balance_type": "ema"},
    "sign": {"balance_type": "sign"},
    "norm": {"balance_type": "norm"},
    "greedy": {"balance_type": "greedy"},
    "mean, probabilistic": {"balance_type": "mean", "probabilistic": True},
    "pair, probabilistic": {"balance_type": "pair", "probabilistic": True},
    "mean, sparse JL k=512": {
        "balance_type": "mean",
        "projection": "sparse",
        "projection_dim": 512,
    },
    "mean, Kronecker k=512": {
        "balance_type": "mean",
        "projection": "kronecker",
        "projection_dim": 512,
    },
}


def epoch_bounds(G: torch.Tensor, config: dict, epochs: int, batch: int) -> list[float]:
    """Herding bound of each epoch's order (about the exact mean of G) under one ordering."""
    n = G.shape[0]
    vectors = G.to(torch.float32)
    sampler = GraBSampler(range(n), seed=0, **config)
    bounds = []
    for _ in range(epochs):
        order = torch.tensor(list(sampler), dtype=torch.int64)
        for start in range(0, order.numel(), batch):
            sampler.step(vectors[order[start : start + batch]])
        bounds.append(herding_bound(G, order))
    return bounds


def herding_table(G: torch.Tensor, epochs: int, batch: int) -> list[str]:
    n, d = G.shape
    shown = sorted({1, 2, min(3, epochs), epochs})
    lines = [
        f"Herding bound per epoch on {n} MNIST per-example gradients (softmax regression, "
        f"d = {d}), batches of {batch}; lower is better. Ratio: rr's last-epoch bound / the "
        "ordering's.",
        "",
        "| ordering | " + " | ".join(f"epoch {e}" for e in shown) + " | rr / ordering |",
        "|---|" + "---:|" * (len(shown) + 1),
    ]
    print("\n".join(lines), flush=True)
    reference = math.nan  # rr's last-epoch bound; rr comes first
    for label, config in ORDERING_CONFIGS.items():
        try:
            bounds = epoch_bounds(G, config, epochs, batch)
        except Exception as error:  # an ordering that cannot run here is reported, not fatal
            lines.append(f"| {label} | not run: {type(error).__name__}: {str(error)[:100]} |")
        else:
            if label == "rr":
                reference = bounds[-1]
            cells = " | ".join(f"{bounds[e - 1]:.2f}" for e in shown)
            lines.append(f"| {label} | {cells} | {reference / bounds[-1]:.1f}x |")
        print(lines[-1], flush=True)
    return lines


def parse_threads(argv: list[str]) -> int | None:
    """``--threads=N`` sets torch's intra-op threads (on a loaded machine 1 avoids thrashing)."""
    for arg in argv:
        if arg.startswith("--threads="):
            value = arg.removeprefix("--threads=")
            if not value.isdigit() or int(value) <= 0:
                raise SystemExit(f"--threads should be a positive integer, but got {value!r}")
            return int(value)
    return None


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    threads = parse_threads(argv)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    machine = machine_description()
    flags = " ".join(a for a in argv if a == "--quick" or a.startswith("--threads="))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    out = [
        "# Example ordering",
        "",
        f"Machine: {machine}; load average at start (1, 5, 15 min): {load}",
        "",
        f"Command: `{COMMAND}{' ' + flags if flags else ''}`",
        "",
        "## Balancing time per batch",
        "",
    ]
    print(f"Machine: {machine}\n", flush=True)
    dims = [10_000] if quick else [10_000, 1_000_000]
    out += time_balancing(dims, batch=64, rounds=3 if quick else 15)
    status = f"grab-sampler: {grab_sampler_status()}"
    out += ["", status, "", "## Herding bound per ordering", ""]
    print("\n".join(out[-5:]), flush=True)
    if MNIST.is_dir():
        n, epochs = (300, 2) if quick else (2000, 8)
        G = mnist_logistic_gradients(MNIST, n=n, gd_steps=20)
        out += herding_table(G, epochs=epochs, batch=16)
    else:
        message = f"skipped: MNIST not found at {MNIST}"
        print(message)
        out.append(message)
    if not quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("\n".join(out) + "\n")
        print(f"\nwritten to {RESULTS.relative_to(HERE.parent)}")
