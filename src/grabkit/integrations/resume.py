"""Sampler states for frameworks that prefetch batches ahead of training.

Trainers and loaders fetch batches before they train on them (accelerate's ``DataLoaderShard``
looks one batch ahead, ``DataLoader`` workers prefetch several). A ``GraBSampler`` snapshot taken
at a checkpoint therefore counts examples as *yielded* that were never trained; a resume that
continues from the yielded position loses them (the symptom: fewer examples trained than the
epoch has). The states below are taken at an optimizer-step boundary, where everything stepped
was trained and nothing in flight was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["replay_state", "rewound_state"]


def _check(state: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(state, Mapping) or not {"yielded", "stepped", "started"} <= set(state):
        keys = sorted(state) if isinstance(state, Mapping) else "-"
        raise ValueError(
            "expected a GraBSampler.state_dict() (keys 'yielded', 'stepped', 'started'), but got "
            f"{type(state).__name__} with keys {keys}"
        )
    return dict(state)


def rewound_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state with the in-flight examples handed back: the next ``iter()`` yields them again.

    Use when the resumed loader starts at the first example not yet trained (Lightning's and
    accelerate's own loaders after ``load_state``): yielded := stepped.
    """
    state = _check(state)
    state["yielded"] = min(int(state["yielded"]), int(state["stepped"]))
    return state


def replay_state(state: Mapping[str, Any], num_samples: int) -> dict[str, Any]:
    """The state for a framework that re-reads the interrupted epoch and skips what it trained.

    Hugging Face ``Trainer`` (and ``accelerate.skip_first_batches``) resume an epoch by iterating
    the loader from its start and dropping the batches already trained; the sampler must then
    yield the whole epoch again in the same order while its decisions keep counting from the
    stepped position. A state whose epoch was fully stepped is returned unchanged (the next
    ``iter()`` starts the next epoch).

    Args:
        state: ``GraBSampler.state_dict()`` taken right after an optimizer step.
        num_samples: ``len(sampler)``, the examples of one epoch on this rank.
    """
    state = _check(state)
    if int(state["stepped"]) < num_samples and bool(state["started"]):
        state["yielded"] = 0
    return state
