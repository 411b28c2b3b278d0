"""A 2-layer LSTM word language model at the GraB authors' settings, on Penn Treebank.

The authors' ``lstm_wiki.sh`` trains on WikiText-2, whose training split ``../shared/data`` does
not hold; Penn Treebank's train / valid / test (929k / 74k / 82k tokens, vocabulary 10k) is the
classic benchmark for this model and is used instead. As in their ``main.py``: the vocabulary
is every word of the three files (with ``<eos>`` ending each line); the training text is cut into
40 streams (``batchify``), and the unit of ordering is one bptt chunk of 35 rows of all 40
streams (663 units on PTB); one optimizer step per chunk; the hidden state starts at zero each
epoch and is carried, detached, from one chunk to the next *in visit order* (whatever the
ordering); the gradient is clipped to norm 0.25 before GraB sees it and before the step; SGD
lr 5 momentum 0.9, ``ReduceLROnPlateau(mode="min", factor=0.1, patience=5, threshold=5)`` on the
validation perplexity (with ``threshold=5`` no epoch counts as an improvement, so the rate drops
10x every 6 epochs: 5 for epochs 1-6, 0.5 for 7-12, ...).

grabkit expresses the unit directly: the sampler orders a dataset of 663 chunks and
``sampler.step(g[None])`` takes the chunk's clipped (1, d) gradient (d = 667k), since the unit is
the whole step's batch. ``rr`` draws a fresh permutation of the chunks each epoch; ``mean`` (the
authors' GraB) and ``pair`` start in dataset order.

Evaluation after each epoch, in order with the hidden state carried: training text (40 streams),
validation (10 streams, the authors' ``val_batch_size``) and test (1 stream); the mean loss per
token evaluated (the authors divide by all rows, including the < 35 rows of the last incomplete
chunk that they never evaluate: a 0.15% difference on the training text).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.experiments.data import DATA, DataMissing
from grabkit.order import GraBSampler

ORDERINGS = ("rr", "mean", "pair")


def tokenize(paths: list[Path]) -> tuple[list[torch.Tensor], int]:
    """The authors' ``Corpus``: one dictionary over all files in order, ids per file."""
    index: dict[str, int] = {}
    out = []
    for path in paths:
        if not path.exists():
            raise DataMissing(f"{path} not found (see ../shared/data's README)")
        ids = []
        for line in path.read_text(encoding="utf-8").splitlines():
            for word in [*line.split(), "<eos>"]:
                ids.append(index.setdefault(word, len(index)))
        out.append(torch.tensor(ids, dtype=torch.int64))
    return out, len(index)


def batchify(ids: torch.Tensor, streams: int) -> torch.Tensor:
    """(rows, streams): the text cut into ``streams`` contiguous pieces, one per column."""
    rows = len(ids) // streams
    return ids[: rows * streams].view(streams, rows).t().contiguous()


