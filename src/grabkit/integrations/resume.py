"""Sampler states for frameworks that checkpoint at optimizer steps and prefetch batches.

Trainers and loaders fetch batches before they train on them (accelerate's ``DataLoaderShard``
looks one batch ahead, ``DataLoader`` workers prefetch several). A ``GraBSampler`` snapshot taken
at a checkpoint therefore counts examples as *yielded* that were never trained; a resume that
continues from the yielded position loses them (the symptom: fewer examples trained than the
epoch has). The states below are taken at an optimizer-step boundary, where everything stepped
was trained and nothing in flight was.

The epoch-end rule, one for every integration. A framework checkpoint is a position between
optimizer steps: when every example of its epoch was stepped, that epoch is over, and the
framework resumes with the next one (Hugging Face ``Trainer`` counts epochs from the global step,
accelerate's recipe loops from the saved epoch + 1, Lightning starts the next epoch). The states
below then carry ``"ended": True``, and after ``load_state_dict`` the sampler's next ``iter()``
starts the next epoch instead of yielding the epoch's empty rest (which is what a bare
``GraBSampler.state_dict()`` snapshot does, as a position inside the epoch, the way
``StatefulDataLoader`` restores it).

A framework may also end an epoch before its last example is stepped: Lightning's
``limit_train_batches``, a loader with ``drop_last=True`` whose last batch is partial. It then
resumes with the next epoch too, and the rest of the interrupted epoch is never trained (as in
the uninterrupted run, where the next ``iter()`` starts the next epoch): the integration passes
``ended=True``, read from the framework's own epoch counter, and the state is marked ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grabkit.order.state import adopt_rank

__all__ = ["adopt_rank", "replay_state", "rewound_state"]


def _check(state: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of a ``GraBSampler.state_dict()`` (its position may then be changed)."""
    live = state.get("live") if isinstance(state, Mapping) else None
    if (
        not {"yielded", "started"} <= set(state or {})
        or not isinstance(live, Mapping)
        or ("stepped" not in live)
    ):
        keys = sorted(state) if isinstance(state, Mapping) else "-"
        raise ValueError(
            "expected a GraBSampler.state_dict() (keys 'yielded', 'started' and 'live' with "
            f"'stepped'), but got {type(state).__name__} with keys {keys}"
        )
    return dict(state)


def _stepped(state: Mapping[str, Any]) -> int:
    return int(state["live"]["stepped"])


def _ended(state: Mapping[str, Any], num_samples: int, ended: bool) -> bool:
    """Every example of the epoch stepped, the framework's epoch over, or marked so already."""
    return ended or bool(state.get("ended", False)) or _stepped(state) >= num_samples


def rewound_state(
    state: Mapping[str, Any], num_samples: int, *, ended: bool = False
) -> dict[str, Any]:
    """The state with the in-flight examples handed back: the next ``iter()`` yields them again.

    Use when the resumed loader starts at the first example not yet trained (Lightning's and
    accelerate's own loaders after ``load_state``): yielded := stepped. A state whose epoch was
    fully stepped, or that the framework says is over, is marked ``"ended"``: the next
    ``iter()`` starts the next epoch.

    Args:
        state: ``GraBSampler.state_dict()`` taken right after an optimizer step (or a state this
            function returned: its mark is kept).
        num_samples: ``len(sampler)``, the examples of one epoch on this rank.
        ended: the framework counts the epoch as over (its last batch trained) although some
            of its examples were not stepped (``limit_train_batches``, a dropped last batch).
    """
    state = _check(state)
    state["yielded"] = min(int(state["yielded"]), _stepped(state))
    state["ended"] = _ended(state, num_samples, ended)
    return state


def replay_state(
    state: Mapping[str, Any], num_samples: int, *, ended: bool = False
) -> dict[str, Any]:
    """The state for a framework that re-reads the interrupted epoch and skips what it trained.

    Hugging Face ``Trainer`` (and ``accelerate.skip_first_batches``) resume an epoch by iterating
    the loader from its start and dropping the batches already trained; the sampler must then
    yield the whole epoch again in the same order while its decisions keep counting from the
    stepped position. A state whose epoch was fully stepped, or that the framework says is over,
    is marked ``"ended"``: the framework resumes with the next epoch, and so does the sampler's
    next ``iter()``.

    Args:
        state: ``GraBSampler.state_dict()`` taken right after an optimizer step (or one with
            ``"ended"`` set: its mark is kept).
        num_samples: ``len(sampler)``, the examples of one epoch on this rank.
        ended: the framework counts the epoch as over although some of its examples were not
            stepped (a dropped last batch).
    """
    state = _check(state)
    ended = _ended(state, num_samples, ended)
    if not ended and bool(state["started"]):
        state["yielded"] = 0
    state["ended"] = ended
    return state
