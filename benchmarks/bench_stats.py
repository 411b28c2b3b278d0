"""GraB in an ordinary training loop: cost of hook statistics vs per-example gradients.

Two workloads, each timed side by side in one run (interleaved rounds, medians):

* ``mlp``: MNIST, B = 64, an MLP 784-784-64-10 (666,330 parameters);
* ``lenet``: CIFAR-10 (the lossless subset), B = 16, LeNet-5 (62,006 parameters), the GraB
  paper's CNN workload: small layers, so the fixed cost per layer and per step shows;
* ``lm``:  PTB, B = 32, T = 64, a 2-block transformer LM (d_model 128, 4 heads, vocab 10,000);
* ``gpt``: random tokens, B = 16, T = 64, a nanoGPT-shaped LM (vocab 2000, d 128, 2 blocks,
  positions ``arange(T)``), untied and tied head: norms-only and norms + Gram reads over a plain
  step, and the MiB of tensors the engine holds for one step.
* ``identity``: the run-time identity check's cost, check on against off (and the functional-use
  watch off too), on the MLP's hook-mode GraB pair step and the tied small GPT's step reading
  norms (or sketches), each in exact and sketch mode, as a fraction of a plain step; and the
  thread CPU time spent inside the check's own code per step (its methods wrapped), against a
  plain step timed between the steps.

Contenders, each with its own copy of the model and its own SGD optimizer:

* ``plain``: forward, ``loss.backward()``, ``optimizer.step()``;
* ``hook-pair`` / ``hook-mean``: the same loop with ``GraBSampler(model=...)`` and
  ``sampler.step()`` (statistics from ``grabkit.stats.PerSampleStats``); asked for by name only:
  ``hook-pair-nocheck`` / ``hook-mean-nocheck``, the same without the run-time identity check
  (``stats_options={"check_identity": False}``), and ``hook-mean-stale`` (also ``-nocheck``),
  mean balancing against a stale mean: an epoch of 640 examples, the first one stepped through
  before timing, so that every timed step balances against the previous epoch's mean;
  ``sketch-pair`` (also ``-nocheck``): ``statistics="sketch", sketch_dim=1024``;
* ``func-pair`` / ``func-mean``: torch.func ``vmap(grad)`` per-example gradients, then
  ``sampler.step(grads)``, the optimizer fed their mean;
* ``opacus-pair``: Opacus ``GradSampleModule`` per-example gradients + ``sampler.step(grads)``
  (when opacus imports).

Peak memory: each contender runs a few steps in a fresh subprocess on synthetic batches of the
same shapes; the figure is the process's peak RSS during the steps (``VmHWM``, reset just before
the first step) minus its RSS before them, i.e. what the training steps themselves add (Linux).

Engine costs: one backward's hook statistics read cold (norms, Gram, dot with 2 vectors, weighted
sum with 1 and 2 weight columns), as a fraction of the plain step.

Operation counts (``--count-ops``, ``benchmarks/op_count.py``): instead of the timings above,
the tensor operations and Python calls of one warmed-up step of each contender (by default
``COUNTED_KINDS``), in all and inside ``sampler.step()``: deterministic where times are noisy;
beside them the thread CPU time of ``sampler.step()`` alone (``--rounds`` steps, default 40),
each step followed by a plain step timed for the ratio.

Usage: ``python benchmarks/run.py stats [--quick] [--threads=N] [--workloads=mlp,lm,gpt]
[--contenders=plain,hook-pair,hook-mean] [--rounds=N] [--count-ops]`` (default 1 torch thread;
``--quick`` runs the MLP only, few rounds, random data). An A/B of two checkouts runs this
command alternately with ``PYTHONPATH`` pointing at each one's ``src``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

if __package__ in (None, ""):  # run as a script (the memory subprocesses)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DATA, machine_description, time_side_by_side
from grabkit.order import GraBSampler
from grabkit.stats import HookGradientBatch, PerSampleStats

MEMORY_STEPS = 4
WARMUP = 2
STALE_EPOCH = 640  # examples per epoch of the ``hook-mean-stale`` contenders
OPT_IN_KINDS = ("hook-pair-nocheck", "hook-mean-nocheck", "hook-mean-stale",
                "hook-mean-stale-nocheck", "sketch-pair", "sketch-pair-nocheck")  # fmt: skip
# what ``--count-ops`` counts unless --contenders names others
COUNTED_KINDS = ("plain", "hook-pair", "hook-pair-nocheck", "hook-mean-nocheck",
                 "hook-mean-stale-nocheck", "sketch-pair", "sketch-pair-nocheck")  # fmt: skip


# -- models -------------------------------------------------------------------------------------
def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 784), nn.ReLU(), nn.Linear(784, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )  # fmt: skip


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        a = self.ln1(h)
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2)
            for z in (self.query(a), self.key(a), self.value(a))
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(attn.transpose(1, 2).reshape(b, t, -1))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class TransformerLM(nn.Module):
    def __init__(self, vocab: int, length: int, dim: int = 128, heads: int = 4, blocks: int = 2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(blocks)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        h = self.tokens(idx) + self.positions(torch.arange(t, device=idx.device).expand(b, t))
        return self.head(self.norm(self.blocks(h)))


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B,) losses: cross-entropy, averaged over positions for sequences."""
    if out.dim() == 3:
        return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(dim=1)
    return F.cross_entropy(out, y, reduction="none")


