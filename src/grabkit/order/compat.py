"""grab-sampler's spellings, in one place: its ``BalanceType`` enum and its keyword names.

``GraBSampler`` accepts grab-sampler's keywords next to grabkit's own; ``GRAB_SAMPLER_KEYWORDS``
maps each of them to the grabkit keyword it means, and ``GRAB_SAMPLER_PROJECTIONS`` maps its
``random_projection`` values to grabkit's ``projection`` names.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["GRAB_SAMPLER_KEYWORDS", "GRAB_SAMPLER_PROJECTIONS", "BalanceType"]


class BalanceType(Enum):
    """grab-sampler's names for the orderings (its experiment scripts pass these members)."""

    RANDOM_RESHUFFLING = "rr"
    MEAN_BALANCE = "mean"
    PAIR_BALANCE = "pair"
    BATCH_BALANCE = "batch"
    RECURSIVE_BALANCE = "recursive"
    RECURSIVE_PAIR_BALANCE = "recursive-pair"
    EMA_BALANCE = "ema"
    FIXED_ORDERING = "fixed"
    SHUFFLE_ONCE = "so"
    SAMPLE_W_REPLACEMENT = "swr"
    NTK_BALANCE = "ntk"  # not implemented by grabkit: GraBSampler names the alternatives
    NTK_FIXED_BALANCE = "ntk-fixed"
    NTK_EIGEN = "ntk-eigen"
    NTK_FIXED_EIGEN = "ntk-fixed-eigen"
    ORDER_BY_NORM = "norm"
    ADAPTIVE_MEAN_BALANCE = "adamean"
    ADAPTIVE_EMA_BALANCE = "adaema"
    SIGN_BALANCE = "sign"


#: grab-sampler keyword -> the grabkit keyword it spells
GRAB_SAMPLER_KEYWORDS: dict[str, str] = {
    "trainable_params": "params",
    "prob_balance": "probabilistic",
    "normalize_grads": "normalize",
    "random_projection": "projection",
}

#: grab-sampler ``random_projection`` value -> grabkit ``projection``
GRAB_SAMPLER_PROJECTIONS: dict[str, str | None] = {
    "none": None,
    "jl": "gaussian",
    "jl_sparse": "sparse",
    "kron": "kronecker",
}
