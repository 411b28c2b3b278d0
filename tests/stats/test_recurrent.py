"""nn.LSTM, nn.GRU and nn.RNN against per-example ``torch.autograd.grad`` (float64).

Each model's reference row i is the gradient of example i's own loss term, computed on a batch of
that one example; every read (norms, Gram, dots, weighted sums) must match to 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

from grabkit.stats import PerSampleStats

VOCAB, WIDTH, CLASSES = 11, 6, 3


class RecurrentLM(nn.Module):
    """Embedding -> recurrent layer -> linear head over the vocabulary (optionally tied)."""

    def __init__(self, kind: str, tied: bool = False, batch_first: bool = True, **options):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.rnn = getattr(nn, kind)(WIDTH, WIDTH, batch_first=batch_first, **options)
        directions = 2 if options.get("bidirectional") else 1
        self.head = nn.Linear(directions * WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embedding.weight
        self.batch_first = batch_first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        if self.batch_first:
            return self.head(self.rnn(x)[0])
        out = self.rnn(x.transpose(0, 1))[0]  # (T, B, H): the examples are dim 1
        return self.head(out.transpose(0, 1).contiguous())


class BidirectionalClassifier(nn.Module):
    """A 2-layer bidirectional LSTM; the class from the final states of the last layer."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, 5, num_layers=2, bidirectional=True, batch_first=True, **options)
        state = self.lstm.proj_size if self.lstm.proj_size > 0 else 5
        self.head = nn.Linear(2 * state, CLASSES)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, (h_n, _) = self.lstm(self.embedding(idx))
        return self.head(torch.cat([h_n[-2], h_n[-1]], dim=1))


class WithInitialState(nn.Module):
    """A tanh RNN started from a state computed from the input (hx given)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.start = nn.Linear(WIDTH, WIDTH)
        self.rnn = nn.RNN(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        h0 = torch.tanh(self.start(x[:, 0])).unsqueeze(0).repeat(2, 1, 1)  # (L, B, H)
        return self.head(self.rnn(x, h0)[0])


class Packed(nn.Module):
    """A bidirectional recurrent layer over packed sequences of each example's own length
    (unsorted batch); with ``final_state`` the class comes from h_n (and the layer starts from
    a state computed from the input)."""

    def __init__(self, kind: str, final_state: bool = False, **options) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.rnn = getattr(nn, kind)(
            WIDTH, WIDTH, batch_first=True, bidirectional=True, num_layers=2, **options
        )
        out = 2 * (self.rnn.proj_size if options.get("proj_size") else WIDTH)
        self.head = nn.Linear(out, CLASSES if final_state else VOCAB)
        self.final_state = final_state

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        lengths = (idx != 0).sum(dim=1)  # token 0 pads the end of shorter examples
        x = self.embedding(idx)
        packed = pack_padded_sequence(x, lengths, True, enforce_sorted=False)
        if not self.final_state:
            out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
            return self.head(out)
        state = torch.tanh(x[:, :1].transpose(0, 1)).repeat(4, 1, 1)  # (L D, B, WIDTH)
        if isinstance(self.rnn, nn.LSTM):
            hidden = state[..., : self.rnn.proj_size or WIDTH]
            _, (h_n, _) = self.rnn(packed, (hidden.contiguous(), state.contiguous()))
        else:
            _, h_n = self.rnn(packed, state.contiguous())
        return self.head(torch.cat([h_n[-2], h_n[-1]], dim=1))


def token_losses(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B,) summed next-token cross entropy per example (padding tokens 0 ignored)."""
    t = logits.shape[1]
    per_token = F.cross_entropy(
        logits.flatten(0, 1), idx[:, :t].flatten(), reduction="none", ignore_index=0
    )
    return per_token.view(idx.shape[0], t).sum(dim=1)


def class_losses(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, idx[:, 0] % CLASSES, reduction="none")


def losses_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return token_losses(logits, idx) if logits.dim() == 3 else class_losses(logits, idx)


