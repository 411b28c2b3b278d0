"""PerSampleStats lifecycle (attach, steps, close) and its errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import grabkit
from grabkit.stats import GradientBatch, LayerRule, PerSampleStats, register_rule
from grabkit.stats.factors import PerExampleFactor


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def step(model: nn.Module, b: int = 6, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, 4, generator=gen), torch.randint(0, 3, (b,), generator=gen)
    F.cross_entropy(model(x), y).backward()


def test_top_level_export_and_protocol():
    assert grabkit.PerSampleStats is PerSampleStats
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model)
        batch = stats.gradient_batch()
    assert isinstance(batch, GradientBatch)
    assert batch.dim == sum(p.numel() for p in model.parameters())
    assert batch.size == 6


def test_attaching_twice_is_refused_until_closed():
    model = mlp()
    stats = PerSampleStats(model)
    with pytest.raises(RuntimeError, match="already attached"):
        PerSampleStats(model)
    with pytest.raises(RuntimeError, match=r"already attached to this model \(directly"):
        PerSampleStats(model[0])
    outer = nn.Sequential(model)
    with pytest.raises(RuntimeError, match="already attached to this model's submodule '0'"):
        PerSampleStats(outer)
    stats.close()
    PerSampleStats(model).close()


def test_a_second_hook_mode_sampler_on_one_model_is_told_what_holds_the_first():
    from grabkit.order import GraBSampler

    model = mlp()
    sampler = GraBSampler(list(range(8)), model=model, batch_size=4)
    with pytest.raises(RuntimeError, match=r"GraBSampler\(model=...\).*sampler\.stats"):
        GraBSampler(list(range(8)), model=model, batch_size=4)
    sampler.close()


def test_a_first_argument_that_is_not_the_batch_is_named_in_the_error():
    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(5, 1)

        def forward(self, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x * weights)

    model = Weighted()
    with PerSampleStats(model), pytest.raises(ValueError, match="model's first tensor argument"):
        model(torch.rand(3, 1), torch.randn(4, 3, 5))


def test_close_removes_hooks():
    model = mlp()
    with PerSampleStats(model) as stats:
        pass
    step(model)
    with pytest.raises(RuntimeError, match="no statistics yet"):
        stats.norms_squared()


def test_each_step_replaces_the_previous_one_and_snapshots_stay_valid():
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model, b=6, seed=0)
        first = stats.gradient_batch()
        first_norms = first.norms_squared().clone()
        with torch.no_grad():  # an evaluation pass does not start a new step
            model(torch.randn(3, 4))
        torch.testing.assert_close(stats.norms_squared(), first_norms)
        model.zero_grad()
        step(model, b=4, seed=1)
        assert stats.norms_squared().shape == (4,)
        torch.testing.assert_close(first.norms_squared(), first_norms)
        assert first.size == 6


def test_total_is_the_batch_gradient_and_ignores_later_in_place_changes():
    model = mlp()
    with PerSampleStats(model, loss_reduction="mean") as stats:
        step(model)
        expected = torch.cat([p.grad.reshape(-1) * 6 for p in model.parameters()])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # changes .grad in place
        torch.testing.assert_close(stats.gradient_batch().total(), expected)
        torch.testing.assert_close(stats.gradient_batch().weighted_sum(torch.ones(6)), expected)


def test_gram_and_norms_agree_in_either_order():
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model)
        norms = stats.norms_squared()
        torch.testing.assert_close(stats.gram().diagonal(), norms)
        blocks = stats.statistics().norms_squared_by_parameter()
        assert list(blocks) == list(stats.param_shapes)
        torch.testing.assert_close(sum(blocks.values()), norms)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_total_norms_by_parameter_are_those_of_the_total(reduction):
    model = mlp()
    with PerSampleStats(model, loss_reduction=reduction) as stats:
        step(model)
        squares = stats.statistics().total_norms_squared_by_parameter()
        assert list(squares) == list(stats.param_shapes)
        named = stats.total()
        for name, square in squares.items():
            torch.testing.assert_close(square, (named[name] * named[name]).sum())


def test_bad_arguments_are_rejected_clearly():
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        PerSampleStats("model")
    with pytest.raises(ValueError, match="`loss_reduction` should be one of"):
        PerSampleStats(mlp(), loss_reduction="none")
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        PerSampleStats(frozen)


def test_bad_reads_are_rejected_clearly():
    model = mlp()
    with PerSampleStats(model) as stats:
        with pytest.raises(RuntimeError, match="no statistics yet"):
            stats.gram()
        step(model)
        with pytest.raises(ValueError, match="not a trainable parameter"):
            stats.dot({"0.running_mean": torch.zeros(5)})
        with pytest.raises(ValueError, match=r"should have the parameter's shape \(5, 4\)"):
            stats.dot({"0.weight": torch.zeros(4, 5)})
        with pytest.raises(TypeError, match="dict name -> tensor"):
            stats.dot(torch.zeros(3))
        with pytest.raises(ValueError, match=r"shape \(6,\), one weight per example"):
            stats.weighted_sum(torch.ones(5))
        batch = stats.gradient_batch()
        with pytest.raises(ValueError, match=r"`vectors` should have shape \(43,\)"):
            batch.dot(torch.zeros(42))
        with pytest.raises(ValueError, match=r"`weights` should have shape \(6,\)"):
            batch.weighted_sum(torch.zeros(5, 2))


def test_dot_with_missing_names_counts_them_as_zero():
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model)
        v = torch.randn(3, 5)
        full = {name: torch.zeros(shape) for name, shape in stats.param_shapes.items()}
        full["2.weight"] = v
        torch.testing.assert_close(stats.dot({"2.weight": v}), stats.dot(full))


def test_layer_without_rule_is_named_in_the_error():
    model = nn.Sequential(nn.Linear(3, 3), nn.PReLU())
    with pytest.raises(ValueError, match=r"layer '1' \(PReLU\) owns trainable parameters"):
        PerSampleStats(model)

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.gain

    with pytest.raises(ValueError, match=r"layer '<root>' \(Scale\).*\['gain'\]"):
        PerSampleStats(Scale())
    PerSampleStats(nn.MultiheadAttention(4, 2, batch_first=True)).close()  # has a rule now


def test_subclass_overriding_forward_gets_no_inherited_rule():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match=r"\(Doubled\)"):
        PerSampleStats(Doubled(3, 3))


def test_registered_rule_is_used_for_a_custom_layer():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.gain

    class ScaleRule(LayerRule):
        def factors(self, module, layer_input, output_grad, wanted):
            return {"gain": PerExampleFactor(layer_input * output_grad, module.gain.shape)}

    register_rule(Scale, ScaleRule())
    model = Scale()
    x = torch.randn(4, 3)
    with PerSampleStats(model, loss_reduction="sum") as stats:
        (model(x) ** 2).sum().backward()
        per_example = 2 * x * x  # d/dgain of sum (x gain)^2 at gain = 1
        torch.testing.assert_close(stats.norms_squared(), (per_example**2).sum(1))
    with pytest.raises(TypeError, match="LayerRule instance"):
        register_rule(Scale, object())


def test_tied_weights_across_layers_are_exact(float64, reference_tools):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, idx):
            return self.head(self.embed(idx))

    torch.manual_seed(3)
    model = Tied()
    idx = torch.randint(0, 7, (5, 3))
    rows = []
    for i in range(5):
        grad = torch.autograd.grad(model(idx[i : i + 1]).square().sum(), model.embed.weight)[0]
        rows.append(grad.reshape(-1))
    with PerSampleStats(model, "sum") as stats:
        model(idx).square().sum().backward()
        reference_tools.assert_matches(stats, torch.stack(rows))


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias)


def test_parameter_used_functionally_in_the_forward_is_computed(float64, reference_tools):
    torch.manual_seed(0)
    model, x = Functional(), torch.randn(4, 3)
    rows = []
    for i in range(4):
        grads = torch.autograd.grad(model(x[i : i + 1]).square().sum(), list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        reference_tools.assert_matches(stats, torch.stack(rows))


def test_parameter_used_outside_its_layer_call_is_detected():
    model = Functional()
    with PerSampleStats(model, functional_uses=False) as stats:
        model(torch.randn(2, 3)).sum().backward()
        with pytest.raises(RuntimeError, match=r"'proj\.weight' received a gradient"):
            stats.norms_squared()
    outside = nn.Sequential(nn.Linear(3, 3))
    with PerSampleStats(outside) as stats:  # a use outside the model's forward is not seen
        (outside(torch.randn(2, 3)).sum() + F.linear(torch.randn(2, 3), outside[0].weight).sum()
         ).backward()  # fmt: skip
        with pytest.raises(RuntimeError, match=r"'0\.weight'"):
            stats.norms_squared()


def test_batch_not_in_dim_zero_is_reported():
    class Reshaping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(2, 1)

        def forward(self, x):
            return self.second(self.first(x).reshape(-1, 2))

    model = Reshaping()
    with PerSampleStats(model), pytest.raises(ValueError, match=r"'second'.*not the batch"):
        model(torch.randn(3, 4))


def test_unbatched_input_is_reported():
    model = nn.Linear(3, 2)
    with PerSampleStats(model) as stats:
        model(torch.randn(3)).sum().backward()
        with pytest.raises(ValueError, match="without a batch dimension"):
            stats.norms_squared()


def test_embedding_options_without_per_example_meaning_are_refused():
    with pytest.raises(ValueError, match="sparse=True"):
        PerSampleStats(nn.Embedding(5, 2, sparse=True))
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        PerSampleStats(nn.Embedding(5, 2, scale_grad_by_freq=True))


def test_autocast_statistics_are_float32_and_close():
    model = mlp()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with PerSampleStats(model) as stats:
        F.cross_entropy(model(x), y).backward()
        exact = stats.norms_squared().clone()
    model.zero_grad()
    with PerSampleStats(model) as stats:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        approx = stats.norms_squared()
        assert approx.dtype == torch.float32
        torch.testing.assert_close(approx, exact, rtol=5e-2, atol=1e-3)


def test_functorch_transforms_do_not_disturb_the_step():
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model)
        before = stats.norms_squared().clone()
        params = {n: p.detach() for n, p in model.named_parameters()}
        torch.func.vmap(lambda x: torch.func.functional_call(model, params, (x,)))(
            torch.randn(2, 1, 4)
        )
        torch.testing.assert_close(stats.norms_squared(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_cuda():
    model = mlp().cuda()
    with PerSampleStats(model) as stats:
        x, y = torch.randn(6, 4, device="cuda"), torch.randint(0, 3, (6,), device="cuda")
        F.cross_entropy(model(x), y).backward()
        assert stats.gram().device.type == "cuda"


def test_layer_outside_the_loss_contributes_zero():
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 5)
            self.used = nn.Linear(5, 3)
            self.unused = nn.Linear(5, 2)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return self.used(h), self.unused(h)

    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(6, 4)
    with PerSampleStats(model, loss_reduction="sum") as stats:
        out, _ = model(x)
        out.pow(2).sum().backward()
        batch = stats.gradient_batch()
        summed = stats.weighted_sum(torch.ones(6))
        for name in ("unused.weight", "unused.bias"):
            assert summed[name].abs().max() == 0
            assert stats.total()[name].abs().max() == 0
        torch.testing.assert_close(batch.weighted_sum(torch.ones(6)), batch.total())
        model_only_used = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert set(model_only_used) == {"body.weight", "body.bias", "used.weight", "used.bias"}


def test_layer_called_on_batches_of_different_sizes_is_reported():
    model = mlp()
    with PerSampleStats(model) as stats:
        (model(torch.randn(3, 4)).sum() + model(torch.randn(5, 4)).sum()).backward()
        with pytest.raises(ValueError, match="same examples in every call"):
            stats.norms_squared()


def test_statistics_still_held_keep_their_totals_through_later_steps():
    """The next backward copies its batch gradient into the previous step's copies only when
    no statistics of that step are held any more."""
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model, seed=0)
        held = stats.gradient_batch()
        expected = held.total().clone()
        for seed in (1, 2):
            model.zero_grad()
            step(model, seed=seed)
            stats.norms_squared()
        torch.testing.assert_close(held.total(), expected)


def test_batch_gradient_copies_are_reused_when_nothing_holds_them():
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model, seed=0)
        stats.norms_squared()
        first = {name: g.data_ptr() for name, g in stats.statistics().batch_gradients.items()}
        model.zero_grad()
        step(model, seed=1)  # the first step's statistics were dropped by this forward
        second = stats.statistics().batch_gradients
        assert {name: g.data_ptr() for name, g in second.items()} == first
        expected = torch.cat([p.grad.reshape(-1) * 6 for p in model.parameters()])
        torch.testing.assert_close(stats.gradient_batch().total(), expected)


def test_flat_layout_cuts_views_once_per_buffer():
    from grabkit.stats.gradient_batch import FlatLayout

    layout = FlatLayout({"w": torch.Size([2, 3]), "b": torch.Size([2])})
    assert layout.dim == 8
    flat = torch.arange(16.0).reshape(2, 8)
    views = layout.views(flat)
    assert layout.views(flat) is views  # the same buffer: the same views
    views["b"].add_(100)  # views, not copies
    assert flat[:, 6:].min() >= 100
    torch.testing.assert_close(views["w"], flat[:, :6].reshape(2, 2, 3))
    strided = torch.arange(16.0).reshape(8, 2).T  # last dim not unit-stride: reshaped copies
    torch.testing.assert_close(layout.views(strided)["w"], strided[:, :6].reshape(2, 2, 3))
    del views, flat
    assert layout._cuts == []  # a buffer that is gone is forgotten with its views


def test_total_added_in_place_equals_total():
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model)
        batch = stats.gradient_batch()
        target = torch.ones(batch.dim)
        batch.add_total_to(target)
        torch.testing.assert_close(target, batch.total() + 1)
        with pytest.raises(ValueError, match="`target` should have shape"):
            batch.add_total_to(torch.zeros(1, batch.dim))


def test_total_added_in_place_into_kept_and_strided_targets():
    """A kept target (its per-parameter views cut once) and a strided one (every other number of
    a longer buffer) both receive the total exactly, in place, and nothing else changes."""
    model = mlp()
    with PerSampleStats(model) as stats:
        step(model)
        batch = stats.gradient_batch()
        kept = torch.ones(batch.dim)
        buffer = torch.full((2 * batch.dim,), 7.0)
        strided = buffer[::2]
        strided.fill_(1.0)
        for _ in range(2):  # the second time through the kept views
            batch.add_total_to(kept)
            batch.add_total_to(strided)
        torch.testing.assert_close(kept, 1 + 2 * batch.total())
        assert torch.equal(buffer[::2], kept)  # the same additions, number by number
        assert (buffer[1::2] == 7.0).all()
