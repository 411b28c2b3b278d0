"""The model changing under attached statistics, and layers that couple the examples without
owning a trainable parameter; each checked against per-example ``torch.autograd.grad`` in
float64, past the identity check's first steps and with the check off (a change it would catch
only on a checked step is still silent on the others).

1. Layers or parameters replaced or added after attaching (a new head, ``layer.weight =
   nn.Parameter(...)``, ``load_state_dict(..., assign=True)``, a layer appended): followed at
   the next forward, as a change of the trainable set is.
2. BatchNorm using batch statistics (training mode, or ``track_running_stats=False`` in either
   mode) with trainable layers before it: refused even where its own affine parameters are
   frozen or absent, unless ``batch_norm_constant_statistics=True``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.support.references import per_example_rows
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.parametrizations import orthogonal

from grabkit.integrations.example_norms import ExampleGradientNorms
from grabkit.order import GraBSampler
from grabkit.stats import IdentityCheckError, PerSampleStats
from grabkit.stats.sketch import GradientSketch, SketchedStats

pytestmark = pytest.mark.usefixtures("float64")

B = 5
STEPS_BEFORE_THE_CHANGE = 12  # past the identity check's first (always checked) steps


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(B, 4), torch.randint(0, 3, (B,))


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    per_example_loss(model(x), y).sum().backward()


def run_past_the_first_checks(stats, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """``STEPS_BEFORE_THE_CHANGE`` steps, each read (norms or sketches): the identity check no
    longer checks every step after them."""
    read = stats.sketches if isinstance(stats, SketchedStats) else stats.norms_squared
    for _ in range(STEPS_BEFORE_THE_CHANGE):
        step(model, x, y)
        read()


def mean_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A step of a hook-mode sampler (``loss_reduction="mean"``, its default)."""
    model.zero_grad(set_to_none=True)
    per_example_loss(model(x), y).mean().backward()


