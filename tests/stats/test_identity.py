"""The run-time identity check: sum_i g_i from the rules against the gradient autograd delivered,
per parameter and per backward; declared batch terms; the opt-out; what it cannot see."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.order import GraBSampler
from grabkit.stats import IdentityCheckError, LayerRule, PerSampleStats, register_rule
from grabkit.stats.factors import PerExampleFactor
from grabkit.stats.sketch import SketchedStats

B = 6


def mlp(width: int = 7) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))


def data(b: int = B, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, generator=gen), torch.randint(0, 3, (b,), generator=gen)


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def l2(model: nn.Module) -> torch.Tensor:
    return sum(p.square().sum() for p in model.parameters())


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, d): gradient of each example's own loss, one ``torch.autograd.grad`` each."""
    params = list(model.parameters())
    rows = []
    for i in range(len(x)):
        loss = per_example_loss(model(x[i : i + 1]), y[i : i + 1]).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def test_a_penalty_in_the_loss_is_refused_naming_parameters_causes_and_fixes():
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "mean") as stats:
        (per_example_loss(model(x), y).mean() + 1e-2 * l2(model)).backward()
        with pytest.raises(IdentityCheckError) as raised:
            stats.norms_squared()
    message = str(raised.value)
    for expected in ("'0.weight'", "'2.bias'", "batch_term", "F.linear", "check_identity=False"):
        assert expected in message
    assert isinstance(raised.value, RuntimeError)


def test_the_check_runs_in_sketch_mode():
    model = mlp()
    x, y = data()
    with SketchedStats(model, dim=16) as stats:
        (per_example_loss(model(x), y).mean() + 1e-2 * l2(model)).backward()
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            stats.sketches()


@pytest.mark.parametrize("kind", ["exact", "sketch"])
def test_a_pending_check_is_compared_before_any_value_reaches_the_host(kind):
    # gradient_batch(settle=False): the check rides on the consumer's one host transfer, and
    # a batch derived from it (normalised, cut) reads through it
    model = mlp()
    x, y = data()
    make = PerSampleStats(model, "mean") if kind == "exact" else SketchedStats(model, dim=16)
    with make as stats:
        (per_example_loss(model(x), y).mean() + 1e-2 * l2(model)).backward()
        batch = stats.gradient_batch(settle=False)
        derived = batch.normalized().split(2)[-1]
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            derived.to_host(derived.norms_squared())
        with pytest.raises(IdentityCheckError):  # again at every read of the step
            batch.settle()


@pytest.mark.parametrize("multiplier", [1.0, 8.0])
def test_a_declared_batch_term_is_left_out_of_every_example(float64, reference_tools, multiplier):
    model = mlp()
    x, y = data()
    expected = reference(model, x, y) * multiplier
    with PerSampleStats(model, "sum") as stats:
        loss = per_example_loss(model(x), y).sum() + stats.batch_term(1e-2 * l2(model))
        (multiplier * loss).backward()  # a GradScaler-style scale reaches the term too
        reference_tools.assert_matches(stats, expected)


def test_a_batch_term_through_activations_is_left_out(float64, reference_tools):
    """An auxiliary loss on hidden activations that couples the batch (a load-balancing term)."""

    class WithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 5), nn.Linear(5, 3)
            self.hidden: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.hidden = torch.tanh(self.body(x))
            return self.head(self.hidden)

    torch.manual_seed(0)
    model = WithAux()
    x, y = data()
    expected = reference(model, x, y)
    with PerSampleStats(model, "sum") as stats:
        out = model(x)
        aux = model.hidden.mean(dim=0).square().sum()  # not a sum over examples
        (per_example_loss(out, y).sum() + stats.batch_term(aux)).backward()
        reference_tools.assert_matches(stats, expected)


@pytest.mark.parametrize("through_activations", [False, True])
def test_sketches_leave_a_declared_batch_term_out(float64, through_activations):
    """``SketchedStats.batch_term``: each example's sketch is that of its own loss's gradient,
    an L2 penalty or a term on a batch statistic of the hidden activations left out."""
    model = mlp()
    x, y = data()
    expected = reference(model, x, y)
    with SketchedStats(model, dim=16, seed=1, loss_reduction="sum") as stats:
        out = model(x)
        hidden = model[1](model[0](x)) if through_activations else None
        term = hidden.mean(dim=0).square().sum() if through_activations else 1e-2 * l2(model)
        (per_example_loss(out, y).sum() + stats.batch_term(term)).backward()
        torch.testing.assert_close(stats.sketches(), stats.sketch.apply_dense(expected))