# -- data ---------------------------------------------------------------------------------------
def mnist_batches(count: int, batch: int, synthetic: bool) -> tuple[list, int, str]:
    path = DATA / "mnist" / "train-images-idx3-ubyte.gz"
    if synthetic or not path.exists():
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(batch, 1, 28, 28, generator=gen) for _ in range(count)]
        return [(x, torch.randint(0, 10, (batch,), generator=gen)) for x in xs], 60000, "random"
    with gzip.open(path) as f:
        images = torch.frombuffer(bytearray(f.read()[16:]), dtype=torch.uint8)
    with gzip.open(DATA / "mnist" / "train-labels-idx1-ubyte.gz") as f:
        labels = torch.frombuffer(bytearray(f.read()[8:]), dtype=torch.uint8).long()
    images = (images.view(-1, 1, 28, 28).float() / 255 - 0.1307) / 0.3081
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(0))
    picks = order[: count * batch].view(count, batch)
    return [(images[p], labels[p]) for p in picks], images.shape[0], "MNIST train"


def cifar_batches(count: int, batch: int, synthetic: bool) -> tuple[list, int, str]:
    if not synthetic:
        try:
            from benchmarks.experiments.data import cifar10_subset

            x, y, _, _ = cifar10_subset()
        except (FileNotFoundError, ImportError):
            synthetic = True
    if synthetic:
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(4000, 3, 32, 32, generator=gen), torch.randint(0, 10, (4000,))
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    picks = order.repeat(-(-count * batch // x.shape[0]))[: count * batch].view(count, batch)
    source = "random images" if synthetic else "CIFAR-10 lossless subset"
    return [(x[p], y[p]) for p in picks], x.shape[0], source


def ptb_batches(count: int, batch: int, length: int, synthetic: bool) -> tuple[list, int, str]:
    path = DATA / "ptb" / "ptb.train.txt"
    vocab = 10000
    if synthetic or not path.exists():
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (count * batch * (length + 1),), generator=gen)
        source = "random tokens"
    else:
        words = path.read_text().replace("\n", " <eos> ").split()
        table = {w: i for i, (w, _) in enumerate(Counter(words).most_common(vocab))}
        ids = torch.tensor([table[w] for w in words])
        source = "PTB train"
    windows = ids.numel() // (length + 1)
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, ids.numel() - length - 1, (count, batch), generator=gen)
    offsets = torch.arange(length + 1)
    out = []
    for row in starts:
        seq = ids[row[:, None] + offsets]
        out.append((seq[:, :-1], seq[:, 1:]))
    return out, windows, source


