"""Sketched statistics: the hook path equals the explicit map applied to per-example autograd
gradients (float64), and inner products of sketches are unbiased (Monte-Carlo over seeds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats import PerSampleStats
from grabkit.stats.sketch import (
    GradientSketch,
    SketchedStats,
    kronecker_factors,
    kronecker_split,
)

pytestmark = pytest.mark.usefixtures("float64")

B, T, VOCAB, WIDTH = 5, 4, 11, 6


class SequenceMLP(nn.Module):
    """Linear layers over (B, T, d) with LayerNorm and a bias-free output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ln = nn.Linear(3, 8), nn.LayerNorm(8)
        self.out = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.inp(x)))).mean(dim=1)


class GroupedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, groups=2, padding=1)
        self.conv1 = nn.Conv1d(6, 3, 2)
        self.head = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(2)  # (B, 6, 25)
        return self.head(torch.tanh(self.conv1(h)).mean(dim=2))


class TiedLM(nn.Module):
    """Token embedding tied to the head, positions ``arange(T)`` shared by the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(8, WIDTH)
        self.mix, self.ln = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln(x + torch.tanh(self.mix(x)))).mean(dim=1)


class Fallback(nn.Module):
    """Layers without a rule, through ``torch_func_fallback``: per-example gradients held
    outright for a 3-dim weight (Bilinear) and a vector (PReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.bilinear, self.act = nn.Bilinear(3, 3, 5), nn.PReLU(5)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.bilinear(x, x)))


def case(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if kind == "sequence":
        model, x = SequenceMLP(), torch.randn(B, T, 3, generator=gen)
    elif kind == "fallback":
        model, x = Fallback(), torch.randn(B, 3, generator=gen)
    elif kind == "conv":
        model, x = GroupedConv(), torch.randn(B, 4, 5, 5, generator=gen)
    else:
        model, x = TiedLM(), torch.randint(0, VOCAB, (B, T), generator=gen)
    classes = VOCAB if kind == "tied" else 4
    return model, x, torch.randint(0, classes, (B,), generator=gen)


def loss_per_example(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def autograd_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, d) gradient of each example's own loss, one ``torch.autograd.grad`` per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = loss_per_example(model(x[i : i + 1]), y[i : i + 1]).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["sequence", "conv", "tied", "fallback"])
def test_hook_sketch_equals_explicit_map_on_autograd_gradients(kind, reduction):
    model, x, y = case(kind)
    reference = autograd_gradients(model, x, y)  # before hooks: no step recorded
    options = {"torch_func_fallback": True} if kind == "fallback" else {}
    with SketchedStats(model, dim=64, seed=3, loss_reduction=reduction, **options) as stats:
        losses = loss_per_example(model(x), y)
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
        sketches = stats.sketches()
        matrix = stats.sketch.matrix().to(torch.float64)  # (k, d), built from the same maps
    assert matrix.shape == (64, reference.shape[1])
    expected = reference @ matrix.T
    assert sketches.shape == (B, 64) and sketches.dtype == torch.float64
    torch.testing.assert_close(sketches, expected, rtol=1e-10, atol=1e-10 * expected.abs().max())
    # the map parameter by parameter on dense gradients is the same map
    torch.testing.assert_close(stats.sketch.apply_dense(reference), expected, rtol=1e-10, atol=0)


def test_kronecker_map_is_the_explicit_kronecker_product():
    sketch = GradientSketch({"w": torch.Size([3, 4])}, dim=6, seed=0)
    m = sketch.map_for("w")
    explicit = torch.kron(m.p_out, m.p_in) / (m.k_out * m.k_in) ** 0.5
    torch.testing.assert_close(sketch.matrix(), explicit)
    assert m.k_out * m.k_in == 6


def test_maps_depend_on_seed_and_name_only():
    shapes = {"a.weight": torch.Size([5, 7]), "a.bias": torch.Size([5])}
    one, two = GradientSketch(shapes, 16, seed=4), GradientSketch(dict(shapes), 16, seed=4)
    torch.testing.assert_close(one.matrix(), two.matrix())
    other = GradientSketch(shapes, 16, seed=5)
    assert not torch.equal(one.matrix(), other.matrix())
    renamed = GradientSketch({"b.weight": shapes["a.weight"]}, 16, seed=4)
    assert not torch.equal(renamed.matrix(), one.matrix()[:, :35])


@pytest.mark.parametrize("kind", ["sequence", "tied"])
def test_inner_products_of_sketches_are_unbiased(kind):
    """Mean over 400 seeds of <S g_i, S g_j> against the exact Gram: every z-score below 5."""
    model, x, y = case(kind)
    with PerSampleStats(model) as exact:
        loss_per_example(model(x), y).mean().backward()
        gram = exact.gram()
        factors, batch_size, scale = exact.step_factors()
        estimates = []
        for seed in range(400):
            sketch = GradientSketch(exact.param_shapes, 16, seed=seed)
            s = sketch.apply(
                factors, batch_size, scale, device=torch.device("cpu"), dtype=torch.float64
            )
            estimates.append(s @ s.T)
    stacked = torch.stack(estimates)  # (seeds, B, B)
    mean, spread = stacked.mean(0), stacked.std(0) / len(estimates) ** 0.5
    z = (mean - gram) / spread
    assert float(z.abs().max()) < 5, z
    # and it is an estimate, not the exact value: the seeds disagree
    assert float(stacked.std(0).max()) > 0


def test_exact_reads_are_refused_without_batch_gradients():
    model, x, y = case("sequence")
    with SketchedStats(model, dim=16) as stats:
        loss_per_example(model(x), y).mean().backward()
        with pytest.raises(RuntimeError, match="keep_batch_gradients=False"):
            stats.engine.norms_squared()


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lin.weight, self.lin.bias)  # bypasses the layer's hooks