def test_batch_term_needs_a_scalar_with_a_graph():
    model = mlp()
    with PerSampleStats(model) as stats, pytest.raises(ValueError, match="scalar"):
        stats.batch_term(torch.ones(3, requires_grad=True))


def test_the_opt_out_returns_statistics_and_the_sampler_passes_it_on():
    model = mlp()
    x, y = data()
    with PerSampleStats(model, check_identity=False) as stats:
        (per_example_loss(model(x), y).mean() + 1e-2 * l2(model)).backward()
        assert stats.norms_squared().shape == (B,)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = GraBSampler(dataset, model=model, stats_options={"check_identity": False})
    assert sampler.stats.check_identity is False
    sampler.close()


def test_each_backward_of_an_accumulated_step_is_checked_on_its_own():
    model = mlp()
    x, y = data(12)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = GraBSampler(dataset, model=model, batch_size=6)
    order = list(iter(sampler))
    for part, penalty in ((order[:3], 0.0), (order[3:6], 0.0)):
        (per_example_loss(model(x[part]), y[part]).mean() + penalty).backward()
    sampler.step()  # two clean micro-batches
    first, second = order[6:9], order[9:]
    per_example_loss(model(x[first]), y[first]).mean().backward()
    (per_example_loss(model(x[second]), y[second]).mean() + 1e-2 * l2(model)).backward()
    with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
        sampler.step()
    sampler.close()


def test_grad_scaler_and_checkpointing_pass(reference_tools):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.inner, self.last = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda z: torch.tanh(self.inner(z)), self.first(x), use_reentrant=True)
            return self.last(h)

    torch.manual_seed(0)
    model = Checkpointed()
    x, y = data()
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    with PerSampleStats(model, "sum") as stats:
        scaler.scale(per_example_loss(model(x), y).sum()).backward()
        stats.norms_squared()  # checked: the scale reaches both sides alike


def test_reading_statistics_leaves_training_bitwise_unchanged():
    def train(read: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        stats = PerSampleStats(model) if read else None
        for seed in range(4):
            x, y = data(seed=seed)
            opt.zero_grad()
            per_example_loss(model(x), y).mean().backward()
            if stats is not None:
                stats.norms_squared()
                stats.gram()
            opt.step()
        if stats is not None:
            stats.close()
        return [p.detach().clone() for p in model.parameters()] + [torch.rand(3)]

    for plain, measured in zip(train(False), train(True), strict=True):
        assert torch.equal(plain, measured)


def test_float64_sees_mismatches_float32_cannot(float64):
    """The tolerance follows the unit roundoff: in float64 a penalty far below float32's
    resolution is still a mismatch."""
    model = mlp()
    x, y = data()
    with PerSampleStats(model, "sum") as stats:
        (per_example_loss(model(x), y).sum() + 1e-9 * l2(model)).backward()
        with pytest.raises(IdentityCheckError):
            stats.norms_squared()


def test_large_weights_are_probed_on_a_moving_block_and_still_checked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Tanh(), nn.Linear(200, 3))  # 60,000 entries
    x, y = torch.randn(4, 300), torch.randint(0, 3, (4,))
    with PerSampleStats(model) as stats:
        for _ in range(3):
            model.zero_grad()
            per_example_loss(model(x), y).mean().backward()
            stats.norms_squared()
        model.zero_grad()
        (per_example_loss(model(x), y).mean() + 1e-2 * l2(model)).backward()
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            stats.norms_squared()


def test_the_check_cannot_see_which_row_is_which_example():
    """Its documented limit: a sum over examples is blind to a misattribution of rows."""

    class Gain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    class RolledRule(LayerRule):  # credits example i's gradient to example i + 1
        def factors(self, module, layer_input, output_grad, wanted):
            rows = (layer_input * output_grad).roll(1, dims=0)
            return {"gain": PerExampleFactor(rows, module.gain.shape)}

    register_rule(Gain, RolledRule())
    model = Gain()
    x = torch.randn(4, 3)
    with PerSampleStats(model, "sum") as stats:
        model(x).square().sum().backward()
        stats.norms_squared()  # passes: the sum is right, the attribution is not