# -- contenders ---------------------------------------------------------------------------------
class Loop:
    """One contender: its own model copy, optimizer, and (maybe) sampler, over shared batches."""

    def __init__(self, kind: str, model: nn.Module, n: int, batches: list) -> None:
        self.kind, self.batches, self.n, self.position = kind, batches, n, 0
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.sampler: GraBSampler | None = None
        self.stepped = 0
        family, _, spec = kind.partition("-")
        balance, *variant = spec.split("-")
        if family in ("hook", "sketch"):
            options = {"check_identity": False} if "nocheck" in variant else None
            self.n = n = STALE_EPOCH if "stale" in variant else n
            sketch = {"statistics": "sketch", "sketch_dim": 1024} if family == "sketch" else {}
            self.sampler = GraBSampler(
                range(n), model=model, balance_type=balance, stats_options=options, **sketch
            )
        elif kind.startswith(("func", "opacus")):
            params = dict(model.named_parameters())
            self.sampler = GraBSampler(range(n), params, balance_type=balance)
        if kind.startswith("opacus"):
            from opacus import GradSampleModule

            self.model = GradSampleModule(model, batch_first=True, loss_reduction="mean")
        self.names = [name for name, _ in model.named_parameters()]
        self.step: Callable[[], None] = {
            "plain": self.plain_step,
            "hook": self.plain_step,
            "sketch": self.plain_step,
            "func": self.func_step,
            "opacus": self.opacus_step,
        }[kind.partition("-")[0]]
        if self.sampler is not None:
            iter(self.sampler)
        if "stale" in variant:  # one epoch through: the timed steps have a stale mean
            for _ in range(n // batches[0][0].shape[0]):
                self.step()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batches[self.position % len(self.batches)]
        self.position += 1
        if self.sampler is not None:
            if self.stepped + x.shape[0] > self.n:
                iter(self.sampler)  # next epoch
                self.stepped = 0
            self.stepped += x.shape[0]
        return x, y

    def plain_step(self) -> None:
        x, y = self.next_batch()
        self.opt.zero_grad(set_to_none=True)
        per_example_loss(self.model(x), y).mean().backward()
        if self.sampler is not None:
            self.sampler.step()
        self.opt.step()

    def func_step(self) -> None:
        x, y = self.next_batch()
        params = {k: v.detach() for k, v in self.model.named_parameters()}

        def loss_of_one(p, xi, yi):
            out = functional_call(self.model, p, (xi.unsqueeze(0),))
            return per_example_loss(out, yi.unsqueeze(0))[0]

        grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)
        self.sampler.step(grads)
        for name, p in self.model.named_parameters():
            p.grad = grads[name].mean(dim=0)
        self.opt.step()

    def opacus_step(self) -> None:
        x, y = self.next_batch()
        self.model.zero_grad(set_to_none=True)
        per_example_loss(self.model(x), y).mean().backward()
        params = self.model._module.named_parameters()
        self.sampler.step({name: p.grad_sample for name, p in params})
        self.opt.step()


def build(workload: str, synthetic: bool, rounds: int) -> tuple[Callable[[], nn.Module], list]:
    count = rounds + 8
    torch.manual_seed(0)
    if workload == "mlp":
        batches, n, source = mnist_batches(count, 64, synthetic)
    elif workload == "lenet":
        batches, n, source = cifar_batches(count, 16, synthetic)
    else:
        batches, n, source = ptb_batches(count, 32, 64, synthetic)
    state = {k: v.clone() for k, v in _model(workload).state_dict().items()}

    def fresh() -> nn.Module:
        model = _model(workload)
        model.load_state_dict(state)
        return model

    return fresh, [batches, n, source]


def _model(workload: str) -> nn.Module:
    if workload == "mlp":
        return make_mlp()
    if workload == "lenet":
        from benchmarks.experiments.models import LeNet

        return LeNet()
    return TransformerLM(10000, 64)


def opacus_available() -> str | None:
    try:
        import opacus  # noqa: F401
    except Exception as exc:  # the reason goes into the table
        return f"{type(exc).__name__}: {exc}"
    return None


# -- measurements -------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    """A memory field (VmRSS, VmHWM) of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_child(workload: str, kind: str, threads: int) -> None:
    """Print the peak-RSS growth (MiB) of MEMORY_STEPS training steps of one contender.

    The process's peak RSS is reset just before the first step (``/proc/self/clear_refs``), so
    the figure is the peak during the steps minus the RSS before them. (``ru_maxrss`` is no use
    here: Linux carries it over from the parent across fork + exec.)
    """
    torch.set_num_threads(threads)
    fresh, (batches, n, _) = build(workload, synthetic=True, rounds=MEMORY_STEPS)
    loop = Loop(kind, fresh(), n, batches[:MEMORY_STEPS])
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    for _ in range(MEMORY_STEPS):
        loop.step()
    print(json.dumps({"peak_growth_mib": (_status_kib("VmHWM") - before) / 1024}))


