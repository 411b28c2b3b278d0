"""DataCollection: grouped runs equal the padded run and a per-item reference, in order."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from grabkit.group import (
    AnnotatedModule,
    AnnotationError,
    CDimPadder,
    DataCollection,
    DynamicGrouper,
    IncompatibleDataCollectionError,
    LengthThresholdGrouper,
    PredefinedConsecutiveGrouper,
    PredefinedGrouper,
    UniGrouper,
)

TOL = dict(rtol=1e-5, atol=1e-5)


class MaskedMeanPool(AnnotatedModule):
    """(b, l_seq, m_in) -> per-position features (b, l_seq, m_out) and a pooled (b, m_out)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(4, width)

    def forward(self, x, mask):
        h = torch.tanh(self.linear(x))
        m = mask[..., None].to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1)
        return {"tokens": h, "pooled": pooled}

    def get_input_annot(self):
        return "(b, l_seq, m_in)"

    def get_output_annot(self):
        return {"tokens": "(b, l_seq, m_out)", "pooled": "(b, m_out)"}

    def get_mask_hint(self):
        return ["seq"]


def items_1d(lengths, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) for n in lengths]


def test_grouped_apply_matches_padded_and_per_item_with_gradients() -> None:
    torch.manual_seed(0)
    lengths = [3, 1, 7, 2, 7, 5, 1, 4]
    xs = [x.requires_grad_() for x in items_1d(lengths)]
    module = MaskedMeanPool()

    dc = DataCollection("(B, L_seq, M_in)", xs)
    dc.group(LengthThresholdGrouper("seq", [2, 4]))
    assert len(dc.data_groups) == 3
    assert sorted(i for part in dc.data_partition for i in part) == list(range(8))
    out = dc.apply(module)
    pooled_dc = out["pooled"]
    pooled_dc.regroup(UniGrouper())
    pooled = pooled_dc.data_groups[0].value
    out.ungroup()
    tokens = [d["tokens"].value for d in out.data_list]

    ref_pooled, ref_tokens = [], []
    for x in xs:
        r = module(x[None], torch.ones(1, len(x), dtype=torch.bool))
        ref_pooled.append(r["pooled"][0])
        ref_tokens.append(r["tokens"][0])
    torch.testing.assert_close(pooled, torch.stack(ref_pooled), **TOL)
    for t, r, n in zip(tokens, ref_tokens, lengths, strict=True):
        assert t.shape == (n, 6)
        torch.testing.assert_close(t, r, **TOL)

    # gradients: grouped vs one padded batch
    loss = pooled.square().sum() + sum(t.sum() for t in tokens)
    grads = torch.autograd.grad(loss, [*xs, *module.parameters()])
    padded = DataCollection("(B, L_seq, M_in)", xs)
    padded.group(UniGrouper())
    full = padded.apply(module)
    full.ungroup()
    ref_loss = torch.stack([d["pooled"].value for d in full.data_list]).square().sum() + sum(
        d["tokens"].value.sum() for d in full.data_list
    )
    ref_grads = torch.autograd.grad(ref_loss, [*xs, *module.parameters()])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


