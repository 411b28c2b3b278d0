"""asym's batch-grouping notebook, run with only its imports changed (CPU, smaller widths)."""

from __future__ import annotations

import torch
import torch.nn as nn
from numpy.random import choice, seed
from torch.nn.functional import pad
from torch.utils.data import DataLoader
from tqdm import tqdm

from grabkit.group import (
    AnnotatedModule,
    DataCollection,
    LengthThresholdGrouper,
    UniGrouper,
    find_thresholds,
)

DEVICE = "cpu"
WIDTH = 32


def make_dataset(dataset_size: int = 1024):
    length_distribution = {4**i: 4 ** (-i) for i in range(4)}
    total_weight = sum(length_distribution.values())
    length_distribution = {
        num: weight / total_weight for num, weight in length_distribution.items()
    }
    lengths = choice(
        list(length_distribution.keys()),
        size=dataset_size,
        replace=True,
        p=list(length_distribution.values()),
    ).tolist()
    return [(torch.randint(0, 8, (length,)), choice([0, 1])) for length in lengths]


class AModule(nn.Module):
    def __init__(self, emb_dim=1024, hidden_dim=1024, device="cuda:0"):
        super().__init__()
        self.emb = nn.Embedding(8, emb_dim, device=device)
        self.linear = nn.Linear(emb_dim, hidden_dim, device=device)
        self.proj = nn.Linear(hidden_dim, 1, device=device)

    def forward(self, d):
        x = d["x"]
        mask = d["mask"]
        assert x.shape == mask.shape
        assert len(x.shape) == 2
        x = self.emb(x)
        x = self.linear(x)
        minus_inf = torch.tensor(-float("inf"), device=x.device)
        x = torch.where(mask[:, :, None].broadcast_to(x.shape), x, minus_inf)
        x = torch.max(x, dim=1).values
        return self.proj(x)[:, 0]


def standard_collate_fn(data_list, target_device="cuda:0"):
    xs = [x.to(device=target_device) for x, _ in data_list]
    ys = [y for _, y in data_list]
    max_len = max(len(x) for x in xs)
    batch = {
        "x": torch.stack([pad(x, (0, max_len - len(x))) for x in xs], dim=0),
        "mask": torch.stack(
            [pad(torch.ones_like(x, dtype=torch.bool), (0, max_len - len(x))) for x in xs], dim=0
        ),
    }
    y = torch.tensor(ys, dtype=torch.float32, device=target_device)
    return batch, y


class AnnotatedAModule(AnnotatedModule):
    def __init__(self, emb_dim=1024, hidden_dim=1024, device="cuda:0"):
        super().__init__()
        self.emb = nn.Embedding(8, emb_dim, device=device)
        self.linear = nn.Linear(emb_dim, hidden_dim, device=device)
        self.proj = nn.Linear(hidden_dim, 1, device=device)

    def forward(self, x, mask):
        assert x.shape == mask.shape
        assert len(x.shape) == 2
        x = self.emb(x)
        x = self.linear(x)
        minus_inf = torch.tensor(-float("inf"), device=x.device)
        x = torch.where(mask[:, :, None].broadcast_to(x.shape), x, minus_inf)
        x = torch.max(x, dim=1).values
        return self.proj(x)[:, 0]

    def get_mask_hint(self):
        return ["seq"]

    def get_input_annot(self):
        return "(b, l_seq)"

    def get_output_annot(self):
        return "(b)"


def new_collate_fn(data_list, target_device="cuda:0"):
    xs = [x.to(device=target_device) for x, _ in data_list]
    ys = [y for _, y in data_list]
    dc = DataCollection("(B, L_sequence)", xs)
    y = torch.tensor(ys, dtype=torch.float32, device=target_device)
    return dc, y


def test_notebook_runs_and_matches_padded_training() -> None:
    seed(0)
    torch.manual_seed(0)
    dataset = make_dataset()
    lengths = [len(data[0]) for data in dataset]
    length_thresholds = find_thresholds(lengths, cost_fn=lambda x: x, k=3, num_trials=100)
    assert length_thresholds == [1, 4, 16]

    loader = DataLoader(
        dataset, batch_size=256, collate_fn=lambda b: standard_collate_fn(b, target_device=DEVICE)
    )
    new_loader = DataLoader(
        dataset, batch_size=256, collate_fn=lambda b: new_collate_fn(b, target_device=DEVICE)
    )
    model = AModule(emb_dim=WIDTH, hidden_dim=WIDTH, device=DEVICE).double()
    new_model = AnnotatedAModule(emb_dim=WIDTH, hidden_dim=WIDTH, device=DEVICE).double()
    new_model.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    new_optimizer = torch.optim.SGD(new_model.parameters(), lr=0.001)

    def train_standard():
        optimizer.zero_grad()
        for batch, y in tqdm(loader, disable=True):
            out = model(batch)
            mse = torch.mean((y - out) ** 2)
            mse.backward()
            optimizer.step()
            optimizer.zero_grad()

    def train_new():
        new_optimizer.zero_grad()
        for batch, y in tqdm(new_loader, disable=True):
            grouper = LengthThresholdGrouper("sequence", length_thresholds)
            batch.group(grouper=grouper)
            assert len(batch.data_groups) == 4
            out = batch.apply(new_model)
            out.regroup(grouper=UniGrouper())
            out = out.data_groups[0].value
            mse = torch.mean((y - out) ** 2)
            mse.backward()
            new_optimizer.step()
            new_optimizer.zero_grad()

    train_standard()
    train_new()
    for (name, a), b in zip(model.state_dict().items(), new_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