def reference_rows(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """(B, d) gradient of each example's own loss, on a batch of that example alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(idx.shape[0]):
        one = idx[i : i + 1]
        if isinstance(model, Packed):
            one = one[:, : int((one != 0).sum())]  # its own length, no padding
        for p in params:
            p.grad = None
        losses_of(model, one).sum().backward()  # not autograd.grad: reentrant checkpointing
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    for p in params:
        p.grad = None
    return torch.stack(rows)


def check(model: nn.Module, idx: torch.Tensor, reference_tools, reduction: str = "sum") -> None:
    reference = reference_rows(model, idx)
    with PerSampleStats(model, reduction) as stats:
        losses = losses_of(model, idx)
        (losses.sum() if reduction == "sum" else losses.mean()).backward()
        reference_tools.assert_matches(stats, reference)


MODELS = {
    "lstm-lm": lambda: RecurrentLM("LSTM"),
    "lstm-lm-tied": lambda: RecurrentLM("LSTM", tied=True),
    "gru-lm": lambda: RecurrentLM("GRU"),
    "gru-lm-tied": lambda: RecurrentLM("GRU", tied=True),
    "lstm-sequence-first": lambda: RecurrentLM("LSTM", batch_first=False, num_layers=2),
    "gru-sequence-first-bidirectional": lambda: RecurrentLM(
        "GRU", batch_first=False, bidirectional=True
    ),
    "rnn-relu": lambda: RecurrentLM("RNN", nonlinearity="relu"),
    "rnn-tanh-no-bias": lambda: RecurrentLM("RNN", bias=False, num_layers=2),
    "lstm-no-bias-bidirectional": lambda: RecurrentLM(
        "LSTM", bias=False, num_layers=2, bidirectional=True
    ),
    "lstm-projection": lambda: BidirectionalClassifier(proj_size=3),
    "bidirectional-classifier": BidirectionalClassifier,
    "initial-state": WithInitialState,
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("batch", "length"), [(3, 5), (4, 4)])
def test_recurrent_models_match_per_example_autograd(float64, reference_tools, name, batch, length):
    torch.manual_seed(0)
    model = MODELS[name]()
    idx = torch.randint(1, VOCAB, (batch, length))
    check(model, idx, reference_tools)


class Siamese(nn.Module):
    """One GRU called twice per forward (both halves of each example): its per-example gradient
    is the sum over the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        half = idx.shape[1] // 2
        _, left = self.gru(self.embedding(idx[:, :half]))
        _, right = self.gru(self.embedding(idx[:, half:]))
        return self.head(torch.cat([left[0], right[0]], dim=1))


def test_layer_called_twice(float64, reference_tools):
    torch.manual_seed(7)
    check(Siamese(), torch.randint(1, VOCAB, (3, 6)), reference_tools)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_float32_model(kind):
    """float32 weights and activations: the replay runs in float32, close to the reference."""
    torch.manual_seed(10)
    model = RecurrentLM(kind, num_layers=2, bidirectional=True)
    idx = torch.randint(1, VOCAB, (4, 6))
    reference = reference_rows(model, idx)
    with PerSampleStats(model, "sum") as stats:
        losses_of(model, idx).sum().backward()
        norms = stats.norms_squared()
    expected = (reference * reference).sum(1)
    assert norms.dtype == torch.float32
    assert float(((norms - expected).abs() / expected).max()) < 1e-4


def test_mean_reduced_loss(float64, reference_tools):
    torch.manual_seed(1)
    check(RecurrentLM("LSTM", tied=True), torch.randint(1, VOCAB, (3, 6)), reference_tools, "mean")


@pytest.mark.parametrize(
    "make",
    [
        lambda: Packed("LSTM"),
        lambda: Packed("GRU"),
        lambda: Packed("RNN"),
        lambda: Packed("LSTM", final_state=True),
        lambda: Packed("LSTM", final_state=True, proj_size=3),
        lambda: Packed("GRU", final_state=True),
        lambda: Packed("RNN", final_state=True, nonlinearity="relu"),
    ],
)
def test_packed_sequences_of_different_lengths(float64, reference_tools, make):
    torch.manual_seed(2)
    idx = torch.randint(1, VOCAB, (4, 6))
    for i, length in enumerate([3, 6, 1, 4]):  # unsorted lengths
        idx[i, length:] = 0
    check(make(), idx, reference_tools)


class CheckpointedLSTM(RecurrentLM):
    def __init__(self, reentrant: bool) -> None:
        super().__init__("LSTM", num_layers=2)
        self.reentrant = reentrant

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        out = checkpoint(lambda z: self.rnn(z)[0], x, use_reentrant=self.reentrant)
        return self.head(out)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_lstm(float64, reference_tools, reentrant):
    torch.manual_seed(3)
    check(CheckpointedLSTM(reentrant), torch.randint(1, VOCAB, (3, 5)), reference_tools)


def test_eval_mode_dropout_between_layers_is_exact(float64, reference_tools):
    torch.manual_seed(4)
    model = RecurrentLM("GRU", num_layers=2, dropout=0.5).eval()
    check(model, torch.randint(1, VOCAB, (3, 5)), reference_tools)


def test_dropout_between_layers_in_training_is_refused():
    model = RecurrentLM("LSTM", num_layers=2, dropout=0.3)
    idx = torch.randint(1, VOCAB, (3, 5))
    with PerSampleStats(model), pytest.raises(ValueError, match=r"dropout=0.3.*nn.Dropout"):
        model(idx)


def test_unbatched_input_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.GRU(4, 4))
    with PerSampleStats(model), pytest.raises(ValueError, match="without a batch dimension"):
        model(torch.randn(5, 4))


