"""Grouping: end-to-end training time on IMDB's real review lengths (asym).

``python -m benchmarks.experiments.grouping [--quick]``

A 1-D CNN sentiment classifier (embedding 64, Conv1d 64 -> 128 width 5, ReLU, max over the real
tokens, linear) trained with Adam 1e-3, batch 32, on 4,096 IMDB training reviews drawn at random
(seeded) at their real lengths (lower-cased whitespace tokens, 10 to 2,470 tokens here; no
truncation; vocabulary: the 20,000 most frequent words of the drawn reviews). Three ways to
run the same number of epochs, interleaved epoch by epoch so machine load hits all alike:

* ``padded``: random minibatches, each padded to its longest review;
* ``buckets``: minibatches of length-sorted neighbours (reviews sorted by length, cut into
  batches, the batch order shuffled each epoch): little padding, but *different* minibatches,
  so a different SGD trajectory;
* ``grouped``: the padded run's very minibatches through ``grabkit.group.GroupingCollate``
  (planned in the loader) and ``batch.run(model, pass_mask=True)``: each minibatch split into
  length groups, each padded to its own maximum; same minibatch, so the same loss curve.

Reported: seconds per epoch (loader + forward + backward + step), speed-up over padded, padding
efficiency (real / computed tokens), and the largest difference between the padded and grouped
per-step training losses.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from benchmarks.common import machine_description
from benchmarks.experiments import data as datasets
from benchmarks.experiments.common import (
    command_line,
    markdown_table,
    mean_spread,
    new_figure,
    parse_args,
    run_main,
    save_figure,
    write_report,
)
from grabkit.group import GroupingCollate

BATCH = 32
CONTENDERS = ["padded", "buckets", "grouped"]


class ConvClassifier(nn.Module):
    """(n, L) token ids and an (n, L) mask of real tokens -> (n,) logits."""

    def __init__(self, vocab: int, dim: int = 64, channels: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, channels, 5, padding=2)
        self.out = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).masked_fill(~mask[..., None], 0.0)  # padding reads as zeros
        h = torch.relu(self.conv(h.transpose(1, 2))).transpose(1, 2)
        h = h.masked_fill(~mask[..., None], float("-inf"))
        return self.out(h.max(1).values)[:, 0]


def encode(texts: list[list[str]], vocab_size: int) -> tuple[list[torch.Tensor], int]:
    """Token ids: 0 pads, 1 is unknown, the most frequent words follow."""
    counts = Counter(w for t in texts for w in t)
    index = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(vocab_size - 2))}
    return [torch.tensor([index.get(w, 1) for w in t], dtype=torch.int64) for t in texts], len(
        index
    ) + 2


def pad_collate(batch):
    xs, ys = zip(*batch, strict=True)
    lengths = torch.tensor([len(x) for x in xs])
    padded = pad_sequence(list(xs), batch_first=True)
    mask = torch.arange(padded.shape[1])[None] < lengths[:, None]
    return padded, mask, torch.tensor(ys, dtype=torch.float32)


def bucket_batches(lengths: list[int], seed: int, epoch: int) -> list[list[int]]:
    """Length-sorted neighbours in batches of ``BATCH``, the batch order shuffled per epoch."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    random.Random(seed * 1000 + epoch).shuffle(batches)
    return batches