def test_parameter_used_functionally_is_sketched():
    torch.manual_seed(0)
    model, x = Functional(), torch.randn(4, 3)
    rows = []
    for i in range(4):
        grads = torch.autograd.grad(model(x[i : i + 1]).sum(), list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    with SketchedStats(model, dim=16, loss_reduction="sum") as stats:
        model(x).sum().backward()
        expected = GradientSketch(shapes, 16, 0).apply_dense(torch.stack(rows))
        torch.testing.assert_close(stats.sketches(), expected)


def test_parameter_used_outside_its_layer_is_refused():
    model = Functional()
    with SketchedStats(model, dim=16, functional_uses=False) as stats:
        model(torch.randn(4, 3)).sum().backward()
        with pytest.raises(RuntimeError, match="used outside its layer"):
            stats.sketches()


def test_split_is_accurate_first_then_cheap():
    assert kronecker_split(784, 784, 1024) == (32, 32)
    assert kronecker_split(10, 784, 1024) == (16, 64)  # the 10 outputs exactly
    assert kronecker_split(10000, 128, 1024) == (16, 64)  # half the cost of 32 x 32
    assert kronecker_split(128, 10000, 1024) == (64, 16)


def test_a_side_no_wider_than_its_factor_is_exact():
    sketch = GradientSketch({"w": torch.Size([10, 784])}, dim=1024, seed=0)
    p_out = sketch.map_for("w").p_out.double()
    torch.testing.assert_close(
        p_out.T @ p_out, 16 * torch.eye(10, dtype=torch.float64), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("dim", [0, -4, 1021, 2.5])
def test_bad_sketch_dim_is_refused(dim):
    with pytest.raises(ValueError, match="sketch_dim"):
        kronecker_factors(dim)


def test_sketches_are_cached_per_backward_and_renewed_by_the_next():
    model, x, y = case("sequence")
    with SketchedStats(model, dim=16) as stats:
        loss_per_example(model(x), y).mean().backward()
        first = stats.sketches()
        assert stats.sketches() is first
        loss_per_example(model(x[:3]), y[:3]).mean().backward()
        assert stats.sketches().shape == (3, 16)


def test_matrix_of_one_row_and_one_column_weights():
    """A one-row weight's output side is one orthogonal column whose strides are not the
    contiguous ones (``torch.kron`` refused it); ``matrix()`` applied to a vector is the map."""
    shapes = {"row": torch.Size([1, 6]), "column": torch.Size([5, 1]), "bias": torch.Size([3])}
    sketch = GradientSketch(shapes, dim=16, seed=0)
    matrix = sketch.matrix()
    assert matrix.shape == (16, 6 + 5 + 3)
    grads = torch.randn(4, 14, dtype=torch.float64)
    torch.testing.assert_close(sketch.apply_dense(grads), grads @ matrix.T)


class SmallKernelConv(nn.Module):
    """A convolution whose per-example gradient (3 x 12) is far smaller than its factors over
    36 positions, then one over a few positions where the outer sum is the cheaper route."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Conv2d(3, 3, 2)  # 3 x 12 weight over 6 x 6 = 36 positions
        self.wide = nn.Conv1d(3, 24, 6)  # 24 x 18 weight over 31 positions
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.small(x)).flatten(2)  # (B, 3, 36)
        return self.head(torch.tanh(self.wide(h)).mean(dim=2))


def test_each_conv_sketch_route_is_the_explicit_map():
    """A convolution is sketched from its formed per-example gradients where that is cheaper,
    else by the outer sum of its projected sides: both are the explicit map (float64)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model, x = SmallKernelConv(), torch.randn(B, 3, 7, 7, generator=gen)
    y = torch.randint(0, 4, (B,), generator=gen)
    reference = autograd_gradients(model, x, y)
    with SketchedStats(model, dim=64, seed=5) as stats:
        loss_per_example(model(x), y).mean().backward()
        sketches = stats.sketches()
        small, wide = stats.sketch.map_for("small.weight"), stats.sketch.map_for("wide.weight")
        matrix = stats.sketch.matrix().to(torch.float64)
    assert small.materialising_is_cheaper(36) and not wide.materialising_is_cheaper(31)
    expected = reference @ matrix.T
    torch.testing.assert_close(sketches, expected, rtol=1e-10, atol=1e-10 * expected.abs().max())


def test_materialising_is_chosen_for_small_kernels_over_many_positions():
    lenet_conv1 = GradientSketch({"w": torch.Size([6, 3, 5, 5])}, dim=1024, seed=0)
    assert lenet_conv1.map_for("w").materialising_is_cheaper(28 * 28)
    transformer_linear = GradientSketch({"w": torch.Size([128, 128])}, dim=1024, seed=0)
    assert not transformer_linear.map_for("w").materialising_is_cheaper(64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conv_sketch_routes_on_cuda_equal_the_cpu_ones():
    """Both convolution routes (formed per-example gradients, outer sum) on the GPU: the same
    maps, drawn on the CPU and moved, give the CPU's sketches (float64)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model, x = SmallKernelConv(), torch.randn(B, 3, 7, 7, generator=gen)
    y = torch.randint(0, 4, (B,), generator=gen)
    results = []
    for device in ("cpu", "cuda"):
        model.to(device)
        with SketchedStats(model, dim=64, seed=5) as stats:
            loss_per_example(model(x.to(device)), y.to(device)).mean().backward()
            results.append(stats.sketches().cpu())
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(results[1], results[0], rtol=1e-10, atol=1e-12)