class RNNModel(nn.Module):
    """The authors' ``RNNModel("LSTM", ...)``: Embedding, nn.LSTM (sequence first), Linear
    decoder, log-softmax; embedding and decoder weights uniform in +-0.1, decoder bias 0."""

    def __init__(self, vocab: int, emsize: int = 32, nhid: int = 32, nlayers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, emsize)
        self.rnn = nn.LSTM(emsize, nhid, nlayers, dropout=0.0)
        self.decoder = nn.Linear(nhid, vocab)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(
        self, ids: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """ids (T, S) -> log-probabilities (T * S, vocab) and the final (h, c)."""
        output, hidden = self.rnn(self.encoder(ids), hidden)
        return nn.functional.log_softmax(self.decoder(output).flatten(0, 1), dim=1), hidden

    def init_hidden(self, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = self.decoder.weight.new_zeros(self.nlayers, streams, self.nhid)
        return zeros, zeros.clone()


SETTINGS = {
    "model": "2-layer LSTM LM, emb 32, hidden 32, untied, no dropout, on PTB",
    "streams": 40, "bptt": 35, "optimizer": "SGD", "lr": 5.0, "momentum": 0.9, "clip": 0.25,
    "scheduler": "ReduceLROnPlateau(min, factor 0.1, patience 5, threshold 5) on valid ppl",
    "valid_streams": 10, "test_streams": 1, "epochs": 50,
}  # fmt: skip


def load_corpus(synthetic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    if synthetic:
        g = torch.Generator().manual_seed(0)
        return (
            torch.randint(0, 50, (40 * 35 * 6 + 40,), generator=g),
            torch.randint(0, 50, (10 * 35 * 2,), generator=g),
            torch.randint(0, 50, (35 * 3,), generator=g),
            50,
        )
    folder = DATA / "ptb"
    (train, valid, test), vocab = tokenize(
        [folder / f"ptb.{split}.txt" for split in ("train", "valid", "test")]
    )
    return train, valid, test, vocab


class LSTMTrainer:
    """One (ordering, seed) of the LSTM task; the model's draw depends only on the seed."""

    def __init__(
        self,
        ordering: str,
        seed: int,
        corpus: tuple,
        settings: dict = SETTINGS,
        device: str = "cpu",
    ):
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r}; expected one of {ORDERINGS}")
        train, valid, test, vocab = corpus
        self.ordering, self.seed, self.s = ordering, seed, settings
        self.device = torch.device(device)
        self.train = batchify(train, settings["streams"]).to(self.device)
        self.valid = batchify(valid, settings["valid_streams"]).to(self.device)
        self.test = batchify(test, settings["test_streams"]).to(self.device)
        self.chunks = len(self.train) // settings["bptt"]
        torch.manual_seed(seed)
        self.model = RNNModel(vocab).to(self.device)  # drawn on the CPU: the same on a GPU
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=settings["lr"], momentum=settings["momentum"]
        )
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.optimizer, mode="min", factor=0.1, patience=5, threshold=5
        )
        self.sampler = None
        if ordering != "rr":
            self.sampler = GraBSampler(
                range(self.chunks), params=list(self.model.parameters()), balance_type=ordering,
                seed=seed, random_first_epoch=False,
            )  # fmt: skip

    def _chunk(self, source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.s["bptt"]
        length = min(self.s["bptt"], len(source) - 1 - start)
        return source[start : start + length], source[start + 1 : start + 1 + length].flatten()

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        if self.sampler is None:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.chunks, generator=generator).tolist()
        else:
            order = list(iter(self.sampler))
        lr = self.optimizer.param_groups[0]["lr"]
        hidden = self.model.init_hidden(self.s["streams"])
        params = list(self.model.parameters())
        for i in order:
            ids, targets = self._chunk(self.train, i)
            self.optimizer.zero_grad()
            hidden = tuple(h.detach() for h in hidden)
            log_probs, hidden = self.model(ids, hidden)
            nn.functional.nll_loss(log_probs, targets).backward()
            nn.utils.clip_grad_norm_(params, self.s["clip"])
            if self.sampler is not None:
                self.sampler.step(torch.cat([p.grad.flatten() for p in params])[None])
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the epoch's time is the finished work
        return {"lr": lr}

    def _mean_loss(self, source: torch.Tensor) -> float:
        hidden = self.model.init_hidden(source.shape[1])
        # summed in float64 on the device and read once (one host sync per split, not per chunk):
        # the same sequence of double additions as summing each chunk's ``.item()``
        total, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        with torch.no_grad():
            for i in range(len(source) // self.s["bptt"]):
                ids, targets = self._chunk(source, i)
                log_probs, hidden = self.model(ids, hidden)
                total += nn.functional.nll_loss(log_probs, targets, reduction="sum").double()
                tokens += targets.numel()
        return total.item() / tokens

    def evaluate(self) -> dict[str, float]:
        """Per-token training loss; validation and test perplexity (``test_metric``)."""
        self.model.eval()
        valid = math.exp(self._mean_loss(self.valid))
        return {
            "train_loss": self._mean_loss(self.train),
            "valid_ppl": valid,
            "test_metric": math.exp(self._mean_loss(self.test)),
        }

    def after_evaluation(self, metrics: dict[str, float]) -> None:
        self.scheduler.step(metrics["valid_ppl"])

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
            if list(iter(self.sampler)):
                raise ValueError("the checkpoint was not taken at an epoch's end")

    def close(self) -> None:
        """Nothing to release: the functional sampler holds no hooks."""