class SequenceFirstModel(nn.Module):
    """A model whose input is (T, B) token ids: its dim 0 is not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embedding(idx))[0])


@pytest.mark.parametrize(("length", "batch"), [(5, 3), (4, 4)])
def test_sequence_first_model_input_is_refused(length, batch):
    # (4, 4) is T == B: dim 0 of the model's input looks like a batch, the LSTM's dim 1 too;
    # the LSTM's input is contiguous sequence-first, so its batch dim is not the outer one.
    model = SequenceFirstModel()
    with PerSampleStats(model), pytest.raises(ValueError, match="'lstm'"):
        model(torch.randint(0, VOCAB, (length, batch)))


def test_final_states_only_and_frozen_layer(float64, reference_tools):
    """Gradients reach the LSTM only through h_n; its first layer is frozen."""
    torch.manual_seed(5)
    model = BidirectionalClassifier()
    for name, p in model.lstm.named_parameters():
        if "_l0" in name:
            p.requires_grad_(False)
    check(model, torch.randint(1, VOCAB, (4, 5)), reference_tools)


@pytest.mark.parametrize(("kind", "tied"), [("LSTM", False), ("LSTM", True), ("GRU", True)])
def test_hook_mode_sampler_decides_as_dense_reference(float64, kind, tied):
    from grabkit.order import GraBSampler

    torch.manual_seed(6)
    n, batch, length = 12, 4, 5
    idx_all = torch.randint(1, VOCAB, (n, length))
    model = RecurrentLM(kind, tied=tied, num_layers=2)
    reference_model = RecurrentLM(kind, tied=tied, num_layers=2)  # unhooked copy
    dataset = torch.utils.data.TensorDataset(idx_all)
    hooked = GraBSampler(dataset, model=model, balance_type="pair", loss_reduction="sum")
    dense = GraBSampler(dataset, dict(model.named_parameters()), balance_type="pair")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    orders = []
    for _ in range(3):
        order = list(iter(hooked))
        assert order == list(iter(dense))
        orders.append(order)
        for start in range(0, n, batch):
            idx = idx_all[torch.tensor(order[start : start + batch])]
            reference_model.load_state_dict(model.state_dict())
            reference = reference_rows(reference_model, idx)
            opt.zero_grad()
            losses_of(model, idx).sum().backward()
            hooked.step()
            dense.step(reference)
            opt.step()
    assert list(iter(hooked)) == list(iter(dense))
    assert orders[1] != orders[2] or orders[0] != orders[1]  # the orders did change
    hooked.stats.close()


class InPlaceAfter(nn.Module):
    """The LSTM's output sequence is changed in place after the call (an in-place activation)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=batch_first)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.batch_first = batch_first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        if self.batch_first:
            out = self.lstm(x)[0]
        else:
            out = self.lstm(x.transpose(0, 1))[0].transpose(0, 1)
        out.mul_(3.0)
        return self.head(out)


@pytest.mark.parametrize("batch_first", [True, False])
def test_output_changed_in_place_after_the_call(float64, reference_tools, batch_first):
    torch.manual_seed(8)
    check(InPlaceAfter(batch_first), torch.randint(1, VOCAB, (3, 5)), reference_tools)


class StatefulGRU(nn.Module):
    """Starts from a hidden state kept in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("state", torch.randn(1, 1, WIDTH))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        start = self.state.expand(1, idx.shape[0], WIDTH)
        return self.head(self.gru(self.embedding(idx), start)[0])


def test_initial_state_changed_in_place_before_the_read(float64, reference_tools):
    torch.manual_seed(9)
    model = StatefulGRU()
    idx = torch.randint(1, VOCAB, (3, 5))
    reference = reference_rows(model, idx)
    with PerSampleStats(model, "sum") as stats:
        losses_of(model, idx).sum().backward()
        model.state.add_(1.0)  # say, the next state written into the buffer
        reference_tools.assert_matches(stats, reference)
