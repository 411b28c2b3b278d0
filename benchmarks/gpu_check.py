"""The GPU check: the CUDA test tier and the GPU benchmarks, within 8 minutes, one command.

    python -m benchmarks.gpu_check [--out FILE] [--budget SECONDS]

Run from the repository root after the project's own install step (on a GPU machine without the
CPU torch pin: ``pip install -e ".[test]"``); it needs no dataset and no network. Stages, in
order, each written to ``--out`` (default ``benchmarks/out/gpu_check.md``) as soon as it ends, in
the ``benchmarks/RESULTS.md`` format (ratios of contenders timed side by side, interleaved
rounds, medians):

1. the CUDA test tier: every test that skips without a CUDA device (``benchmarks.gpu_tier``);
2. GraB on the GPU: a plain step vs exact hook-mode GraB (pair, mean) vs sketched hook-mode GraB
   (pair, k = 1024), on the MLP 784-784-64-10 (B = 64 and 512) and the small GPT (vocab 2000,
   d 128, 2 blocks, T 64; B = 16 and 64);
3. per-example statistics against Opacus (when it is installed): squared norms of every example's
   gradient, grabkit's hooks vs Opacus' ``GradSampleModule``, over a plain step;
4. grouping: the asym notebook workload at width 8192, padded vs grouped vs the padding-free
   bound, with peak memory;
5. the noise scale: ``PerExampleNoiseScale`` and ``AccumulationNoiseScale`` (K = 4) over the
   plain step they ride on, MLP 64-1024-1024-10, batch 128.

A stage that would not fit in the time left is skipped and says so; a stage that fails writes its
error and the check goes on. Cut short (Ctrl-C, ``timeout``'s SIGTERM), it prints how far it got;
the file holds every finished stage. Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_description, time_side_by_side  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "out" / "gpu_check.md"


class Budget:
    """Seconds left before the check's deadline."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


# -- stage 1: the CUDA test tier ----------------------------------------------------------------
def cuda_test_files() -> list[str]:
    """Test files that mention CUDA (collected, then narrowed to the tier by the plugin)."""
    files = sorted(ROOT.glob("tests/**/test_*.py"))
    return [str(p.relative_to(ROOT)) for p in files if "cuda" in p.read_text(encoding="utf-8")]


def cuda_tests(device: torch.device, quick: bool, budget: Budget) -> str:
    files = cuda_test_files()
    command = [sys.executable, "-m", "pytest", "-p", "benchmarks.gpu_tier", "-q", "-rfEs", *files]
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    limit = max(30.0, min(240.0, budget.left() - 200.0))
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=limit)  # fmt: skip
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = f"{expired.stdout or ''}\n(stopped after {limit:.0f} s)", "timeout"
    lines = output.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"passed|failed|error|skipped", ln)),
                   lines[-1] if lines else "no output")  # fmt: skip
    problems = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    text = (
        f"`python -m pytest -p benchmarks.gpu_tier {' '.join(files)}` (exit {code}): "
        f"**{summary.strip('= ')}**\n"
    )
    if problems:
        text += "\n" + "\n".join(f"- `{p}`" for p in problems[:40]) + "\n"
    return text


# -- stage 2: GraB on the GPU -------------------------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 784), nn.ReLU(), nn.Linear(784, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )  # fmt: skip


