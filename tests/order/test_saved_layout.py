"""A hook-mode sampler state records the layout of the gradients its ordering state sums (the
trainable parameters, by canonical name and shape, in their flat order), so a state saved over
another model of the same width is refused instead of being read against the wrong parameters;
wrappers that only rename (checkpoint wrappers, DDP, ``torch.compile``) still load it."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from grabkit import GraBSampler

N, B = 16, 4


class EncoderHead(nn.Module):
    """Two Linears, registered encoder first or head first (the same computation)."""

    def __init__(self, head_first: bool = False, widths: tuple[int, int, int] = (6, 4, 3)):
        super().__init__()
        inp, hidden, out = widths
        if head_first:
            self.head = nn.Linear(hidden, out, bias=False)
            self.enc = nn.Linear(inp, hidden, bias=False)
        else:
            self.enc = nn.Linear(inp, hidden, bias=False)
            self.head = nn.Linear(hidden, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.enc(x)))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=gen), torch.randint(0, 3, (N,), generator=gen)


def sampler_over(model: nn.Module) -> GraBSampler:
    return GraBSampler(range(N), model=model, balance_type="pair", batch_size=B)


def half_epoch_state(model: nn.Module) -> dict:
    """A state saved after two steps of the first epoch, through ``torch.save``."""
    x, y = data()
    sampler = sampler_over(model)
    order = list(sampler)
    for start in (0, B):
        idx = order[start : start + B]
        model.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        sampler.step()
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    sampler.close()
    return torch.load(buffer, weights_only=True)


def finish(model: nn.Module, state: dict) -> list[list[int]]:
    """Load ``state`` into a sampler over ``model``, run the rest of its epoch and the next;
    return the orders of the next two epochs."""
    x, y = data()
    sampler = sampler_over(model)
    sampler.load_state_dict(state)
    orders = []
    for _ in range(2):
        order = list(sampler)
        for start in range(0, len(order), B):
            idx = order[start : start + B]
            model.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            sampler.step()
        orders.append(order)
    orders.append(list(sampler))
    sampler.close()
    return orders[1:]


def test_the_state_records_the_parameters_layout():
    state = half_epoch_state(EncoderHead())
    assert state["config"]["layout"] == [["enc.weight", [4, 6]], ["head.weight", [3, 4]]]


def test_a_state_of_the_same_parameters_in_another_order_is_refused():
    torch.manual_seed(0)
    state = half_epoch_state(EncoderHead())
    reordered = EncoderHead(head_first=True)  # same names and shapes, head first in the layout
    with pytest.raises(ValueError, match=r"parameter 0: saved 'enc.weight' \(4, 6\), here "
                       r"'head.weight' \(3, 4\)"):  # fmt: skip
        sampler_over(reordered).load_state_dict(state)


def test_a_state_of_another_model_of_the_same_width_is_refused():
    state = half_epoch_state(EncoderHead())  # 4 x 6 + 3 x 4 = 36 numbers per example
    other = EncoderHead(widths=(6, 3, 6))  # 3 x 6 + 6 x 3 = 36 numbers too
    with pytest.raises(ValueError, match="laid out differently"):
        sampler_over(other).load_state_dict(state)


def test_a_wrapper_that_only_renames_loads_the_state_and_continues_alike():
    torch.manual_seed(0)
    model = EncoderHead()
    state = half_epoch_state(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    plain = EncoderHead()
    plain.load_state_dict(weights)
    wrapped = EncoderHead()
    wrapped.load_state_dict(weights)
    wrapped.enc = checkpoint_wrapper(wrapped.enc)  # enc._checkpoint_wrapped_module.weight
    assert finish(wrapped, state) == finish(plain, state)


def test_a_state_saved_without_a_layout_still_loads():
    state = half_epoch_state(EncoderHead())
    older = {**state, "config": {k: v for k, v in state["config"].items() if k != "layout"}}
    sampler_over(EncoderHead()).load_state_dict(older)


def test_a_dense_state_over_a_params_dict_records_and_checks_its_layout():
    """grab-sampler's way: ``GraBSampler(dataset, dict(model.named_parameters()))``."""
    model = EncoderHead()
    sampler = GraBSampler(range(N), dict(model.named_parameters()), balance_type="pair")
    order = list(sampler)
    per_example = {n: torch.randn(B, *p.shape) for n, p in model.named_parameters()}
    for start in (0, B):
        sampler.step(per_example, indices=order[start : start + B])
    state = sampler.state_dict()
    assert state["config"]["layout"] == [["enc.weight", [4, 6]], ["head.weight", [3, 4]]]
    reordered = dict(EncoderHead(head_first=True).named_parameters())
    with pytest.raises(ValueError, match="laid out differently"):
        GraBSampler(range(N), reordered, balance_type="pair").load_state_dict(state)
    compiled_names = {f"_orig_mod.{n}": p for n, p in model.named_parameters()}
    GraBSampler(range(N), compiled_names, balance_type="pair").load_state_dict(state)