def peak_memory(workload: str, kind: str, threads: int) -> float:
    script = Path(__file__).resolve()
    cmd = [sys.executable, str(script), "--memory-child", workload, kind, "--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=str(script.parents[1]))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_growth_mib"]


def engine_costs(fresh, data, rounds: int) -> dict[str, float]:
    """Seconds of each cold read of one backward's statistics, and of the plain step."""
    batches, n, _ = data
    plain = Loop("plain", fresh(), n, batches)
    model = fresh()
    stats = PerSampleStats(model)
    x, y = batches[0]
    per_example_loss(model(x), y).mean().backward()
    batch = stats.gradient_batch()
    gen = torch.Generator().manual_seed(0)
    vectors = torch.randn(2, batch.dim, generator=gen)
    w1, w2 = torch.randn(x.shape[0], 1, generator=gen), torch.randn(x.shape[0], 2, generator=gen)
    signs = torch.where(w1 > 0, 1.0, -1.0)  # a GraB update: from the batch gradient
    accumulator = torch.zeros(1, batch.dim)

    def cold() -> HookGradientBatch:
        stats._statistics = None  # each read from the kept factors, nothing cached
        return stats.gradient_batch()

    costs = time_side_by_side(
        {
            "plain step": plain.step,
            "norms_squared": lambda: cold().norms_squared(),
            "gram": lambda: cold().gram(),
            "dot, k=2": lambda: cold().dot(vectors),
            "weighted_sum, k=1": lambda: cold().weighted_sum(w1),
            "weighted_sum, k=2": lambda: cold().weighted_sum(w2),
            "weighted_sum, signs": lambda: cold().weighted_sum(signs),
            "add signed sum in place": lambda: cold().add_weighted_sum_to(accumulator, signs),
            "total": lambda: cold().total(),
        },
        rounds=rounds,
    )
    stats.close()
    return costs