class _GptBlock(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        b, t, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallGpt(nn.Module):
    """nanoGPT's shape as in ``bench_stats``: vocab 2000, d 128, 2 blocks, T 64, untied head."""

    def __init__(self, vocab: int = 2000, width: int = 128, length: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(_GptBlock(width), _GptBlock(width))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        # positions with an explicit batch dim: with B == T a (T,) input is ambiguous to the hooks
        positions = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        x = self.wte(idx) + self.wpe(positions)
        return self.head(self.ln(self.blocks(x)))


def _batches(workload: str, batch: int, device: torch.device, count: int = 8) -> list:
    g = torch.Generator().manual_seed(0)
    if workload == "mlp":
        xs = [torch.randn(batch, 1, 28, 28, generator=g) for _ in range(count)]
        ys = [torch.randint(0, 10, (batch,), generator=g) for _ in range(count)]
    else:
        xs = [torch.randint(0, 2000, (batch, 64), generator=g) for _ in range(count)]
        ys = [torch.randint(0, 2000, (batch, 64), generator=g) for _ in range(count)]
    return [(x.to(device), y.to(device)) for x, y in zip(xs, ys, strict=True)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


GRAB_CONTENDERS = {
    "plain": None,
    "exact hook pair": {"balance_type": "pair"},
    "exact hook mean": {"balance_type": "mean"},
    "sketch hook pair (k=1024)": {"balance_type": "pair", "statistics": "sketch",
                                  "sketch_dim": 1024},
}  # fmt: skip


def _grab_step(make: Callable[[], nn.Module], options: dict | None, batches: list, device):
    """A step function: forward, backward, (sampler.step()), SGD step; its own model copy."""
    from grabkit.order import GraBSampler

    model = make().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = len(batches[0][0])
    sampler = None
    if options is not None:
        sampler = GraBSampler(range(batch * 10_000), model=model, batch_size=batch, **options)
        iter(sampler)
    position = [0]

    def step() -> None:
        x, y = batches[position[0] % len(batches)]
        position[0] += 1
        optimizer.zero_grad(set_to_none=True)
        _loss(model(x), y).backward()
        if sampler is not None:
            sampler.step()
        optimizer.step()

    return step


def grab_on_gpu(device: torch.device, quick: bool, budget: Budget) -> str:
    rounds = 3 if quick else 20
    settings = [("mlp", 64), ("mlp", 512), ("gpt", 16), ("gpt", 64)]
    if quick:
        settings = [("mlp", 8), ("gpt", 2)]
    rows = []
    for workload, batch in settings:
        torch.manual_seed(0)
        make = _mlp if workload == "mlp" else SmallGpt
        init = make().state_dict()

        def fresh(make=make, init=init) -> nn.Module:
            model = make()
            model.load_state_dict(init)
            return model

        batches = _batches(workload, batch, device)
        steps = {name: _grab_step(fresh, opts, batches, device)
                 for name, opts in GRAB_CONTENDERS.items()}  # fmt: skip
        times = time_side_by_side(steps, rounds=rounds, warmup=3, device=device)
        label = "MLP 784-784-64-10" if workload == "mlp" else "small GPT (T 64)"
        for name, seconds in times.items():
            rows.append(f"| {label} | {batch} | {name} | {1000 * seconds:.2f} | "
                        f"{seconds / times['plain']:.2f}x |")  # fmt: skip
    return (
        f"{rounds} interleaved rounds, medians; random inputs.\n\n"
        "| workload | B | contender | ms / step | vs plain |\n|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n"
    )  # fmt: skip


# -- stage 3: statistics vs Opacus --------------------------------------------------------------
def stats_vs_opacus(device: torch.device, quick: bool, budget: Budget) -> str:
    try:
        from opacus import GradSampleModule
    except ImportError as missing:
        return f'Opacus is not installed ({missing}); `pip install -e ".[bench]"` adds it.\n'
    from grabkit.stats import PerSampleStats

    batch, rounds = (8, 3) if quick else (256, 20)
    batches = _batches("mlp", batch, device)
    torch.manual_seed(0)
    plain_model, hook_model, opacus_model = (_mlp().to(device) for _ in range(3))
    stats = PerSampleStats(hook_model)
    wrapped = GradSampleModule(opacus_model, batch_first=True, loss_reduction="mean")
    position = [0]

    def data():
        position[0] += 1
        return batches[position[0] % len(batches)]

    def plain() -> None:
        x, y = data()
        plain_model.zero_grad(set_to_none=True)
        _loss(plain_model(x), y).backward()

    def hooks() -> None:
        x, y = data()
        hook_model.zero_grad(set_to_none=True)
        _loss(hook_model(x), y).backward()
        stats.norms_squared().sum().item()

    def opacus() -> None:
        x, y = data()
        wrapped.zero_grad(set_to_none=True)
        _loss(wrapped(x), y).backward()
        norms = sum(p.grad_sample.flatten(1).pow(2).sum(1) for p in opacus_model.parameters())
        norms.sum().item()

    times = time_side_by_side({"plain": plain, "grabkit hooks": hooks, "Opacus": opacus},
                              rounds=rounds, warmup=3, device=device)  # fmt: skip
    stats.close()
    rows = [f"| {name} | {1000 * s:.2f} | {s / times['plain']:.2f}x |" for name, s in times.items()]
    return (
        f"MLP 784-784-64-10, B = {batch}: forward + backward + every example's squared gradient "
        f"norm; {rounds} rounds.\n\n| contender | ms / step | vs plain |\n|---|---|---|\n"
        + "\n".join(rows) + "\n"
    )  # fmt: skip


# -- stage 4: grouping --------------------------------------------------------------------------
def grouping(device: torch.device, quick: bool, budget: Budget) -> str:
    from benchmarks.bench_group import training_comparison

    width, rounds = (128, 2) if quick else (8192, 5)
    return training_comparison(width, 1024, rounds=rounds, device=device) + "\n"


# -- stage 5: the noise scale -------------------------------------------------------------------
def _noise_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                         nn.Linear(1024, 10))  # fmt: skip


def noise_scale(device: torch.device, quick: bool, budget: Budget) -> str:
    from grabkit.noise import AccumulationNoiseScale, PerExampleNoiseScale
    from grabkit.stats import PerSampleStats

    batch, k, rounds = (16, 4, 3) if quick else (128, 4, 20)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, 64, generator=g).to(device),
             torch.randint(0, 10, (batch,), generator=g).to(device)) for _ in range(8)]  # fmt: skip
    torch.manual_seed(0)
    models = {name: _noise_mlp().to(device) for name in ("plain", "per", "acc", "acc-est")}
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}
    stats = PerSampleStats(models["per"])
    per_example = PerExampleNoiseScale.for_stats(stats, update_rate=0.02)
    accumulation = AccumulationNoiseScale(models["acc-est"], update_rate=0.02)
    position = [0]

    def step(name: str) -> None:
        x, y = data[position[0] % len(data)]
        position[0] += 1
        model, optimizer = models[name], optimizers[name]
        optimizer.zero_grad()
        if name.startswith("acc"):
            for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
                (F.cross_entropy(model(xs), ys) / k).backward()
                if name == "acc-est":
                    accumulation.end_microbatch(len(xs))
            if name == "acc-est":
                accumulation.end_step()
        else:
            F.cross_entropy(model(x), y).backward()
            if name == "per":
                per_example.observe_stats(stats)
        optimizer.step()

    times = time_side_by_side({n: (lambda n=n: step(n)) for n in models}, rounds=rounds,
                              warmup=3, device=device)  # fmt: skip
    stats.close()
    accumulation.remove()
    ms = {n: 1000 * s for n, s in times.items()}
    return (
        f"MLP 64-1024-1024-10, batch {batch}; {rounds} rounds.\n\n"
        "| estimator | baseline | ms / step | baseline ms | ratio |\n|---|---|---|---|---|\n"
        f"| PerExampleNoiseScale (PerSampleStats) | plain step | {ms['per']:.2f} | "
        f"{ms['plain']:.2f} | {ms['per'] / ms['plain']:.2f}x |\n"
        f"| AccumulationNoiseScale (K={k}) | plain accumulation | {ms['acc-est']:.2f} | "
        f"{ms['acc']:.2f} | {ms['acc-est'] / ms['acc']:.2f}x |\n"
    )


