"""Grouping on real length distributions: IMDB review lengths (skips without shared data)."""

from __future__ import annotations

import tarfile

import pytest
import torch

from grabkit.group import (
    DataCollection,
    LengthThresholdGrouper,
    find_thresholds,
    plan_groups,
)

pytestmark = pytest.mark.data


@pytest.fixture(scope="module")
def imdb_lengths(shared_data) -> list[int]:
    path = shared_data / "imdb" / "aclImdb_labeled.tar.gz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    lengths = []
    with tarfile.open(path, "r:gz") as archive:
        for member in archive:
            review = "/train/" in member.name or "/test/" in member.name
            if member.isfile() and review and member.name.endswith(".txt"):
                lengths.append(len(archive.extractfile(member).read().split()))
                if len(lengths) == 2048:
                    break
    return lengths


def efficiency(batches, split) -> float:
    real = computed = 0
    for lens in batches:
        real += int(lens.sum())
        computed += sum(len(part) * int(part.max()) for part in split(lens) if len(part))
    return real / computed


def test_planning_recovers_most_padding_on_imdb(imdb_lengths) -> None:
    lengths = torch.tensor(imdb_lengths)
    batches = torch.split(lengths[torch.randperm(len(lengths))], 256)
    padded = efficiency(batches, lambda lens: [lens])
    planned = efficiency(batches, lambda lens: [lens[g] for g in plan_groups(lens).groups])
    thresholds = find_thresholds(imdb_lengths, "linear", 3)
    binned = efficiency(
        batches,
        lambda lens: [lens[torch.bucketize(lens, torch.tensor(thresholds)) == b] for b in range(4)],
    )
    assert padded < 0.45 < binned < planned


def test_exact_thresholds_beat_the_balancing_heuristic(imdb_lengths) -> None:
    def dataset_cost(thresholds):
        bins: dict[int, list[int]] = {}
        for L in imdb_lengths:
            bins.setdefault(sum(t < L for t in thresholds), []).append(L)
        return sum(len(b) * max(b) for b in bins.values())

    exact = find_thresholds(imdb_lengths, "linear", 3)
    heuristic = find_thresholds(imdb_lengths, "linear", 3, method="balance", num_trials=5, seed=0)
    assert dataset_cost(exact) <= dataset_cost(heuristic)


def test_data_collection_on_real_token_lengths(imdb_lengths) -> None:
    xs = [torch.zeros(n, dtype=torch.long) for n in imdb_lengths[:256]]
    dc = DataCollection("(B, L_tokens)", xs)
    dc.group(LengthThresholdGrouper("tokens", find_thresholds(imdb_lengths, "linear", 3)))
    assert sum(len(p) for p in dc.data_partition) == 256
    dc.ungroup()
    assert [len(d.value) for d in dc.data_list] == imdb_lengths[:256]
