"""The sampler's saved configuration, and the checks a loaded state must pass.

A state records every option that changes the orders (``plain_config``); loading it into a
sampler built differently raises, naming the options that differ, instead of resuming a
different run. Orders and counts are checked too, so a corrupted state fails at load, not as a
stream of repeated indices later.

How a ``GraBSampler`` resumes. ``state_dict()`` records the position (epoch, yielded count) as a
snapshot and shares the ordering state (running sums, placements, stepped count) live, as
``model.state_dict()`` shares parameters: ``torchdata``'s ``StatefulDataLoader`` takes one per
dispatched batch, ahead of training, at no cost in the gradient length, and a checkpoint saved after
a ``step()`` carries the decisions of every stepped example, in flight at the snapshot or not. After
``load_state_dict`` the next ``iter()`` yields the rest of the interrupted epoch (from the yielded
count; an empty pass when all of it had been yielded, as ``RandomSampler`` does). Examples handed
out before the snapshot and not stepped by the checkpoint get no decision in that epoch (they keep
their place between the front and back parts); later gradients are never attributed to them. The
state records the configuration, and loading it into a sampler built otherwise raises.

The epoch's end. A snapshot is a position inside its epoch, as a ``StatefulDataLoader`` snapshot
is: one taken at the epoch's last batch resumes with an empty pass and then the next epoch, as
torchdata's samplers do. A checkpoint taken by a training framework at an optimizer step is a
position between steps: when every example of the epoch was stepped, the epoch is over and the
framework's next ``iter()`` starts the next one (Hugging Face ``Trainer``, accelerate's epoch loop
from the saved epoch + 1, Lightning). Such a state carries ``"ended": True``
(``grabkit.integrations.resume`` writes it; the sampler's own ``state_dict()`` never does), and
after ``load_state_dict`` the next ``iter()`` starts the next epoch (numbered by ``set_epoch``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "BATCHING_KEYS",
    "adopt_rank",
    "check_config",
    "check_positions",
    "detached_copy",
    "plain_config",
    "read_state",
]

#: what ``GraBBatchSampler`` adds to the configuration it saves (its batch_size, drop_last);
#: ``GraBSampler`` loads such a state without them
BATCHING_KEYS = ("batch_sampler_batch_size", "batch_sampler_drop_last")
#: configuration keys that states saved before they were recorded lack: such a state is checked
#: without them (``layout``: the parameters a hook-mode ordering state sums)
LATER_KEYS = frozenset({"layout"})


def _plain(value: Any) -> Any:
    """Options as plain, comparable data (tuples -> lists; tensors and callables -> a tag)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    if callable(value):
        return "callable"
    return value


def plain_config(**options: Any) -> dict[str, Any]:
    """The configuration as a flat dict of numbers, strings, None and lists."""
    nested = options.pop("options", {}) or {}
    config = {k: _plain(v) for k, v in options.items()}
    config.update({k: _plain(v) for k, v in nested.items()})
    return config


def check_config(
    where: str, state: Mapping[str, Any], config: Mapping[str, Any], version: int
) -> None:
    """Raise unless ``state`` has the expected keys, version and the same configuration."""
    expected = {"version", "config", "epoch", "yielded", "started", "live"}
    unknown, missing = set(state) - expected - {"ended"}, expected - set(state)
    if unknown or missing:
        raise ValueError(
            f"{where}.load_state_dict: unexpected keys {sorted(unknown)}, missing keys "
            f"{sorted(missing)}; the state was not saved by this version of {where}."
        )
    if state["version"] != version:
        raise ValueError(
            f"{where}.load_state_dict: the state has version={state['version']!r} but this "
            f"sampler writes version={version}; it was saved by another grabkit version."
        )
    theirs = dict(state["config"])
    keys = (set(theirs) | set(config)) - (LATER_KEYS - set(theirs))
    differ = sorted(k for k in keys if theirs.get(k) != config.get(k))
    if differ:
        pairs = ", ".join(f"{k}={_short(theirs.get(k))} vs {_short(config.get(k))}" for k in differ)
        raise ValueError(
            f"{where}.load_state_dict: the state was saved by a sampler with another "
            f"configuration ({pairs}, saved vs this sampler); build the sampler with the same "
            "dataset, topology and options as the one that was saved."
        )


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters (a layout lists every parameter)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def check_positions(
    order: Any, n: int, *, permutation: bool, counts: tuple[int, ...], limit: int
) -> None:
    """Raise unless ``order`` is an (n,) index tensor (a permutation when asked) and every
    count lies in [0, limit]."""
    if not isinstance(order, torch.Tensor) or order.shape != (n,) or order.is_floating_point():
        shape = tuple(order.shape) if isinstance(order, torch.Tensor) else type(order).__name__
        raise ValueError(
            f"load_state_dict: the saved order should be an integer tensor of shape ({n},), "
            f"but got {shape}; the state is corrupted or from another dataset."
        )
    if permutation and not torch.equal(torch.sort(order).values.cpu(), torch.arange(n)):
        raise ValueError(
            "load_state_dict: the saved order is not a permutation of the dataset's indices; "
            "the state is corrupted."
        )
    if not permutation and bool(((order < 0) | (order >= n)).any()):
        raise ValueError(f"load_state_dict: the saved order has indices outside [0, {n}).")
    for count in counts:
        if not 0 <= count <= limit:
            raise ValueError(
                f"load_state_dict: the saved position {count} lies outside [0, {limit}]; the "
                "state is corrupted."
            )


def adopt_rank(state: Mapping[str, Any], num_replicas: int, rank: int) -> dict[str, Any]:
    """Another rank's state made this rank's: frameworks save one copy (rank 0's, a Lightning
    checkpoint's ``StatefulDataLoader`` snapshot included) and every rank loads it.

    Under several processes each ``step()`` is a collective (the ranks gather their sketches and
    check that they stepped alike), so the position, order and ordering state of every rank are
    the same; only the ``rank`` in the recorded configuration differs. A state of another
    ``num_replicas`` is returned unchanged (``load_state_dict`` refuses it, naming both).
    """
    state = dict(state)
    config = state.get("config")
    if isinstance(config, Mapping) and config.get("num_replicas") == num_replicas:
        state["config"] = {**config, "rank": rank}
    return state


def detached_copy(tree: Any) -> Any:
    """A copy of a nest of dicts and lists whose tensors share no memory with the original."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, Mapping):
        return {k: detached_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [detached_copy(v) for v in tree]
    return tree


def read_state(
    where: str,
    state: Mapping[str, Any],
    config: Mapping[str, Any],
    version: int,
    num_samples: int,
    *,
    permutation: bool,
) -> dict[str, Any]:
    """A private copy of a sampler state, checked: keys, version, configuration, the live part
    from the same epoch as the position, the order, and the counts."""
    state = detached_copy(state)
    check_config(where, state, config, version)
    live = state["live"]
    if int(live["epoch"]) != int(state["epoch"]):
        raise ValueError(
            f"{where}.load_state_dict: the state's position is in epoch {state['epoch']} but its "
            f"ordering state moved on to epoch {live['epoch']}: state_dict() shares the live "
            "ordering state, so save (torch.save) or copy.deepcopy it when you take it."
        )
    check_positions(
        live["order"], int(config["n"]), permutation=permutation,
        counts=(int(state["yielded"]), int(live["stepped"])), limit=num_samples,
    )  # fmt: skip
    return state