def random_batches(n: int, seed: int, epoch: int) -> list[list[int]]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [perm[i : i + BATCH].tolist() for i in range(0, n, BATCH)]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__, argv, {"--epochs": {"type": int, "default": None}})
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(4, 200, (128,), generator=g).tolist()
        items = [torch.randint(2, 50, (n,), generator=g) for n in lengths]
        labels = torch.randint(0, 2, (128,), generator=g).tolist()
        vocab, source = 50, "128 random sequences, lengths 4-199"
    else:
        texts, labels = datasets.imdb_lengths_and_labels("train")
        n = 512 if args.quick else 4096
        pick = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))[:n]
        texts = [texts[i] for i in pick]
        labels = [labels[i] for i in pick]
        items, vocab = encode(texts, 20_000)
        source = f"{n} IMDB training reviews drawn at random (seed 0)"
    epochs = args.epochs or (1 if args.quick or args.synthetic else 3)
    seeds = args.seeds or (1 if args.quick or args.synthetic else 2)
    data = list(zip(items, labels, strict=True))
    lengths = [len(x) for x in items]
    grouping = GroupingCollate()

    seconds = {c: [] for c in CONTENDERS}
    losses = {c: [] for c in CONTENDERS}  # per step, seed 0
    real_tokens = {c: 0 for c in CONTENDERS}
    computed = {c: 0 for c in CONTENDERS}
    final = {c: [] for c in CONTENDERS}
    groups: list[int] = []  # groups per grouped minibatch, epoch 1 of seed 0
    for seed in range(seeds):
        models, opts = {}, {}
        for c in CONTENDERS:
            torch.manual_seed(seed)
            models[c] = ConvClassifier(vocab)
            opts[c] = torch.optim.Adam(models[c].parameters(), lr=1e-3)
        for epoch in range(epochs):
            plans = {
                "padded": random_batches(len(data), seed, epoch),
                "grouped": random_batches(len(data), seed, epoch),
                "buckets": bucket_batches(lengths, seed, epoch),
            }
            for c in CONTENDERS:
                model, opt = models[c], opts[c]
                collate = grouping if c == "grouped" else pad_collate
                loader = DataLoader(data, batch_sampler=plans[c], collate_fn=collate)
                epoch_losses = []
                start = time.perf_counter()
                for batch in loader:
                    if c == "grouped":
                        logits, y = batch.run(model, pass_mask=True), batch.extras.float()
                        if seed == 0 and epoch == 0:
                            real = sum(lengths[i] for i in plans[c][len(epoch_losses)])
                            real_tokens[c] += real
                            computed[c] += real / batch.padding_efficiency()
                            groups.append(len(batch.group_masks()))
                    else:
                        x, mask, y = batch
                        logits = model(x, mask)
                        if seed == 0 and epoch == 0:
                            real_tokens[c] += int(mask.sum())
                            computed[c] += mask.numel()
                    loss = nn.functional.binary_cross_entropy_with_logits(logits, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    epoch_losses.append(loss.item())
                seconds[c].append(time.perf_counter() - start)
                if seed == 0:
                    losses[c] += epoch_losses
                print(
                    f"seed {seed} epoch {epoch + 1} {c}: {seconds[c][-1]:.1f} s, mean loss "
                    f"{statistics.fmean(epoch_losses):.4f}",
                    flush=True,
                )
            for c in CONTENDERS:
                if epoch == epochs - 1:
                    final[c].append(
                        statistics.fmean(losses[c][-len(plans[c]) :]) if seed == 0 else float("nan")
                    )
    padded_mean = statistics.fmean(seconds["padded"])
    diff = max(abs(a - b) for a, b in zip(losses["padded"], losses["grouped"], strict=True))
    rows = [
        [
            c,
            mean_spread(seconds[c], "{:.1f}"),
            f"{padded_mean / statistics.fmean(seconds[c]):.2f}x",
            f"{real_tokens[c] / computed[c]:.2f}",
            f"{1e6 * statistics.fmean(seconds[c]) / computed[c]:.0f}",
            f"{statistics.fmean(losses[c][-len(plans[c]) :]):.4f}",
        ]
        for c in CONTENDERS
    ]
    table = markdown_table(
        [
            "contender",
            "s / epoch",
            "speed-up vs padded",
            "padding efficiency (epoch 1)",
            "µs per computed position",
            "mean training loss, last epoch (seed 0)",
        ],
        rows,
    )
    plot = plot_runs(losses, seconds, epochs, args)
    text = (
        "## Grouping: end-to-end training time on IMDB's real lengths\n\n"
        f"Command: `{command_line('grouping', args, ['epochs', 'seeds'])}`  \n"
        f"Machine: {machine_description()}\n\n"
        f"{source}; lengths {min(lengths)}-{max(lengths)} tokens (median "
        f"{statistics.median(lengths):.0f}); 1-D CNN, batch {BATCH}, Adam 1e-3, {epochs} "
        f"epoch(s) x {seeds} seed(s), contenders interleaved epoch by epoch; ± is half the "
        "min-max range over epochs and seeds.\n\n"
        f"{table}\n\n"
        f"Grouped minibatches ran as {statistics.fmean(groups):.1f} groups on average "
        f"({min(groups)}-{max(groups)}); a computed position is a (review, token) slot of a "
        "padded tensor the model ran on.\n\n"
        f"Same minibatches, same loss: the largest |padded - grouped| per-step training loss "
        f"over {len(losses['padded'])} steps is **{diff:.2e}** (float summation order only). "
        "Buckets change the minibatches, so their loss curve is a different run.\n\n"
        f"![grouping]({plot.name})\n"
    )
    write_report(args.out, "grouping.md", text)


def plot_runs(losses, seconds, epochs, args):
    figure, axes = new_figure(1, 2, width=5.2, height=3.6)
    ax = axes[0][0]
    window = 8
    for k, c in enumerate(CONTENDERS):
        values = losses[c]
        smooth = [
            statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))
        ]
        ax.plot(
            range(1, len(values) + 1),
            smooth,
            color="k" if c == "grouped" else f"C{k}",
            lw={"padded": 4.0, "buckets": 1.0, "grouped": 1.2}[c],
            ls="--" if c == "grouped" else "-",
            alpha=0.5 if c == "padded" else 1.0,
            label=c,
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"training loss (mean of last {window} steps)")
    ax.set_title("training loss per step (seed 0)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[0][1]
    means = [statistics.fmean(seconds[c]) for c in CONTENDERS]
    ax.bar(CONTENDERS, means, color=[f"C{k}" for k in range(len(CONTENDERS))])
    for k, (c, m) in enumerate(zip(CONTENDERS, means, strict=True)):
        ax.plot([k] * len(seconds[c]), seconds[c], "k.", ms=4)
        ax.text(k, m / 2, f"mean\n{m:.1f} s", ha="center", va="center", fontsize=9, color="w")
    ax.set_ylabel("seconds per epoch")
    ax.set_title("wall time per epoch (dots: each epoch)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    figure.suptitle(
        "Grouping on IMDB's real lengths: padded vs buckets vs grabkit.group", fontsize=11
    )
    return save_figure(
        figure,
        args.out,
        "grouping.png",
        "Grouped (black dashes) runs the padded run's minibatches, so its curve lies on the padded "
        "one (thick); buckets run other minibatches.",
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
