"""Adaptive accumulation: wrapper overhead per microbatch, and PTB loss at equal examples seen.

Part 1 (overhead): a ~6M-parameter MLP, AdamW, windows of 4 microbatches. Contenders, timed
interleaved in one run: plain accumulation (backward into .grad, step + zero_grad every 4th),
grabkit's GNTS and noise-scale controller, and torch-gqc's GNTS when it installs. The wrappers'
thresholds are set so that they never fire early (they still evaluate their rule every
microbatch) and step at ``max_batch_draws=4``, so all contenders do the same optimizer work.

Part 2 (PTB, skipped when ../shared/data/ptb is absent): a small neural n-gram LM; every
contender sees the same microbatches (same examples, same order) and the validation loss is read
at equal examples seen. Contenders: fixed batch (a step per microbatch), fixed batch x4, GNTS
(threshold schedule calibrated on the first microbatch norms) and the noise-scale controller.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch import nn
from torch.nn.functional import cross_entropy

from benchmarks.common import DATA, machine_description, time_side_by_side
from grabkit.accumulate import (
    OptimizerWrapperGNS,
    OptimizerWrapperGNTS,
    OptimizerWrapperSBC,
    get_norm_threshold_cosine_annealing_with_warmup,
)

PTB = DATA / "ptb"
WINDOW = 4


# ----------------------------------------------------------------------------- overhead
def overhead_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(512, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 512)
    )


def overhead(quick: bool) -> None:
    width, batch = (512, 32) if quick else (2048, 64)
    torch.manual_seed(0)
    # distinct microbatches: with one repeated batch the noise-scale estimate is ~0 and that
    # controller would step (twice as often) on the true rule
    pool = [(torch.randn(batch, 512), torch.randn(batch, 512)) for _ in range(WINDOW)]

    def contender(make_wrapper):
        model = overhead_model(width)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt = make_wrapper(inner)

        def window() -> None:  # one window of WINDOW microbatches
            for i, (x, y) in enumerate(pool):
                (model(x) - y).square().mean().backward()
                if opt is None:
                    if i == WINDOW - 1:
                        inner.step()
                        inner.zero_grad()
                else:
                    opt.step()

        return model, window

    makers = {
        "plain accumulation": lambda inner: None,
        "grabkit GNTS": lambda inner: OptimizerWrapperGNTS(
            inner, max_batch_draws=WINDOW, norm_threshold=1e-30
        ),
        "grabkit noise-scale": lambda inner: OptimizerWrapperGNS(
            inner, noise_multiplier=1e30, max_batch_draws=WINDOW
        ),
    }
    gqc_error = None
    try:
        import gradient_quality_control as gqc

        def gqc_gnts(inner):
            wrapper = gqc.OptimizerWrapperGNTS(inner, max_batch_draws=WINDOW)
            wrapper.param_groups[0]["lr"] = 1e-30  # GQC keeps its threshold in a fake 'lr'
            return wrapper

        makers["torch-gqc 0.8.1 GNTS"] = gqc_gnts
    except Exception as error:  # report why the peer is missing, keep measuring the rest
        gqc_error = f"{type(error).__name__}: {error}"

    contenders = {}
    n_params = 0
    for name, make in makers.items():
        model, window = contender(make)
        n_params = sum(p.numel() for p in model.parameters())
        contenders[name] = window
    rounds = 5 if quick else 25
    medians = time_side_by_side(contenders, rounds=rounds, warmup=2)
    base = medians["plain accumulation"]
    print(
        f"Overhead per microbatch, {n_params / 1e6:.1f}M-parameter MLP, microbatch {batch}, "
        f"AdamW, windows of {WINDOW}; median of {rounds} interleaved rounds"
    )
    print(f"Machine: {machine_description()}\n")
    print("| contender | ms / microbatch | ratio to plain |")
    print("|---|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {1e3 * seconds / WINDOW:.2f} | {seconds / base:.3f}x |")
    if gqc_error:
        print(f"\ntorch-gqc not measured: {gqc_error}")


# ----------------------------------------------------------------------------- PTB
def load_ptb(split: str, vocab: dict[str, int] | None = None):
    words = (PTB / f"ptb.{split}.txt").read_text().replace("\n", " <eos> ").split()
    if vocab is None:
        vocab = {w: i for i, (w, _) in enumerate(Counter(words).most_common())}
    return torch.tensor([vocab.get(w, vocab["<unk>"]) for w in words]), vocab


class NGramLM(nn.Module):
    """Predict a word from the previous ``context`` words (Bengio et al. 2003, small)."""

    def __init__(self, vocab: int, context: int = 3, dim: int = 32, hidden: int = 128):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(context * dim, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(windows).flatten(1)))
        return self.out(h)


def ngram_examples(tokens: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = tokens.unfold(0, context + 1, 1)
    return windows[:, :context], windows[:, context]


def validation_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy over the validation examples, in chunks (10k-word logits are big)."""
    total = 0.0
    with torch.no_grad():
        for xs, ys in zip(x.split(2048), y.split(2048), strict=True):
            total += float(cross_entropy(model(xs), ys, reduction="sum"))
    return total / len(y)