def timed_side_by_side(
    contenders: dict[str, Callable[[], None]], rounds: int, inner: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall seconds (``time_side_by_side``) and, from the same calls, median CPU seconds.

    CPU time (``time.process_time``) leaves out the time the process waits for a core, which on
    a shared, oversubscribed machine is most of the noise; memory stalls still count.
    """
    cpu: dict[str, list[float]] = {name: [] for name in contenders}

    def with_cpu_clock(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            start = time.process_time()
            fn()
            cpu[name].append(time.process_time() - start)

        return run

    wall = time_side_by_side(
        {name: with_cpu_clock(name, fn) for name, fn in contenders.items()},
        rounds=rounds,
        warmup=WARMUP,
        inner=inner,
    )
    return wall, {name: statistics.median(s[WARMUP:]) for name, s in cpu.items()}


def run_workload(workload: str, args: argparse.Namespace, kinds: list[str]) -> None:
    rounds = args.rounds or (4 if args.quick else (20 if workload in ("mlp", "lenet") else 6))
    inner = 1 if args.quick or workload == "lm" else 3
    fresh, data = build(workload, synthetic=args.quick, rounds=(rounds + WARMUP) * inner)
    batches, n, source = data
    loops = {kind: Loop(kind, fresh(), n, batches) for kind in kinds}
    times, cpu = timed_side_by_side(
        {k: loop.step for k, loop in loops.items()}, rounds=rounds, inner=inner
    )
    for loop in loops.values():
        if loop.sampler is not None and loop.kind.startswith(("hook", "sketch")):
            loop.sampler.close()
    memory = {k: peak_memory(workload, k, args.threads) for k in kinds}
    params = sum(p.numel() for p in fresh().parameters())
    print(
        f"\n### {workload}: {params:,} parameters, data: {source}, "
        f"{rounds} rounds x {inner} steps per contender\n"
    )
    print("| contender | wall ms / step | x plain | CPU ms / step | x plain | peak growth (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in kinds:
        print(
            f"| {k} | {times[k] * 1e3:.2f} | {times[k] / times['plain']:.2f} | "
            f"{cpu[k] * 1e3:.2f} | {cpu[k] / cpu['plain']:.2f} | {memory[k]:.1f} |"
        )
    for balance in ("pair", "mean"):
        hook, func = f"hook-{balance}", f"func-{balance}"
        if hook in times and func in times:
            print(
                f"\n{func} / {hook}: {times[func] / times[hook]:.1f}x wall, "
                f"{cpu[func] / cpu[hook]:.1f}x CPU"
            )
    costs = engine_costs(fresh, data, rounds)
    print(f"\nEngine reads on one backward ({workload}), cold, as a fraction of the plain step:\n")
    print("| read | wall ms | / plain step |")
    print("|---|---:|---:|")
    for k, v in costs.items():
        print(f"| {k} | {v * 1e3:.2f} | {v / costs['plain step']:.2f} |")


# -- gpt: a small GPT, tied or untied --------------------------------------------------------------
GPT_VOCAB, GPT_WIDTH, GPT_LAYERS, GPT_LENGTH, GPT_BATCH = 2000, 128, 2, 64, 16


class GptBlock(nn.Module):
    """Pre-norm causal self-attention (projections as Linear layers) and an MLP."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallGpt(nn.Module):
    """nanoGPT's shape: token + position embeddings (positions ``arange(T)``), optional tie."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(GPT_VOCAB, GPT_WIDTH)
        self.wpe = nn.Embedding(GPT_LENGTH, GPT_WIDTH)
        self.blocks = nn.Sequential(*(GptBlock(GPT_WIDTH) for _ in range(GPT_LAYERS)))
        self.ln = nn.LayerNorm(GPT_WIDTH)
        self.head = nn.Linear(GPT_WIDTH, GPT_VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def _held_mib(stats: PerSampleStats) -> float:
    """MiB of distinct tensor storages the engine keeps for one step (inputs, output grads)."""
    seen: dict[int, int] = {}
    calls = [call for layer in stats._layers for call in layer.calls]
    pending = [(call.captured, list(call.grads.values())) for call in calls]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, (tuple, list)):  # a recurrent call keeps several tensors
            pending.extend(item)
    return sum(seen.values()) / 2**20


def _time_reads(
    models: dict[str, Callable[[], nn.Module]],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    rounds: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """Time a plain step, a step reading norms and one reading norms + Gram for each model
    (name -> constructor), side by side; print the table; return (wall, CPU) seconds by
    ``"{name} {read}"``."""
    contenders: dict[str, Callable[[], None]] = {}
    engines: dict[str, PerSampleStats] = {}
    for name, make in models.items():
        for read in ("plain", "norms", "norms+gram"):
            torch.manual_seed(0)
            model = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            stats = None if read == "plain" else PerSampleStats(model)
            if stats is not None:
                engines[f"{name} {read}"] = stats

            def step(model=model, opt=opt, stats=stats, read=read) -> None:
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if stats is not None:
                    stats.norms_squared()
                    if read == "norms+gram":
                        stats.gram()
                opt.step()

            contenders[f"{name} {read}"] = step
    times, cpu = timed_side_by_side(contenders, rounds=rounds, inner=1)
    print("| model | read | wall ms / step | x plain | CPU ms / step | x plain | held MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key in contenders:
        name, read = key.split(" ")
        base = f"{name} plain"
        held = f"{_held_mib(engines[key]):.1f}" if key in engines else "-"
        print(
            f"| {name} | {read} | {times[key] * 1e3:.1f} | {times[key] / times[base]:.2f} | "
            f"{cpu[key] * 1e3:.1f} | {cpu[key] / cpu[base]:.2f} | {held} |"
        )
    for stats in engines.values():
        stats.close()
    return times, cpu


def run_gpt(args: argparse.Namespace) -> None:
    """Norms-only and norms + Gram steps over a plain step, tied vs untied head."""
    rounds = args.rounds or (4 if args.quick else 10)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_LENGTH), generator=gen)
    print(
        f"\n### gpt: vocab {GPT_VOCAB}, d = {GPT_WIDTH}, {GPT_LAYERS} blocks, T = {GPT_LENGTH}, "
        f"B = {GPT_BATCH}; {rounds} rounds\n"
    )
    models = {"untied": lambda: SmallGpt(False), "tied": lambda: SmallGpt(True)}
    _time_reads(models, idx, idx, rounds)


# -- lstm: a recurrent LM beside a feed-forward counterpart --------------------------------------
LSTM_VOCAB, LSTM_WIDTH, LSTM_LENGTH, LSTM_BATCH = 2000, 128, 64, 16


class RecurrentLm(nn.Module):
    """Embedding -> one middle block over every position -> head over the vocabulary.

    ``lstm``: a one-layer ``nn.LSTM`` (131,584 parameters); ``feed-forward``: its counterpart of
    about the same size without recurrence, Linear(d, 4d) -> tanh -> Linear(4d, d) per
    position (131,712 parameters).
    """

    def __init__(self, middle: str) -> None:
        super().__init__()
        self.embedding = nn.Embedding(LSTM_VOCAB, LSTM_WIDTH)
        self.recurrent = middle == "lstm"
        width = LSTM_WIDTH
        self.middle = (
            nn.LSTM(width, width, batch_first=True)
            if self.recurrent
            else nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
        )
        self.head = nn.Linear(width, LSTM_VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        return self.head(self.middle(x)[0] if self.recurrent else self.middle(x))


def run_lstm(args: argparse.Namespace) -> None:
    """Norms-only and norms + Gram steps over a plain step: LSTM LM vs feed-forward LM."""
    rounds = args.rounds or (4 if args.quick else 10)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, LSTM_VOCAB, (LSTM_BATCH, LSTM_LENGTH + 1), generator=gen)
    print(
        f"\n### lstm: vocab {LSTM_VOCAB}, d = {LSTM_WIDTH}, T = {LSTM_LENGTH}, "
        f"B = {LSTM_BATCH}; {rounds} rounds\n"
    )
    models = {m: (lambda m=m: RecurrentLm(m)) for m in ("feed-forward", "lstm")}
    _, cpu = _time_reads(models, idx[:, :-1], idx[:, 1:], rounds)
    for read in ("norms", "norms+gram"):
        ratio = (cpu[f"lstm {read}"] / cpu["lstm plain"]) / (
            cpu[f"feed-forward {read}"] / cpu["feed-forward plain"]
        )
        print(f"\nLSTM / feed-forward, {read} over plain (CPU): {ratio:.2f}x")


# -- identity: the cost of the run-time identity check ---------------------------------------------
def _gpt_reader(mode: str, options: dict | None, idx: torch.Tensor) -> Callable[[], None]:
    """A small-GPT (tied head) training step reading norms (exact) or sketches, or a plain one."""
    from grabkit.stats.sketch import SketchedStats

    torch.manual_seed(0)
    model = SmallGpt(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = None
    if options is not None:
        kind = PerSampleStats if mode == "exact" else SketchedStats
        stats = kind(model, **options)
    read = None
    if stats is not None:
        read = stats.norms_squared if mode == "exact" else stats.sketches

    def step() -> None:
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if read is not None:
            read()
        opt.step()

    return step


def _mlp_grab(fresh, data, mode: str, options: dict | None) -> Callable[[], None]:
    """The MLP's hook-mode GraB pair step (exact or sketched, k = 1024), or a plain one."""
    batches, n, _ = data
    loop = Loop("plain", fresh(), n, batches)
    if options is not None:
        extra = {"statistics": "sketch", "sketch_dim": 1024} if mode == "sketch" else {}
        loop.sampler = GraBSampler(
            range(n), model=loop.model, balance_type="pair", stats_options=options, **extra
        )
        iter(loop.sampler)
    return loop.step


IDENTITY_OPTIONS = {
    "check on": {},
    "check every step": {"check_identity": "always"},
    "check off": {"check_identity": False},
    "check off, no functional uses": {"check_identity": False, "functional_uses": False},
}


class _CheckClock:
    """Thread CPU time spent inside the identity check's own code (its hooks' probes, the read,
    the step's schedule, the precision scan), by wrapping those methods while it is used.

    The wrapper's own cost per call is taken off, as measured in the loop (``calibrate()``
    after each step times a wrapped no-op): in the loop, between GEMMs that evict the caches, a
    wrapped call costs some 10 us more than in a tight loop, as much as the schedule's own
    decision."""

    def __init__(self) -> None:
        from grabkit.stats import engine, identity

        self.spent = 0.0
        self.calls = 0
        self._noop_spent = 0.0
        self._noop_calls = 0
        self._patched = [
            (identity.IdentityCheck, "observe"),
            (identity.IdentityCheck, "verify"),
            (identity.IdentityCheck, "begin_step"),
            (identity.IdentityCheck, "_decide"),
            (engine.PerSampleStats, "_low_precision"),
        ]
        self._originals = [getattr(owner, name) for owner, name in self._patched]

    def __enter__(self) -> _CheckClock:
        for (owner, name), original in zip(self._patched, self._originals, strict=True):
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, name), original in zip(self._patched, self._originals, strict=True):
            setattr(owner, name, original)

    def _timed(self, original: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.calls += 1
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent += time.thread_time() - start

        return timed

    def calibrate(self) -> None:
        """Time one wrapped no-op here (in the loop), not counted as the check's."""
        spent, calls = self.spent, self.calls
        self._timed(_noop)()
        self._noop_spent += self.spent - spent
        self._noop_calls += 1
        self.spent, self.calls = spent, calls

    def own_per_call(self) -> float:
        """The wrapper's mean cost per call in the loop (seconds)."""
        return self._noop_spent / self._noop_calls if self._noop_calls else 0.0


def _noop() -> None:
    return None


def _own_cost(step: Callable[[], None], plain: Callable[[], None], steps: int) -> tuple:
    """(mean CPU seconds of the check's own code per step, median plain step), alternating (a
    mean: the scheduled check runs on some steps only)."""
    own: list[tuple[float, int]] = []
    plain_times = []
    with _CheckClock() as clock:
        for _ in range(steps):
            spent, calls = clock.spent, clock.calls
            step()
            clock.calibrate()
            own.append((clock.spent - spent, clock.calls - calls))
            start = time.thread_time()
            plain()
            plain_times.append(time.thread_time() - start)
    per_call = clock.own_per_call()
    return statistics.fmean(s - c * per_call for s, c in own), statistics.median(plain_times)


def run_identity(args: argparse.Namespace) -> None:
    """The identity check's cost: each workload's hook-mode step with the check on and off (and
    without the functional-use watch), beside a plain step, interleaved (CPU medians)."""
    rounds = args.rounds or (4 if args.quick else 30)
    fresh, data = build("mlp", synthetic=args.quick, rounds=(rounds + WARMUP) * 3)
    idx = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_LENGTH), generator=torch.Generator())
    print(f"\n### identity: check on / off, {rounds} rounds (CPU time medians)\n")
    print("| workload | mode | contender | CPU ms / step | x plain |")
    print("|---|---|---|---:|---:|")
    for workload in ("mlp", "gpt"):
        inner = 3 if workload == "mlp" else 1
        for mode in ("exact", "sketch"):
            contenders: dict[str, Callable[[], None]] = {}
            for label, options in {"plain": None, **IDENTITY_OPTIONS}.items():
                if workload == "mlp":
                    contenders[label] = _mlp_grab(fresh, data, mode, options)
                else:
                    contenders[label] = _gpt_reader(mode, options, idx)
            _, cpu = timed_side_by_side(contenders, rounds=rounds, inner=inner)
            for label in contenders:
                print(
                    f"| {workload} | {mode} | {label} | {cpu[label] * 1e3:.3f} | "
                    f"{cpu[label] / cpu['plain']:.3f} |"
                )
            always = (cpu["check every step"] - cpu["check off"]) / cpu["plain"]
            watch = (cpu["check off"] - cpu["check off, no functional uses"]) / cpu["plain"]
            steps = rounds * inner
            own, plain = _own_cost(contenders["check on"], contenders["plain"], 4 * steps)
            every, _ = _own_cost(contenders["check every step"], contenders["plain"], steps)
            print(
                f"| {workload} | {mode} | **the check's own code per step (mean): scheduled "
                f"{own * 1e3:.3f} ms = {own / plain:.2%} of plain, every step "
                f"{every * 1e3:.3f} ms = {every / plain:.2%}; every step on - off (A/B): "
                f"{always:+.2%} of plain; functional-use watch: {watch:+.2%}** | | |"
            )