def reference_for(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return per_example_rows(
        model, lambda i: per_example_loss(model(x[i : i + 1]), y[i : i + 1]).sum(), len(x)
    )


# -- 1. the model's parameters or layers replaced or added after attaching ---------------------
def replace_head(model: nn.Sequential) -> None:
    model[2] = nn.Linear(7, 3)


def replace_a_weight(model: nn.Sequential) -> None:
    model[2].weight = nn.Parameter(torch.randn(3, 7))


def load_by_assignment(model: nn.Sequential) -> None:
    state = {name: torch.randn_like(t) for name, t in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def append_a_layer(model: nn.Sequential) -> None:
    model.append(nn.Linear(3, 3))


def wrap_the_head(model: nn.Sequential) -> None:
    model[2] = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


CHANGES: dict[str, Callable[[nn.Sequential], None]] = {
    "head replaced": replace_head,
    "weight replaced by assignment": replace_a_weight,
    "load_state_dict(assign=True)": load_by_assignment,
    "layer appended": append_a_layer,
    "head replaced by a block": wrap_the_head,
}


@pytest.mark.parametrize("check_identity", [True, False])
@pytest.mark.parametrize("change", list(CHANGES))
def test_layers_and_parameters_changed_after_attaching_are_followed(
    reference_tools, change, check_identity
):
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum", check_identity=check_identity) as stats:
        run_past_the_first_checks(stats, model, x, y)
        CHANGES[change](model)
        expected = reference_for(model, x, y)
        for _ in range(2):  # the step after the change, and the one after it
            step(model, x, y)
            assert stats.param_shapes == {n: p.shape for n, p in model.named_parameters()}
            reference_tools.assert_matches(stats, expected)


def test_a_parameter_replaced_while_frozen_then_unfrozen_is_followed(reference_tools):
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum") as stats:
        step(model, x, y)
        model[2].weight = nn.Parameter(torch.randn(3, 7), requires_grad=False)
        step(model, x, y)
        assert "2.weight" not in stats.param_shapes
        model[2].weight.requires_grad_(True)
        expected = reference_for(model, x, y)
        step(model, x, y)
        reference_tools.assert_matches(stats, expected)


def test_a_parametrization_registered_after_attaching_is_pulled_back(reference_tools):
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum", check_identity=False) as stats:
        run_past_the_first_checks(stats, model, x, y)
        orthogonal(model[2])
        expected = reference_for(model, x, y)
        step(model, x, y)
        assert "2.parametrizations.weight.original" in stats.param_shapes
        reference_tools.assert_matches(stats, expected)


@pytest.mark.parametrize("check_identity", [True, False])
def test_pruning_after_attaching_is_refused_naming_the_parametrization(check_identity):
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum", check_identity=check_identity) as stats:
        run_past_the_first_checks(stats, model, x, y)
        prune.l1_unstructured(model[2], "weight", amount=0.5)  # weight_orig * weight_mask
        step(model, x, y)
        with pytest.raises(NotImplementedError, match=r"(?s)'2\.weight_orig' by mul.*parametriz"):
            stats.norms_squared()


def test_lazy_parameters_are_refused_at_attach_naming_the_fix(reference_tools):
    model = nn.Sequential(nn.LazyLinear(7), nn.Tanh(), nn.Linear(7, 3))
    x, y = data()
    with pytest.raises(ValueError, match=r"(?s)\['0\.weight', '0\.bias'\].*Run one forward"):
        PerSampleStats(model, "sum")
    with torch.no_grad():
        model(x)
    expected = reference_for(model, x, y)
    with PerSampleStats(model, "sum") as stats:
        step(model, x, y)
        reference_tools.assert_matches(stats, expected)


@pytest.mark.parametrize("check_identity", [True, False])
def test_a_forward_with_every_parameter_frozen_measures_nothing(reference_tools, check_identity):
    # adversarial training: the model is frozen while the attack differentiates the input
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum", check_identity=check_identity) as stats:
        for _ in range(3):
            model.requires_grad_(False)
            attacked = x.clone().requires_grad_(True)
            (gradient,) = torch.autograd.grad(per_example_loss(model(attacked), y).sum(), attacked)
            adversarial = (x + 0.1 * gradient.sign()).detach()
            model.requires_grad_(True)
            expected = reference_for(model, adversarial, y)
            step(model, adversarial, y)
            reference_tools.assert_matches(stats, expected)


class HeadMadeInTheForward(nn.Module):
    """Creates its head inside its first forward (a lazily built layer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if not hasattr(self, "head"):
            self.head = nn.Linear(7, 3)
        return self.head(h)


@pytest.mark.parametrize("check_identity", [True, False])
def test_a_layer_made_during_the_step_is_refused_then_followed(reference_tools, check_identity):
    model = HeadMadeInTheForward()
    x, y = data()
    with PerSampleStats(model, "sum", check_identity=check_identity) as stats:
        step(model, x, y)
        made = r"(?s)\['head\.weight', 'head\.bias'\].*during this step"
        with pytest.raises(ValueError, match=made):
            stats.norms_squared()
        expected = reference_for(model, x, y)
        step(model, x, y)
        reference_tools.assert_matches(stats, expected)


def test_a_layer_replaced_between_the_backward_and_the_read_keeps_the_steps_statistics(
    reference_tools,
):
    model = mlp()
    x, y = data()
    expected = reference_for(model, x, y)
    with PerSampleStats(model, "sum") as stats:
        step(model, x, y)
        replace_head(model)  # after the step that trained the old head
        reference_tools.assert_matches(stats, expected)


def test_a_new_layer_without_a_rule_is_named_at_the_next_forward():
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum") as stats:
        step(model, x, y)
        stats.norms_squared()
        model.append(nn.PReLU())
        with pytest.raises(ValueError, match=r"'3' \(PReLU\)"):
            model(x)


def test_sketches_follow_a_replaced_head():
    model = mlp()
    x, y = data()
    with SketchedStats(model, dim=16, seed=3, loss_reduction="sum") as stats:
        run_past_the_first_checks(stats, model, x, y)
        replace_head(model)
        shapes = {n: p.shape for n, p in model.named_parameters()}
        expected = GradientSketch(shapes, 16, 3).apply_dense(reference_for(model, x, y))
        step(model, x, y)
        torch.testing.assert_close(stats.sketches(), expected)


def test_exact_sampler_follows_a_replaced_head_and_names_a_wider_model():
    model = mlp()
    xs, ys = torch.randn(18, 4), torch.randint(0, 3, (18,))
    sampler = GraBSampler(torch.utils.data.TensorDataset(xs, ys), model=model, batch_size=6)
    order = list(iter(sampler))
    batches = [order[k : k + 6] for k in (0, 6, 12)]
    mean_step(model, xs[batches[0]], ys[batches[0]])
    sampler.step()
    replace_head(model)  # the same width: the new head's gradients are balanced
    expected = reference_for(model, xs[batches[1]], ys[batches[1]])
    mean_step(model, xs[batches[1]], ys[batches[1]])
    torch.testing.assert_close(
        sampler.stats.norms_squared(), (expected * expected).sum(1), rtol=1e-9, atol=0
    )
    sampler.step()
    append_a_layer(model)
    mean_step(model, xs[batches[2]], ys[batches[2]])
    with pytest.raises(ValueError, match="trainable parameters changed"):
        sampler.step()
    sampler.close()


# -- 1b. parameters cast or moved after attaching ------------------------------------------------
class CastingHead(nn.Module):
    """A head that may run in another precision than the body (cast after attaching)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h.to(self.head.weight.dtype)).to(x.dtype)


def test_a_model_cast_after_attaching_is_followed(reference_tools):
    # PyTorch gives a parameter a new gradient accumulator when .to() / .half() / .cuda()
    # changes its dtype or device: the hooks must move to it
    torch.set_default_dtype(torch.float32)
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum") as stats:
        step(model, x, y)
        stats.norms_squared()
        model.double()
        x = x.double()
        expected = reference_for(model, x, y)
        step(model, x, y)
        assert stats.dtype == torch.float64
        reference_tools.assert_matches(stats, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sketched", [False, True])
def test_a_model_moved_to_the_gpu_after_attaching_is_followed(sketched):
    model = mlp()
    x, y = data()
    if sketched:
        stats = SketchedStats(model, dim=16, seed=3, loss_reduction="sum")
    else:
        stats = PerSampleStats(model, "sum")
    step(model, x, y)
    before = stats.sketches() if sketched else stats.norms_squared()
    model.cuda()  # PyTorch gives the moved parameters new gradient accumulators
    step(model, x.cuda(), y.cuda())
    after = stats.sketches() if sketched else stats.norms_squared()
    assert after.device.type == "cuda"
    torch.testing.assert_close(after.cpu(), before, rtol=1e-9, atol=1e-12)
    stats.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("statistics", ["exact", "sketch"])
def test_a_sampler_built_before_the_model_moves_to_the_gpu_balances_there(statistics):
    model = mlp()
    xs, ys = torch.randn(12, 4), torch.randint(0, 3, (12,))
    dataset = torch.utils.data.TensorDataset(xs, ys)
    sampler = GraBSampler(dataset, model=model, batch_size=6, statistics=statistics)
    model.cuda()  # after the sampler attached, before its first step (a framework's setup)
    order = list(iter(sampler))
    for batch in (order[:6], order[6:]):
        mean_step(model, xs[batch].cuda(), ys[batch].cuda())
        sampler.step()  # raised before: no backward reached the hooks on the old accumulators
    sampler.close()


@pytest.mark.parametrize("check_identity", [True, False])
def test_a_layer_cast_after_attaching_is_refused_once_then_followed(check_identity):
    torch.set_default_dtype(torch.float32)
    model = CastingHead()
    x, y = data()
    with PerSampleStats(model, "sum", check_identity=check_identity) as stats:
        run_past_the_first_checks(stats, model, x, y)
        model.head.bfloat16()  # a head kept in another precision than the body
        step(model, x, y)
        with pytest.raises(ValueError, match=r"(?s)'head\.bias', 'head\.weight'.*cast or moved"):
            stats.norms_squared()
        reference = copy.deepcopy(model).double()  # the bf16 head's values, in float64
        expected = reference_for(reference, x.double(), y)
        step(model, x, y)
        norms = stats.norms_squared().double()
        torch.testing.assert_close(norms, (expected * expected).sum(1), rtol=2e-2, atol=0)


def test_a_float64_head_on_a_float32_body_is_checked_in_each_parameters_precision():
    torch.set_default_dtype(torch.float32)
    model = CastingHead()
    model.head.double()
    x, y = data()
    expected = reference_for(copy.deepcopy(model).double(), x.double(), y)
    with PerSampleStats(model, "sum", check_identity="always") as stats:
        step(model, x, y)  # the body's float32 rounding is no mismatch
        norms = stats.norms_squared().double()
        torch.testing.assert_close(norms, (expected * expected).sum(1), rtol=1e-5, atol=0)
        model.zero_grad()
        penalty = 1e-3 * model.body.weight.square().sum()  # still caught, in float32
        (per_example_loss(model(x), y).sum() + penalty).backward()
        with pytest.raises(IdentityCheckError, match=r"'body\.weight'"):
            stats.norms_squared()


def test_a_read_after_a_forward_that_dropped_the_backward_says_so():
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum") as stats:
        with pytest.raises(RuntimeError, match="no statistics yet") as raised:
            stats.norms_squared()
        assert "dropped" not in str(raised.value)
        step(model, x, y)
        model(x)  # an evaluation forward with grad enabled starts the next step
        with pytest.raises(RuntimeError, match=r"dropped .* torch\.no_grad\(\)"):
            stats.norms_squared()


# -- 1c. layers called outside the model's forward ---------------------------------------------
class SequenceFirstMix(nn.Module):
    """A sequence-first copy of an activation (T == B), refused when the model is called."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = nn.Embedding(7, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def body(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.emb(idx).transpose(0, 1).contiguous())  # (T, B, D)
        return torch.tanh(h).transpose(0, 1).mean(1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(idx))


@pytest.mark.parametrize("check_identity", [True, False])
def test_layers_called_outside_the_models_forward_are_refused(check_identity):
    # the model's forward input is what every layer's batch dim is checked against: calling
    # its submodules directly skipped every check (6% error here, silently)
    model = SequenceFirstMix()
    idx, y = torch.randint(0, 7, (4, 4)), torch.randint(0, 3, (4,))
    refused = pytest.raises(ValueError, match=r"(?s)layer 'mix' .* transposed")
    with PerSampleStats(model, "sum", check_identity=check_identity), refused:
        per_example_loss(model(idx), y).sum().backward()
    outside = r"(?s)layer 'emb' was called outside the forward.*attach PerSampleStats"
    refused = pytest.raises(ValueError, match=outside)
    with PerSampleStats(model, "sum", check_identity=check_identity), refused:
        per_example_loss(model.head(model.body(idx)), y).sum().backward()


def test_statistics_attached_to_the_submodule_the_step_calls_are_exact(reference_tools):
    model = mlp()
    x, y = data()
    expected = reference_for(model, x, y)
    with PerSampleStats(model[0], "sum") as stats:  # the step calls the layers one by one
        per_example_loss(model[2](torch.tanh(model[0](x))), y).sum().backward()
        reference_tools.assert_matches(stats, expected[:, :35])


# -- 2. BatchNorm that uses batch statistics, owning no trainable parameter --------------------
def with_batch_norm(norm: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), norm, nn.Tanh(), nn.Linear(7, 3))


def frozen_affine() -> nn.Module:
    norm = nn.BatchNorm1d(7)
    norm.requires_grad_(False)
    return norm


UNTRACKED_NORMS: dict[str, Callable[[], nn.Module]] = {
    "affine=False": lambda: nn.BatchNorm1d(7, affine=False),
    "frozen affine": frozen_affine,
    "track_running_stats=False": lambda: nn.BatchNorm1d(7, affine=False, track_running_stats=False),
}


@pytest.mark.parametrize("check_identity", [True, False])
@pytest.mark.parametrize("norm", list(UNTRACKED_NORMS))
def test_batch_statistics_of_a_norm_without_trainable_parameters_are_refused(norm, check_identity):
    model = with_batch_norm(UNTRACKED_NORMS[norm]())
    x, y = data()
    refused = pytest.raises(ValueError, match=r"(?s)layer '1' \(BatchNorm1d\).*batch's mean")
    with PerSampleStats(model, "sum", check_identity=check_identity), refused:
        step(model, x, y)


def test_batch_statistics_in_eval_mode_are_refused_for_a_tracked_norm():
    model = with_batch_norm(nn.BatchNorm1d(7, track_running_stats=False)).eval()
    x, y = data()
    refused = pytest.raises(ValueError, match=r"(?s)layer '1' \(BatchNorm1d\).*batch's mean")
    with PerSampleStats(model, "sum"), refused:
        step(model, x, y)


def test_running_statistics_of_a_norm_without_trainable_parameters_are_exact(reference_tools):
    model = with_batch_norm(frozen_affine())
    x, y = data()
    model.eval()
    with PerSampleStats(model, "sum") as stats:
        expected = reference_for(model, x, y)
        step(model, x, y)
        reference_tools.assert_matches(stats, expected)


def test_batch_statistics_with_nothing_trainable_before_the_norm_are_exact(reference_tools):
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.Linear(4, 7), nn.Tanh())
    model.append(nn.Linear(7, 3))
    x, y = data()
    # example i's loss term, the batch forwarded whole (its statistics are the batch's)
    expected = per_example_rows(model, lambda i: per_example_loss(model(x), y)[i], B)
    with PerSampleStats(model, "sum") as stats:
        step(model, x, y)
        reference_tools.assert_matches(stats, expected)


def test_the_constant_statistics_definition_covers_norms_without_trainable_parameters():
    model = with_batch_norm(nn.BatchNorm1d(7, affine=False))
    x, y = data()
    warned = pytest.warns(UserWarning, match="batch mean and variance as constants")
    with warned, PerSampleStats(model, "sum", batch_norm_constant_statistics=True) as stats:
        step(model, x, y)
        total = stats.total()
        for name, p in model.named_parameters():
            torch.testing.assert_close(total[name], p.grad)


def test_a_model_compiled_after_attaching_is_measured_from_its_first_step():
    """Dynamo traces the hooks of the module it compiles: statistics attached before
    ``torch.compile`` (a sampler over the model, another consumer over the compiled one) have
    their module hooks run eagerly, so the first step is read as the later ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    sampler = GraBSampler(range(12), model=model, balance_type="pair", batch_size=4)
    compiled = torch.compile(model, backend="eager")
    norms = ExampleGradientNorms(compiled, stats=sampler.stats)
    reference = copy.deepcopy(model)  # not measured
    order = list(sampler)
    for start in range(0, 12, 4):
        idx = order[start : start + 4]
        F.cross_entropy(compiled(x[idx]), y[idx]).backward()
        sampler.step()
        xb, yb = x[idx], y[idx]
        rows = per_example_rows(
            reference, lambda i, xb=xb, yb=yb: F.cross_entropy(reference(xb[[i]]), yb[[i]]), 4
        )
        torch.testing.assert_close(norms.take(), rows.norm(dim=1))
    sampler.close()
