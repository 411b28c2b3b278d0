"""asym's batch-grouping notebook with only its imports changed (CPU, width 32 for speed).

The first test is the notebook's code cell by cell (``%time`` dropped, ``cuda:0`` -> ``cpu``,
8192 -> 32); the notebook's own slip of stepping ``model``'s optimizer in ``train_new`` is kept.
The second checks that grouped training reaches exactly the padded training's parameters.
"""

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


def test_notebook_code_runs_with_only_imports_changed() -> None:
    seed(0)
    dataset = make_dataset()
    loader = DataLoader(
        dataset,
        batch_size=256,
        collate_fn=lambda batch: standard_collate_fn(batch, target_device=DEVICE),
    )
    model = AModule(emb_dim=WIDTH, hidden_dim=WIDTH, device=DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)

    def train_standard():
        optimizer.zero_grad()
        for _i, (batch, y) in enumerate(tqdm(loader)):
            out = model(batch)
            mse = torch.mean((y - out) ** 2)
            mse.backward()
            optimizer.step()
            optimizer.zero_grad()

    train_standard()

    lengths = [len(data[0]) for data in dataset]
    length_thresholds = find_thresholds(lengths, cost_fn=lambda x: x, k=3, num_trials=100)
    print("thresholds:", length_thresholds)
    assert length_thresholds == [1, 4, 16]

    new_loader = DataLoader(
        dataset,
        batch_size=256,
        collate_fn=lambda batch: new_collate_fn(batch, target_device=DEVICE),
    )
    new_model = AnnotatedAModule(emb_dim=WIDTH, hidden_dim=WIDTH, device=DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)

    def train_new():
        optimizer.zero_grad()
        for _i, (batch, y) in enumerate(tqdm(new_loader)):
            grouper = LengthThresholdGrouper("sequence", length_thresholds)
            batch.group(grouper=grouper)
            out = batch.apply(new_model)
            out.regroup(grouper=UniGrouper())
            out = out.data_groups[0].value
            mse = torch.mean((y - out) ** 2)
            mse.backward()
            optimizer.step()
            optimizer.zero_grad()

    train_new()
    assert all(p.grad is not None for p in new_model.parameters())


def test_grouped_training_reaches_the_padded_training_parameters() -> None:
    seed(1)
    torch.manual_seed(1)
    dataset = make_dataset()
    thresholds = find_thresholds([len(x) for x, _ in dataset], cost_fn=lambda x: x, k=3)
    loader = DataLoader(dataset, batch_size=256, collate_fn=standard_collate_fn_cpu)
    new_loader = DataLoader(dataset, batch_size=256, collate_fn=new_collate_fn_cpu)
    model = AModule(emb_dim=WIDTH, hidden_dim=WIDTH, device=DEVICE).double()
    new_model = AnnotatedAModule(emb_dim=WIDTH, hidden_dim=WIDTH, device=DEVICE).double()
    new_model.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    new_optimizer = torch.optim.SGD(new_model.parameters(), lr=0.1)
    for (batch, y), (dc, y2) in zip(loader, new_loader, strict=True):
        torch.mean((y.double() - model(batch)) ** 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        dc.group(grouper=LengthThresholdGrouper("sequence", thresholds))
        assert len(dc.data_groups) == 4
        out = dc.apply(new_model)
        out.regroup(grouper=UniGrouper())
        torch.mean((y2.double() - out.data_groups[0].value) ** 2).backward()
        new_optimizer.step()
        new_optimizer.zero_grad()
    for (name, a), b in zip(
        model.state_dict().items(), new_model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def standard_collate_fn_cpu(batch):
    return standard_collate_fn(batch, target_device=DEVICE)


def new_collate_fn_cpu(batch):
    return new_collate_fn(batch, target_device=DEVICE)