def test_a_delivered_gradient_that_overflowed_passes_through_not_as_a_mismatch():
    """fp16 autocast under a loss scale: the weight gradient's GEMM overflows (a GradScaler
    overflow step, which the scaler skips) while each example's factors stay finite. The check
    cannot compare against inf; the statistics pass through (NaN / Inf rows, if any, are the
    consumers' to reject) instead of an IdentityCheckError blaming the model."""
    model = nn.Linear(4, 2)
    with PerSampleStats(model, loss_reduction="sum") as stats:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.ones(64, 4))
        (out.float().sum() * 2000).backward()
        assert not torch.isfinite(model.weight.grad).any()
        assert torch.isfinite(stats.norms_squared()).all()


# -- the schedule: every step while something is new, then within the time budget --------------
def train_steps(stats: PerSampleStats, model: nn.Module, steps: int, penalty: float = 0.0) -> None:
    """``steps`` backwards of the MLP, reading norms after each (a penalty in the loss if given)."""
    for step in range(steps):
        x, y = data(seed=step)
        loss = per_example_loss(model(x), y).mean()
        (loss + penalty * l2(model) if penalty else loss).backward()
        stats.norms_squared()


def test_the_first_steps_are_all_checked_then_the_budget_decides(monkeypatch):
    from grabkit.stats import identity

    monkeypatch.setattr(identity, "BUDGET", 0.0)  # after the warm-up: no step checked
    model = mlp()
    with PerSampleStats(model) as stats:
        train_steps(stats, model, identity.WARMUP_STEPS + 5)
        check = stats._identity
        assert check.checked_steps == identity.WARMUP_STEPS
        train_steps(stats, model, 3, penalty=1e-2)  # unseen: the budget allowed no check

    monkeypatch.setattr(identity, "BUDGET", 1e9)  # the budget allows every step
    model = mlp()
    with PerSampleStats(model) as stats:
        train_steps(stats, model, identity.WARMUP_STEPS + 5)
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            train_steps(stats, model, 1, penalty=1e-2)


def test_always_checks_every_step(monkeypatch):
    from grabkit.stats import identity

    monkeypatch.setattr(identity, "BUDGET", 0.0)
    model = mlp()
    with PerSampleStats(model, check_identity="always") as stats:
        train_steps(stats, model, identity.WARMUP_STEPS + 5)
        assert stats._identity.checked_steps == identity.WARMUP_STEPS + 5
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            train_steps(stats, model, 1, penalty=1e-2)


class FirstLayerTwice(nn.Sequential):
    """The MLP, whose forward calls its first layer a second time when ``twice`` is set."""

    def __init__(self) -> None:
        super().__init__(*mlp())
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self[0](x))
        if self.twice:
            h = h + torch.tanh(self[0](x))
        return self[2](h)


def test_a_change_of_the_steps_structure_is_checked_at_once(monkeypatch):
    """A step that calls its layers differently, declares a batch term or changes the
    trainable set starts a new run of checked steps, whatever the budget."""
    from grabkit.stats import identity

    monkeypatch.setattr(identity, "BUDGET", 0.0)
    model = FirstLayerTwice()
    with PerSampleStats(model) as stats:
        train_steps(stats, model, identity.WARMUP_STEPS + 2)
        x, y = data()
        model.twice = True  # the first layer called twice, and a penalty: checked at once
        (per_example_loss(model(x), y).mean() + 1e-2 * l2(model)).backward()
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            stats.norms_squared()

    model = mlp()
    with PerSampleStats(model) as stats:
        train_steps(stats, model, identity.WARMUP_STEPS + 2)
        model[0].bias.requires_grad_(False)  # the trainable set changes: checked again
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            train_steps(stats, model, 1, penalty=1e-2)


def test_the_scheduled_rate_keeps_the_checks_time_within_the_budget():
    """After the warm-up, a step is checked with probability BUDGET * step time / check time
    (both running means, measured as it runs)."""
    from grabkit.stats.identity import BUDGET, WARMUP_STEPS, IdentityCheck

    check = IdentityCheck({"w": torch.Size([3, 4])}, every_step=False)
    decisions = []
    for _ in range(WARMUP_STEPS + 4000):
        check.begin_step()
        check._timed_from = None  # not this loop's times: a check costing 10% of a step
        check._step_time.value, check._check_time.value = 1.0, 0.1
        decisions.append(check.active)
    assert all(decisions[:WARMUP_STEPS])
    share = sum(decisions[WARMUP_STEPS:]) / 4000
    assert check.rate() == pytest.approx(BUDGET / 0.1)
    assert abs(share - check.rate()) < 0.03  # binomial spread: sd 0.006