def count_ops(workload: str, args: argparse.Namespace, kinds: list[str]) -> None:
    """Tensor operations and Python calls per step of each contender (``op_count``)."""
    from benchmarks.op_count import count_step

    fresh, (batches, n, source) = build(workload, synthetic=args.quick, rounds=24)
    steps = args.rounds or 40
    print(
        f"\n### {workload}: operations per step (data: {source}; median of 3 steps after 10), "
        f"and the thread CPU time of sampler.step() (median of {steps}, each beside a plain "
        "step)\n"
    )
    print(
        "| contender | tensor ops / step | in sampler.step() | Python calls / step | in step() "
        "| step() CPU ms | x plain step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    plain = Loop("plain", fresh(), n, batches)
    for kind in kinds:
        loop = Loop(kind, fresh(), n, batches)
        _, totals = count_step(loop.step, loop.sampler)
        timed = "- | -"
        if loop.sampler is not None:
            own, beside = _sampler_cpu(loop, plain, steps)
            timed = f"{own * 1e3:.3f} | {own / beside:.3f}"
            loop.sampler.close()
        print(
            f"| {kind} | {totals['ops']:g} | {totals['sampler_ops']:g} | {totals['calls']:g} | "
            f"{totals['sampler_calls']:g} | {timed} |"
        )


def _sampler_cpu(loop: Loop, plain: Loop, steps: int) -> tuple[float, float]:
    """(median thread CPU seconds of ``loop``'s ``sampler.step()``, median of a plain step),
    the plain step run after each of ``steps`` steps of ``loop`` (the same cache state)."""
    inner, own, beside = loop.sampler.step, [], []

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            own.append(time.thread_time() - start)

    loop.sampler.step = timed
    try:
        for _ in range(steps):
            loop.step()
            start = time.thread_time()
            plain.step()
            beside.append(time.thread_time() - start)
    finally:
        del loop.sampler.step
    return statistics.median(own), statistics.median(beside)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_stats", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds on random data")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--rounds", type=int, default=0, help="timing rounds (0: default)")
    parser.add_argument(
        "--workloads",
        default=None,
        help="comma-separated: mlp,lenet,lm,gpt,lstm,identity (default all; --quick: mlp)",
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help="comma-separated subset of the MLP / LM contenders (plain is always timed), e.g. "
        "plain,hook-pair,hook-mean for an A/B of the hook path between two checkouts; also "
        "hook-pair-nocheck, hook-mean-nocheck, hook-mean-stale, hook-mean-stale-nocheck",
    )
    parser.add_argument(
        "--count-ops", action="store_true", help="count tensor ops and Python calls per step"
    )
    parser.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "KIND"))
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child, args.threads)
        return
    torch.set_num_threads(args.threads)
    print(machine_description())
    if args.count_ops:
        kinds = COUNTED_KINDS if args.contenders is None else args.contenders.split(",")
        for workload in (args.workloads or "mlp").split(","):
            count_ops(workload, args, list(kinds))
        return
    kinds = ["plain", "hook-pair", "hook-mean", "func-pair", "func-mean"]
    wanted = None if args.contenders is None else {"plain", *args.contenders.split(",")}
    kinds += sorted(k for k in wanted or () if k not in kinds and k in OPT_IN_KINDS)
    missing = opacus_available() if wanted is None or "opacus-pair" in wanted else "not asked for"
    if missing is None:
        kinds.append("opacus-pair")
    else:
        print(f"\nopacus not measured: {missing}")
    if wanted is not None:
        kinds = [k for k in kinds if k in wanted]
    workloads = args.workloads or ("mlp" if args.quick else "mlp,lenet,lm,gpt,lstm,identity")
    for workload in workloads.split(","):
        if workload == "identity":
            run_identity(args)
        elif workload == "gpt":
            run_gpt(args)
        elif workload == "lstm":
            run_lstm(args)
        else:
            run_workload(workload, args, kinds)


if __name__ == "__main__":
    main(sys.argv[1:])
