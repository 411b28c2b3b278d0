"""GraBSampler as ordering x gradient source x transforms: the parts equal the keyword form, and
each part refuses what it would silently ignore."""

from __future__ import annotations

import pickle
from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit import GraBSampler, PerSampleStats
from grabkit.order import (
    BALANCE_TYPES,
    DenseGradients,
    ExactHooks,
    MeanBalance,
    Normalize,
    PairBalance,
    Project,
    RecursiveBalance,
    SketchHooks,
)
from grabkit.order.balance import SignRule


def _X(n: int = 12, d: int = 5) -> torch.Tensor:
    return torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def _run(sampler: GraBSampler, X: torch.Tensor, epochs: int = 3, batch: int = 5) -> list:
    orders = []
    for _ in range(epochs):
        order = list(sampler)
        for start in range(0, len(order), batch):
            sampler.step(X[order[start : start + batch]])
        orders.append(order)
    return [*orders, list(sampler)]


@pytest.mark.parametrize(
    ("keywords", "parts"),
    [
        ({}, lambda n: (MeanBalance(n), DenseGradients(), ())),
        (
            {"balance_type": "pair", "seed": 3, "prob_balance": True},
            lambda n: (PairBalance(n, seed=3, rule=SignRule(True)), None, ()),
        ),
        (
            {"balance_type": "recursive", "depth": 2, "normalize": True},
            lambda n: (RecursiveBalance(n, depth=2), None, (Normalize(),)),
        ),
        (
            {"balance_type": "mean", "projection": "gaussian", "projection_dim": 3},
            lambda n: (MeanBalance(n), None, (Project("gaussian", 3),)),
        ),
    ],
)
def test_the_parts_give_the_keyword_form_s_orders_and_configuration(keywords, parts):
    X = _X()
    ordering, source, transforms = parts(len(X))
    by_keywords = GraBSampler(range(len(X)), **keywords)
    by_parts = GraBSampler(range(len(X)), ordering, source, transforms=transforms)
    assert _run(by_parts, X) == _run(by_keywords, X)
    assert by_parts.state_dict()["config"] == by_keywords.state_dict()["config"]


def test_an_option_of_another_ordering_is_refused():
    # before: depth= was silently ignored by "mean", as if it meant something
    with pytest.raises(TypeError, match=r"balance_type=\"mean\".*\['depth'\].*recursive"):
        GraBSampler(range(6), balance_type="mean", depth=3)
    with pytest.raises(TypeError, match="ema_decay"):
        GraBSampler(range(6), balance_type="pair", ema_decay=0.5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        GraBSampler(range(6), balance_type="mean", not_an_option=1)
    with pytest.raises(TypeError, match="depth"):
        MeanBalance(6, depth=3)  # the ordering itself takes only its own options


def test_projection_settings_without_a_projection_are_refused():
    for name, value in (("projection_dim", 4), ("pi_eps", 0.3)):
        with pytest.raises(ValueError, match=f"`{name}` sets the random projection"):
            GraBSampler(range(6), **{name: value})


def test_a_part_and_the_keywords_for_it_together_are_refused():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"source= together with \['model'\]"):
        GraBSampler(range(6), source=DenseGradients(), model=model)
    with pytest.raises(ValueError, match=r"transforms= together with \['normalize'\]"):
        GraBSampler(range(6), transforms=[Normalize()], normalize=True)
    with pytest.raises(TypeError, match="GradientSource"):
        GraBSampler(range(6), MeanBalance(6), "hooks")
    with pytest.raises(TypeError, match="Transform instances"):
        GraBSampler(range(6), MeanBalance(6), transforms=["normalize"])