class PairScore(AnnotatedModule):
    """Two length dims: (b, l_a, l_b, m) -> (b, l_a, l_b) scores and a masked sum (b)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x, mask):
        s = self.linear(x)[..., 0]
        return {"scores": s, "total": (s * mask).sum((1, 2))}

    def get_input_annot(self):
        return "(b, l_a, l_b, m_f)"

    def get_output_annot(self):
        return {"scores": "(b, l_a, l_b)", "total": "(b)"}

    def get_mask_hint(self):
        return "copy_like_first"  # replaced in the test


def test_two_length_dims_masks_are_and_and_results_match() -> None:
    torch.manual_seed(1)
    shapes = [(2, 5), (4, 1), (1, 3), (3, 3), (5, 2)]
    xs = [torch.randn(a, b, 3, requires_grad=True) for a, b in shapes]
    dc = DataCollection("(B, L_row, L_col, M_f)", xs)
    dc.group(PredefinedGrouper([[0, 2], [1, 3, 4]]))
    mask = dc.get_mask(1, mask_hint=["row", "col"])
    assert mask.shape == (3, 5, 3)
    expected = torch.zeros(3, 5, 3, dtype=torch.bool)
    for r, i in enumerate([1, 3, 4]):
        expected[r, : shapes[i][0], : shapes[i][1]] = True
    assert torch.equal(mask, expected)  # AND of the two length dims, not OR
    copy = dc.get_mask(1, mask_hint="copy")
    assert copy.shape == (3, 5, 3, 3) and torch.equal(copy, expected[..., None].expand(3, 5, 3, 3))

    module = PairScore()
    out = dc.apply(module, mask_hint=["a", "b"])  # explicit hint overrides the module's
    out.ungroup()
    loss, ref_loss = 0, 0
    for d, x in zip(out.data_list, xs, strict=True):
        ref = module(x[None], torch.ones(1, *x.shape[:2]))
        torch.testing.assert_close(d["scores"].value, ref["scores"][0], **TOL)
        torch.testing.assert_close(d["total"].value, ref["total"][0], **TOL)
        loss = loss + d["scores"].value.square().sum() + d["total"].value
        ref_loss = ref_loss + ref["scores"].square().sum() + ref["total"].sum()
    params = [*xs, *module.parameters()]
    grads = torch.autograd.grad(loss, params)
    for a, b in zip(grads, torch.autograd.grad(ref_loss, params), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_nested_data_with_structured_padding_and_key_conversion() -> None:
    torch.manual_seed(2)
    annot = {
        "protein": {"p": "(B, L_res, M_1)", "R": "(B, L_res, 3, 3)"},
        "ligand": {"m": "(B, L_atm, M_2)"},
    }
    pairs = [(4, 2), (2, 5), (6, 1), (3, 3)]
    data = [
        {
            "protein": {"p": torch.randn(r, 5, requires_grad=True), "R": torch.randn(r, 3, 3)},
            "ligand": {"m": torch.randn(a, 2, requires_grad=True)},
        }
        for r, a in pairs
    ]
    dc = DataCollection(annot, data, padding={"protein": {"R": CDimPadder(torch.eye(3))}})
    dc.group(LengthThresholdGrouper("res", [3]))
    for group, part in zip(dc.data_groups, dc.data_partition, strict=True):
        R = group["protein"]["R"].value
        for row, item in enumerate(part):
            n = pairs[item][0]
            torch.testing.assert_close(R[row, :n], data[item]["protein"]["R"])
            assert torch.equal(R[row, n:], torch.eye(3).expand(R.shape[1] - n, 3, 3))

    class Cross(AnnotatedModule):
        def forward(self, d):
            a = d["objects1"]["feature"].sum(-1)  # (b, l_1)
            b = d["objects2"]["feature"].sum(-1)  # (b, l_2)
            return a[:, :, None] * b[:, None, :]

        def get_input_annot(self):
            return {
                "objects1": {"feature": "(b, .., m_1)"},
                "objects2": {"feature": "(b, .2., m_2)"},
            }

        def get_output_annot(self):
            return "(b, .., .2.)"

    conv = {
        "protein": ("objects1", {"p": ("feature", None)}),
        "ligand": ("objects2", {"m": ("feature", None)}),
    }
    out = dc.apply(Cross(), input_key_conv=conv)
    out.ungroup()
    leaves = [t for item in data for t in (item["protein"]["p"], item["ligand"]["m"])]
    weights = [torch.randn(r, a) for r, a in pairs]
    refs = []
    for d, item, (r, a) in zip(out.data_list, data, pairs, strict=True):
        ref = item["protein"]["p"].sum(-1)[:, None] * item["ligand"]["m"].sum(-1)[None, :]
        assert d.value.shape == (r, a)
        torch.testing.assert_close(d.value, ref, **TOL)
        refs.append(ref)
    grads = torch.autograd.grad(
        sum((d.value * w).sum() for d, w in zip(out.data_list, weights, strict=True)), leaves
    )
    ref_grads = torch.autograd.grad(
        sum((r * w).sum() for r, w in zip(refs, weights, strict=True)), leaves
    )
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)

    # regroup on the other length keeps the identity padding; ungroup restores the items
    dc.regroup(LengthThresholdGrouper("atm", [2]))
    dc.ungroup()
    for got, item in zip(dc.data_list, data, strict=True):
        torch.testing.assert_close(got["protein"]["R"].value, item["protein"]["R"])
        torch.testing.assert_close(got["ligand"]["m"].value, item["ligand"]["m"])


class StridedConv(AnnotatedModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, kernel_size=3, stride=2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)

    def get_input_annot(self):
        return "(b, l_t, m_c)"

    def get_output_annot(self):
        return "(b, l_t, m_o)"

    def get_output_lengths(self):
        return {"t": lambda L: (L - 3) // 2 + 1}


def test_derived_output_lengths_and_padding_reset_on_regroup() -> None:
    torch.manual_seed(3)
    lengths = [3, 9, 5, 12, 4, 7]
    xs = [torch.randn(n, 2) for n in lengths]
    module = StridedConv()
    dc = DataCollection("(B, L_time, M_c)", xs)
    dc.group(DynamicGrouper("time", overhead=0.0))
    out = dc.apply(module)
    assert out.lengths["time"].tolist() == [(n - 3) // 2 + 1 for n in lengths]
    out.regroup(UniGrouper())
    merged = out.data_groups[0].value
    for row, x in enumerate(xs):
        ref = module(x[None])[0]
        torch.testing.assert_close(merged[row, : len(ref)], ref, **TOL)
        assert torch.all(merged[row, len(ref) :] == 0)  # padding, not stale group outputs

    class Undeclared(StridedConv):
        def get_output_lengths(self):
            return {}

    with pytest.raises(AnnotationError, match="get_output_lengths"):
        dc.apply(Undeclared())


def test_groups_as_data_nests_and_groups_again() -> None:
    xs = items_1d([1, 2, 3, 4, 5, 6], dim=2)
    dc = DataCollection("(B, L_seq, M_f)", xs)
    dc.group(PredefinedConsecutiveGrouper([2, 3, 1]))
    nested = dc.groups_as_data(0, "member")
    assert len(nested) == 3
    assert nested.lengths["member"].tolist() == [2, 3, 1]
    assert nested.lengths["seq"].tolist() == [2, 5, 6]
    nested.group(LengthThresholdGrouper("member", [1]))
    assert [len(p) for p in nested.data_partition] == [1, 2]
    nested.ungroup()
    torch.testing.assert_close(nested.data_list[0].value[1, :2], xs[1])
    masks = dc.masks_as_data(0, "member")
    assert masks.data_list[1].value.dtype == torch.bool
    assert masks.data_list[1].value[:, :, 0].sum(1).tolist() == [3, 4, 5]


def test_keys_device_moves_pickling_and_compatibility() -> None:
    data = [{"x": torch.randn(n, 2), "y": torch.randn(n)} for n in (2, 4, 3)]
    dc = DataCollection({"x": "(B, L_s, M_f)", "y": "(B, L_s)"}, data)
    dc.group(LengthThresholdGrouper("s", [2]))
    moved = pickle.loads(pickle.dumps(dc.to("cpu")))
    assert moved.data_partition == dc.data_partition
    sub = moved["y"]
    assert sub.length_info == dc.length_info
    moved["z"] = sub
    assert torch.equal(moved.data_groups[1]["z"].value, dc.data_groups[1]["y"].value)
    other = DataCollection({"x": "(B, L_s, M_f)", "y": "(B, L_s)"}, data)
    other.group(UniGrouper())
    with pytest.raises(IncompatibleDataCollectionError):
        moved["w"] = other["y"]
    both = DataCollection.from_dict({"a": dc["x"], "b": dc["y"]})
    both.ungroup()
    torch.testing.assert_close(both.data_list[1]["b"].value, data[1]["y"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip() -> None:
    xs = items_1d([2, 5, 1])
    dc = DataCollection("(B, L_seq, M_in)", xs).to("cuda")
    dc.group(LengthThresholdGrouper("seq", [2]))
    out = dc.apply(MaskedMeanPool().cuda())["pooled"]
    out.regroup(UniGrouper())
    assert out.data_groups[0].value.device.type == "cuda"


def test_from_padded_regroup_matches() -> None:
    xs = items_1d([5, 1, 3, 2])
    padded = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    dc = DataCollection.from_padded("(B, L_seq, M_in)", padded, {"seq": [5, 1, 3, 2]})
    dc.regroup(DynamicGrouper("seq", overhead=0.0))
    assert len(dc.data_groups) == 4
    dc.ungroup()
    for got, x in zip(dc.data_list, xs, strict=True):
        torch.testing.assert_close(got.value, x)


def test_batchnorm_warns() -> None:
    class Normed(AnnotatedModule):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(x.sum(1))

        def get_input_annot(self):
            return "(b, l_s, m_f)"

        def get_output_annot(self):
            return "(b, m_f)"

    dc = DataCollection("(B, L_s, M_f)", items_1d([1, 2, 5, 6]))
    dc.group(LengthThresholdGrouper("s", [2]))
    with pytest.warns(UserWarning, match="batch-coupled"):
        dc.apply(Normed())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dc.apply(Normed().eval())


@pytest.mark.parametrize(
    ("annot", "match"),
    [
        ("B, L_s", "parenthesised"),
        ("(L_s)", "exactly one batch"),
        ("(B, X_s)", "cannot read dimension"),
        ("(B, L_s, L_s)", "repeats a length label"),
    ],
)
def test_bad_annotations(annot, match) -> None:
    with pytest.raises(AnnotationError, match=match):
        DataCollection(annot, [torch.zeros(2)])


def test_bad_inputs_have_clear_errors() -> None:
    with pytest.raises(ValueError, match="only L_ dims may vary"):
        DataCollection("(B, L_s, M_f)", [torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="should have 2 dims"):
        DataCollection("(B, L_s, M_f)", [torch.zeros(2)])
    with pytest.raises(ValueError, match="says 3"):
        DataCollection("(B, L_s, 3)", [torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="at least one item"):
        DataCollection("(B, L_s)", [])
    dc = DataCollection("(B, L_s, M_in)", items_1d([1, 2]))
    with pytest.raises(RuntimeError, match="group"):
        dc.apply(MaskedMeanPool())
    with pytest.raises(ValueError, match="length label"):
        dc.group(LengthThresholdGrouper("nope", [1]))
    with pytest.raises(ValueError, match="was built for 3 items"):
        dc.group(PredefinedGrouper([[0, 1, 2]]))
    dc.group(UniGrouper())
    with pytest.raises(RuntimeError, match="already grouped"):
        dc.group(UniGrouper())
    with pytest.raises(TypeError, match="AnnotatedModule"):
        dc.apply(nn.Identity())
    with pytest.raises(ValueError, match="mask_hint"):
        dc.get_mask(0, mask_hint=["missing"])
    with pytest.raises(ValueError, match="CDimPadder value has shape"):
        bad = DataCollection("(B, L_s, 3)", [torch.zeros(2, 3)], padding=CDimPadder(torch.eye(3)))
        bad.group(UniGrouper())


def test_padding_given_to_group_survives_moves_keys_and_regrouping() -> None:
    data = [{"x": torch.ones(n, 2)} for n in (1, 3, 2)]
    dc = DataCollection({"x": "(B, L_s, M_f)"}, data)
    dc.group(LengthThresholdGrouper("s", [1]), padding={"x": 5.0})
    moved = dc.to("cpu")["x"]
    moved.regroup(UniGrouper())
    full = moved.data_groups[0].value
    assert full[0, 1:].eq(5.0).all() and full[2, 2:].eq(5.0).all() and full[1].eq(1.0).all()


def test_building_a_grouped_collection_directly() -> None:
    groups = [torch.arange(6.0).reshape(2, 3), torch.arange(4.0).reshape(2, 2)]
    dc = DataCollection(
        "(B, L_s)",
        data_groups=groups,
        length_info={"s": [[3, 1], [2, 2]]},
        data_partition=[[3, 0], [1, 2]],
    )
    assert len(dc) == 4 and dc.lengths["s"].tolist() == [1, 2, 2, 3]
    dc.ungroup()
    assert [d.value.tolist() for d in dc.data_list] == [[3.0], [0.0, 1.0], [2.0, 3.0], [0, 1, 2]]
    with pytest.raises(ValueError, match="length_info"):
        DataCollection("(B, L_s)", data_groups=groups)


def test_protein_ligand_scenario_with_copies_and_abbreviated_dims() -> None:
    """Two ragged entities per item, regrouped on either length, copied under a new key."""
    annot = {
        "protein": {"p": "(B, L_res, M_1)", "R": "(B, L_res, 3, 3)", "t": "(B, L_res, 3)"},
        "ligand": {"m": "(B, L_atm, M_2)", "t": "(B, L_atm, 3)"},
    }
    sizes = [(10, 3), (20, 6), (12, 20)]
    data = [
        {
            "protein": {"p": torch.rand(r, 8), "R": torch.rand(r, 3, 3), "t": torch.rand(r, 3)},
            "ligand": {"m": torch.rand(a, 4), "t": torch.rand(a, 3)},
        }
        for r, a in sizes
    ]
    dc = DataCollection(annot, data_list=data)
    identity = {"protein": {"R": CDimPadder(torch.eye(3))}}
    dc.group(grouper=LengthThresholdGrouper("res", [15]), padding=identity)
    assert dc.data_partition == [[0, 2], [1]]
    dc.regroup(grouper=LengthThresholdGrouper("atm", [10]))
    assert dc.data_partition == [[0, 1], [2]]
    R = dc["protein"].data_groups[0]["R"].value
    assert R.shape == (2, 20, 3, 3) and torch.equal(R[0, 10:], torch.eye(3).expand(10, 3, 3))
    dc["duplicate"] = copy.deepcopy(dc)
    other = copy.deepcopy(dc)
    other.regroup(UniGrouper())
    with pytest.raises(IncompatibleDataCollectionError):
        dc["another"] = other

    class Pairwise(AnnotatedModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 5), nn.Linear(4, 5)

        def forward(self, d):
            x1, x2 = self.a(d["objects1"]["feature"]), self.b(d["objects2"]["feature"])
            return torch.einsum("bih,bjh->bij", x1, x2)

        def get_input_annot(self):
            return {
                "objects1": {"feature": "(b, .., m_1)"},
                "objects2": {"feature": "(b, .2., m_2)"},
            }

        def get_output_annot(self):
            return "(b, .., .2.)"

    conv = {
        "protein": ("objects1", {"p": ("feature", None)}),
        "ligand": ("objects2", {"m": ("feature", None)}),
    }
    module = Pairwise()
    result = dc.apply(module, input_key_conv=conv)
    result.ungroup()
    for got, item in zip(result.data_list, data, strict=True):
        ref = module(
            {
                "objects1": {"feature": item["protein"]["p"][None]},
                "objects2": {"feature": item["ligand"]["m"][None]},
            }
        )[0]
        torch.testing.assert_close(got.value, ref, **TOL)