def ptb_run(name: str, seed: int, data, quick: bool) -> list[float]:
    (train_x, train_y), (valid_x, valid_y), vocab = data
    micro, n_micro = (32, 40) if quick else (128, 400)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_x), generator=gen)[: micro * n_micro].view(n_micro, micro)
    torch.manual_seed(seed)
    model = NGramLM(vocab)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def microbatch_loss(i: int) -> torch.Tensor:
        idx = order[i]
        return cross_entropy(model(train_x[idx]), train_y[idx])

    schedule = None
    if name == "fixed batch":
        opt = None
    elif name == "fixed batch x4":
        opt = OptimizerWrapperSBC(inner, micro, 4 * micro)
    elif name == "GNTS":
        # GNTS is not scale-free: calibrate the threshold on the first microbatches' norms
        probe = []
        for i in range(5):
            grads = torch.autograd.grad(microbatch_loss(i), list(model.parameters()))
            probe.append(float(torch.stack([g.norm() for g in grads]).norm()))
        start = 0.6 * statistics.median(probe)
        opt = OptimizerWrapperGNTS(inner, max_batch_draws=16)
        schedule = get_norm_threshold_cosine_annealing_with_warmup(
            opt,
            n_micro // 10,
            n_micro,
            start_norm=start,
            end_norm=0.3 * start,
            warmup_multiplier=3.0,
        )
    else:
        opt = OptimizerWrapperGNS(inner, noise_multiplier=0.5, max_batch_draws=16)
    checkpoints = {n_micro // 4 * k for k in (1, 2, 3, 4)}
    losses, steps = [], 0
    for i in range(n_micro):
        microbatch_loss(i).backward()
        if opt is None:
            inner.step()
            inner.zero_grad()
            steps += 1
        else:
            steps += opt.step(count=micro)
        if schedule is not None:
            schedule.step()
        if i + 1 in checkpoints:
            losses.append(validation_loss(model, valid_x, valid_y))
    return [*losses, steps]


def ptb(quick: bool) -> None:
    if not PTB.is_dir():
        print(f"\nPTB part skipped: {PTB} not found")
        return
    context = 3
    train, vocab = load_ptb("train")
    valid, _ = load_ptb("valid", vocab)
    valid = valid[: 2000 if quick else 20000]
    data = (ngram_examples(train, context), ngram_examples(valid, context), len(vocab))
    names = ["fixed batch", "fixed batch x4", "GNTS", "noise-scale"]
    seeds = [0] if quick else [0, 1, 2]
    results = {name: [] for name in names}
    started = time.perf_counter()
    for seed in seeds:
        for name in names:
            results[name].append(ptb_run(name, seed, data, quick))
    elapsed = time.perf_counter() - started
    micro, n_micro = (32, 40) if quick else (128, 400)
    print(
        f"\nPTB validation loss (nats/word) at equal examples seen: neural 3-gram LM, "
        f"microbatch {micro} examples, {n_micro} microbatches, AdamW 3e-3, "
        f"seeds {seeds}, mean over seeds; {elapsed:.0f} s in all\n"
    )
    marks = [f"{k * (n_micro // 4) * micro:,} ex" for k in (1, 2, 3, 4)]
    print("| contender | " + " | ".join(marks) + " | optimizer steps |")
    print("|---|" + "---|" * (len(marks) + 1))
    for name in names:
        runs = results[name]
        cols = [statistics.mean(r[k] for r in runs) for k in range(4)]
        spread = max(r[3] for r in runs) - min(r[3] for r in runs)
        steps = statistics.mean(r[4] for r in runs)
        cells = " | ".join(f"{c:.3f}" for c in cols[:3]) + f" | {cols[3]:.3f} (±{spread / 2:.3f})"
        print(f"| {name} | {cells} | {steps:.0f} |")


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    torch.set_num_threads(max(1, torch.get_num_threads()))
    overhead(quick)
    ptb(quick)