def test_keywords_next_to_statistics_of_another_definition_are_refused():
    """stats= brings statistics defined by their owner: a model with other parameters (a copy
    of the same width) or a loss reduction other than theirs would be silently ignored, and
    stats_options are the options of statistics the sampler builds."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with PerSampleStats(model, loss_reduction="sum") as stats:
        with pytest.raises(ValueError, match=r"not measured.*stats\.model"):
            GraBSampler(range(6), stats=stats, model=deepcopy(model))
        with pytest.raises(ValueError, match=r"loss_reduction='mean'.*'sum'"):
            GraBSampler(range(6), stats=stats, loss_reduction="mean")
        with pytest.raises(ValueError, match=r"stats_options.*stats="):
            GraBSampler(range(6), stats=stats, stats_options={"check_identity": False})
        GraBSampler(range(6), stats=stats, model=model, loss_reduction="sum").close()


def test_exact_hooks_check_their_combination_before_attaching():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match="needs dense per-example gradients"):
        GraBSampler(range(8), PairBalance(8), ExactHooks(model), transforms=[Project("sparse", 2)])
    with pytest.raises(ValueError, match='statistics="sketch"'):
        GraBSampler(range(8), PairBalance(8), ExactHooks(model), num_replicas=2, rank=0)
    # nothing was left attached by the refused samplers
    with GraBSampler(range(8), PairBalance(8), ExactHooks(model), batch_size=4) as sampler:
        keyword = GraBSampler(range(8), balance_type="pair", batch_size=4)
        x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        y = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(2))
        for _ in range(2):
            order = list(sampler)
            assert list(keyword) == order
            for start in (0, 4):
                idx = order[start : start + 4]
                model.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                sampler.step()
                keyword.step(sampler.stats.gradient_batch())
        assert list(sampler) == list(keyword)
        with pytest.raises(TypeError, match="setup"):
            pickle.dumps(sampler)


def test_a_sketch_source_validates_its_width_and_refuses_a_projection():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="sketch_dim"):
        SketchHooks(model, dim=1021)
    with pytest.raises(ValueError, match="already a random projection"):
        source = SketchHooks(model, 16)
        GraBSampler(range(4), PairBalance(4), source, transforms=[Project("sparse")])


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"batch_size": "4"}, TypeError, "batch_size"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"num_replicas": 2, "rank": "0"}, TypeError, "rank"),
        ({"num_replicas": 2, "rank": 2}, ValueError, "rank"),
        ({"balance_type": "recursive", "depth": 1.5}, TypeError, "depth"),
        ({"balance_type": "recursive", "depth": 17}, ValueError, "depth"),
        ({"balance_type": "ema", "ema_decay": "0.1"}, TypeError, "ema_decay"),
        ({"balance_type": "ema", "ema_decay": 1.5}, ValueError, "ema_decay"),
        ({"prob_balance": True, "prob_balance_c": "big"}, TypeError, "prob_balance_c"),
        ({"prob_balance": True, "prob_balance_c": 0}, ValueError, "prob_balance_c"),
        ({"seed": "0"}, TypeError, "seed"),
    ],
)
def test_a_wrong_type_is_a_type_error_and_a_wrong_value_a_value_error(kwargs, error, name):
    # before: a wrong type raised ValueError in most of these places
    with pytest.raises(error, match=f"`{name}` should be"):
        GraBSampler(range(6), **kwargs)


def test_wrong_types_in_calls_are_type_errors():
    sampler = GraBSampler(range(6), batch_size=2)
    list(sampler)
    with pytest.raises(TypeError, match="`epoch` should be"):
        sampler.set_epoch(1.0)
    with pytest.raises(TypeError, match="`count` should be"):
        sampler.skip("2")


@pytest.mark.parametrize("kind", BALANCE_TYPES)
def test_a_sampler_without_hooks_pickles_and_copies_with_its_state(kind):
    X = _X()
    options = {"ntk_features": X} if kind.startswith("ntk") else {}
    sampler = GraBSampler(range(len(X)), balance_type=kind, prob_balance=True, **options)
    order = list(sampler)
    sampler.step(X[order[:5]])
    copies = [pickle.loads(pickle.dumps(sampler)), deepcopy(sampler)]
    for s in (*copies, sampler):
        s.step(X[order[5:9]])
    assert list(copies[0]) == list(copies[1]) == list(sampler)