def test_a_persistent_mismatch_is_caught_by_the_scheduled_check():
    """Measured times, the default budget: a penalty that stays in the loss is caught within
    a bounded number of steps (each step checked with probability rate() > 0)."""
    model = mlp()
    with PerSampleStats(model) as stats:
        train_steps(stats, model, 10)
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            train_steps(stats, model, 5000, penalty=1e-2)
        assert stats._identity.rate() > 0


def test_check_identity_takes_true_false_or_always():
    with pytest.raises(ValueError, match="'always'"):
        PerSampleStats(mlp(), check_identity="sometimes")


# -- low precision ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_under_bf16_autocast_a_penalty_as_large_as_the_gradient_is_caught():
    """bf16 rounds each operand and the delivered gradient once (at most u_low of each entry, a
    bound with no random tail): once that rounding was counted with the tail of accumulated
    float32 errors too, and a penalty whose gradient was as large as the data's passed."""
    model = mlp()
    x, y = data(b=32)
    with PerSampleStats(model, check_identity="always") as stats:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        (per_example_loss(out.float(), y).mean() + 0.1 * l2(model)).backward()  # |penalty| ~ |G|
        with pytest.raises(IdentityCheckError, match=r"'0\.weight'"):
            stats.norms_squared()


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_parameters_are_no_false_alarm(autocast):
    """A model in bf16 (as loaded with torch_dtype=torch.bfloat16): autograd delivers its
    gradients rounded to bf16, which the tolerance once took for float32's and raised."""
    model = mlp(width=64).to(torch.bfloat16)
    with PerSampleStats(model, check_identity="always") as stats:
        for step in range(4):
            model.zero_grad()
            x, y = data(b=32, seed=step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x.to(torch.bfloat16))
            per_example_loss(out.float(), y).mean().backward()
            assert torch.isfinite(stats.norms_squared()).all()


def _fp16_bert_step(stats, model, loss_scale: float, penalty: float) -> None:
    """One backward of a tiny float16 BERT's classification loss (times ``loss_scale``, as a
    GradScaler scales it), plus ``penalty`` x |query weight|^2 (not a sum over examples)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, model.config.vocab_size, (8, model.config.max_position_embeddings), generator=gen
    )
    labels = torch.randint(0, model.config.num_labels, (8,), generator=gen)
    model.zero_grad()
    loss = F.cross_entropy(model(input_ids=ids).logits.float(), labels)
    weight = model.bert.encoder.layer[0].attention.self.query.weight
    (loss_scale * (loss + penalty * weight.float().square().sum())).backward()
    stats.norms_squared()


def test_float16_gradients_that_underflow_are_no_false_alarm():
    """Without a loss scale a float16 BERT's attention gradients underflow (entries near 1e-8,
    below float16's smallest normal): rounded by a fixed amount, not in proportion, which the
    tolerance once left out and raised on its query and key weights."""
    pytest.importorskip("transformers")
    from tests.integrations.tiny import tiny_bert

    torch.manual_seed(0)
    model = tiny_bert().half()
    with PerSampleStats(model, check_identity="always") as stats:
        for _ in range(2):
            _fp16_bert_step(stats, model, loss_scale=1.0, penalty=0.0)


def test_float16_with_a_loss_scale_still_catches_a_penalty():
    """Scaled as a GradScaler scales it, nothing underflows, and an undeclared penalty raises."""
    pytest.importorskip("transformers")
    from tests.integrations.tiny import tiny_bert

    torch.manual_seed(0)
    model = tiny_bert().half()
    with PerSampleStats(model, check_identity="always") as stats:
        _fp16_bert_step(stats, model, loss_scale=2.0**12, penalty=0.0)
        with pytest.raises(IdentityCheckError, match=r"query\.weight"):
            _fp16_bert_step(stats, model, loss_scale=2.0**12, penalty=1e-3)
