"""Batch grouping: padded vs grabkit grouped vs a flattened (padding-free) lower bound.

Workload (asym's notebook): 1024 token sequences, lengths {1, 4, 16, 64} with p proportional to
1/length, batches of 256, Embedding -> Linear -> masked max-pool -> Linear, MSE, forward +
backward + SGD step. Width 1024 on CPU, 8192 on a GPU. Also: planning + split + merge overhead
per batch of 256, and padding efficiency (real / computed tokens) on IMDB review lengths.

Run: ``python benchmarks/run.py group`` (``--quick`` for a smoke run, ``--threads=N`` to fix
the torch thread count: on a shared, oversubscribed machine one thread avoids OpenMP barrier
stalls that otherwise dominate every small kernel).
"""

from __future__ import annotations

import argparse
import statistics
import tarfile
import time

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from benchmarks.common import DATA, machine_description, synchronize, time_side_by_side
from grabkit.group import (
    AnnotatedModule,
    DataCollection,
    GroupingCollate,
    LengthThresholdGrouper,
    UniGrouper,
    find_thresholds,
    group_batch,
    plan_groups,
)

IMDB = DATA / "imdb" / "aclImdb_labeled.tar.gz"


class MaxPoolModel(nn.Module):
    """Embedding -> Linear -> masked max over the length -> Linear (the notebook's model)."""

    def __init__(self, width: int, device: torch.device) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, width, device=device)
        self.linear = nn.Linear(width, width, device=device)
        self.proj = nn.Linear(width, 1, device=device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.linear(self.emb(x))
        h = h.masked_fill(~mask[:, :, None], float("-inf"))
        return self.proj(h.max(1).values)[:, 0]

    def flat(self, tokens: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
        """The same function on the real tokens only: a padding-free lower bound."""
        h = self.linear(self.emb(tokens))
        pooled = torch.full((n, h.shape[1]), float("-inf"), device=h.device, dtype=h.dtype)
        pooled = pooled.scatter_reduce(0, owner[:, None].expand_as(h), h, "amax")
        return self.proj(pooled)[:, 0]


class AnnotatedMaxPool(AnnotatedModule):
    def __init__(self, inner: MaxPoolModel) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, mask):
        return self.inner(x, mask)

    def get_input_annot(self):
        return "(b, l_seq)"

    def get_output_annot(self):
        return "(b)"

    def get_mask_hint(self):
        return ["seq"]


def notebook_lengths(n: int, rng: np.random.Generator) -> list[int]:
    values = np.array([1, 4, 16, 64])
    p = 1.0 / values
    return rng.choice(values, size=n, p=p / p.sum()).tolist()


def training_comparison(width: int, dataset_size: int, rounds: int, device: torch.device) -> str:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    lengths = notebook_lengths(dataset_size, rng)
    data = [(torch.randint(0, 8, (n,)), float(rng.integers(0, 2))) for n in lengths]
    batches = [data[i : i + 256] for i in range(0, dataset_size, 256)]
    model = MaxPoolModel(width, device)
    annotated = AnnotatedMaxPool(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    thresholds = find_thresholds(lengths, cost_fn=lambda x: x, k=3)

    padded_batches = []
    for batch in batches:
        xs = [x for x, _ in batch]
        lens = torch.tensor([len(x) for x in xs])
        padded = pad_sequence(xs, batch_first=True).to(device)
        mask = (torch.arange(padded.shape[1])[None] < lens[:, None]).to(device)
        y = torch.tensor([t for _, t in batch], device=device)
        padded_batches.append((padded, mask, lens, y, xs))
    collate = GroupingCollate()
    collated = [collate(batch).to(device) for batch in batches]
    flat_batches = []
    for _, _, lens, y, xs in padded_batches:
        tokens = torch.cat(xs).to(device)
        owner = torch.repeat_interleave(torch.arange(len(xs)), lens).to(device)
        flat_batches.append((tokens, owner, y))

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def padded_epoch() -> None:
        for padded, mask, _, y, _ in padded_batches:
            step(((model(padded, mask) - y) ** 2).mean())

    def grouped_epoch() -> None:  # planning ran in the collate function (DataLoader workers)
        for batch, (_, _, _, y, _) in zip(collated, padded_batches, strict=True):
            step(((batch.run(model, pass_mask=True) - y) ** 2).mean())

    def grouped_inline_epoch() -> None:  # planning, split and merge all inside the step
        for padded, _, lens, y, _ in padded_batches:
            batch = group_batch(padded, lens)
            step(((batch.run(model, pass_mask=True) - y) ** 2).mean())

    def collection_epoch() -> None:  # the asym notebook's API, items -> groups -> outputs
        for _, _, _, y, xs in padded_batches:
            dc = DataCollection("(B, L_sequence)", [x.to(device) for x in xs])
            dc.group(LengthThresholdGrouper("sequence", thresholds))
            out = dc.apply(annotated)
            out.regroup(UniGrouper())
            step(((out.data_groups[0].value - y) ** 2).mean())

    def flat_epoch() -> None:
        for tokens, owner, y in flat_batches:
            step(((model.flat(tokens, owner, len(y)) - y) ** 2).mean())

    contenders = {
        "padded": padded_epoch,
        "grabkit grouped (collate plans)": grouped_epoch,
        "grabkit grouped (plans inline)": grouped_inline_epoch,
        "grabkit DataCollection (asym API)": collection_epoch,
        "flattened lower bound": flat_epoch,
    }
    peaks = {}
    if device.type == "cuda":
        for name, fn in contenders.items():
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**20
    times = time_side_by_side(contenders, rounds=rounds, warmup=2, device=device)
    base = times["padded"]
    groups = statistics.mean(len(b.plan) for b in collated)
    lines = [
        f"Training epoch ({dataset_size} sequences, batch 256, width {width}, {device.type}); "
        f"grouped runs average {groups:.1f} groups per batch",
        "",
        "| method | s / epoch | speed-up vs padded |" + (" peak MiB |" if peaks else ""),
        "|---|---|---|" + ("---|" if peaks else ""),
    ]
    for name, t in times.items():
        extra = f" {peaks[name]:.0f} |" if peaks else ""
        lines.append(f"| {name} | {t:.4f} | {base / t:.2f}x |{extra}")
    return "\n".join(lines)


def overhead_comparison(rounds: int) -> str:
    """Planning + split + merge per batch of 256 (module replaced by a tiny slice)."""
    rng = np.random.default_rng(1)
    lens_notebook = torch.tensor(notebook_lengths(256, rng))
    lens_imdb = torch.tensor(np.clip(rng.lognormal(5.2, 0.75, 256), 4, 2470).astype(np.int64))
    out = []
    for name, lens in [("notebook lengths", lens_notebook), ("log-normal lengths", lens_imdb)]:
        padded = torch.zeros(256, int(lens.max()), dtype=torch.long)

        def plan_only(lens=lens) -> None:
            plan_groups(lens)

        def plan_split_merge(lens=lens, padded=padded) -> None:
            batch = group_batch(padded, lens)
            batch.merge([x[:, 0] for x in batch.group_inputs()])

        times = time_side_by_side(
            {"plan": plan_only, "plan+split+merge": plan_split_merge}, rounds=rounds, inner=20
        )
        groups = len(plan_groups(lens))
        out.append(
            f"| {name} | {groups} | {times['plan'] * 1e3:.3f} | "
            f"{times['plan+split+merge'] * 1e3:.3f} |"
        )
    return "\n".join(
        [
            "Overhead per batch of 256 (CPU, default planning: overhead=0.02)",
            "",
            "| lengths | groups | plan ms | plan + split + merge ms |",
            "|---|---|---|---|",
            *out,
        ]
    )


def imdb_lengths(limit: int | None) -> list[int] | None:
    if not IMDB.is_file():
        return None
    lengths = []
    with tarfile.open(IMDB, "r:gz") as archive:
        for member in archive:
            if not member.isfile() or not member.name.endswith(".txt"):
                continue
            if "/train/" not in member.name and "/test/" not in member.name:
                continue
            text = archive.extractfile(member).read()
            lengths.append(len(text.split()))
            if limit and len(lengths) >= limit:
                break
    return lengths


def efficiency_comparison(limit: int | None) -> str:
    lengths = imdb_lengths(limit)
    if lengths is None:
        return f"Padding efficiency: skipped, {IMDB} not found"
    rng = np.random.default_rng(2)
    order = rng.permutation(len(lengths))
    batches = [torch.tensor(lengths)[order[i : i + 256]] for i in range(0, len(order) - 255, 256)]
    thresholds = find_thresholds(lengths, "linear", 3)
    methods = {
        "padded (one group)": lambda lens: [lens],
        f"LengthThresholdGrouper, exact find_thresholds k=3 {thresholds}": lambda lens: [
            lens[torch.bucketize(lens, torch.tensor(thresholds)) == b] for b in range(4)
        ],
        "plan_groups (overhead=0.02)": lambda lens: [lens[g] for g in plan_groups(lens).groups],
        "plan_groups (overhead=0.005)": lambda lens: [
            lens[g] for g in plan_groups(lens, overhead=0.005).groups
        ],
    }
    rows = []
    for name, split in methods.items():
        real = computed = ngroups = 0
        for lens in batches:
            parts = [p for p in split(lens) if len(p)]
            real += int(lens.sum())
            computed += sum(len(p) * int(p.max()) for p in parts)
            ngroups += len(parts)
        rows.append(f"| {name} | {real / computed:.3f} | {ngroups / len(batches):.1f} |")
    rows.append("| flattened (no padding) | 1.000 | - |")
    return "\n".join(
        [
            f"Padding efficiency (real / computed tokens) on {len(lengths)} IMDB reviews "
            f"(whitespace tokens, {len(batches)} random batches of 256)",
            "",
            "| method | efficiency | groups / batch |",
            "|---|---|---|",
            *rows,
        ]
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_group")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    width = (8192 if device.type == "cuda" else 1024) if not args.quick else 128
    print(machine_description(), flush=True)
    start = time.perf_counter()
    print()
    print(training_comparison(width, 1024, rounds=3 if args.quick else 10, device=device))
    print()
    print(overhead_comparison(rounds=5 if args.quick else 20))
    print()
    print(efficiency_comparison(limit=2000 if args.quick else None))
    synchronize(device)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