# -- the check ----------------------------------------------------------------------------------
#: (title, function, seconds it needs at least to be started)
STAGES: list[tuple[str, Callable[[torch.device, bool, Budget], str], float]] = [
    ("CUDA test tier", cuda_tests, 60.0),
    ("GraB on the GPU: plain vs exact hook vs sketched", grab_on_gpu, 60.0),
    ("Per-example statistics vs Opacus", stats_vs_opacus, 30.0),
    ("Grouping (width 8192)", grouping, 45.0),
    ("Noise scale", noise_scale, 20.0),
]


class _Stopped(BaseException):
    """SIGTERM (``timeout``, a scheduler) turned into an exception, to report how far we got."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


def run_check(out: Path, budget: Budget, device: torch.device, quick: bool) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.gpu_check" + " --quick" * quick
    header = (
        f"## GPU check ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"Command: `{command}`  \nMachine: {machine_description()}; "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    out.write_text(header)
    done: list[str] = []
    current = "start"
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        for k, (title, stage, needs) in enumerate(STAGES, 1):
            current = f"stage {k}/{len(STAGES)} ({title})"
            if budget.left() < needs:
                text = f"skipped: {budget.left():.0f} s left, the stage needs about {needs:.0f}\n"
            else:
                print(f"[{k}/{len(STAGES)}] {title} ...", flush=True)
                start = time.monotonic()
                try:
                    text = stage(device, quick, budget)
                except Exception as error:  # reported; the check goes on
                    text = f"**failed**: `{type(error).__name__}: {error}`\n"
                text += f"\n({time.monotonic() - start:.0f} s)\n"
            with out.open("a") as file:
                file.write(f"\n### {title}\n\n{text}")
            done.append(title)
            print(text, flush=True)
    except (KeyboardInterrupt, _Stopped) as stop:
        print(
            f"\ncut short ({type(stop).__name__} {stop}) during {current}; finished: "
            f"{', '.join(done) or 'nothing'}; results so far in {out}",
            flush=True,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"all {len(STAGES)} stages done; results in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for all stages")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run the stages on the CPU (tests only)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees "
            "none, so there is nothing to check here; run this on a GPU machine."
        )
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return run_check(args.out, Budget(args.budget), device, args.quick)


if __name__ == "__main__":
    raise SystemExit(main())
