"""The annotation grammar and the binding of module annotations to data annotations."""

from __future__ import annotations

import pytest

from grabkit.group.annotation import (
    AnnotationError,
    convert_keys,
    parse_annotation,
    parse_signature,
    resolve_output_signatures,
)

DATA = parse_annotation(
    {
        "image": "(B, L_width, L_height, 3, M_hidden1)",
        "augs": {
            "widthwise-aug": "(B, L_width, L_aug1, M_aug1dim)",
            "heightwise-aug": "(B, L_height, M_aug2dim)",
        },
    }
)
KEYS = {
    "image": ("2d-feature", None),
    "augs": ("augs", {"widthwise-aug": ("aug1", None), "heightwise-aug": ("aug2", None)}),
}


def test_round_trip_rendering() -> None:
    assert str(parse_signature(" ( B ,L_seq, M_h, 3 ) ")) == "(B, L_seq, M_h, 3)"
    sig = parse_signature("(b, l_1, .., m_x, .2.)", side="module", output=True)
    assert str(sig) == "(b, l_1, .., m_x, .2.)"
    assert parse_signature("(L_a, B, L_b)").length_dims() == [(0, "a"), (2, "b")]


def test_abbreviations_bind_and_reappear_in_the_output() -> None:
    module_in = parse_annotation(
        {"2d-feature": "(b, l_1, l_2, .., m_1)", "augs": {"aug1": "(b, l_1, l_3, .?., m_2)"}},
        "module",
    )
    module_out = parse_annotation("(b, l_1, .., l_3, .?., m_3)", "module", output=True)
    out, lengths = resolve_output_signatures(module_in, module_out, convert_keys(DATA, KEYS))
    assert str(out) == "(B, L_width, 3, L_aug1, M_3)"
    assert lengths == {"1": "width", "2": "height", "3": "aug1"}


def test_conflicting_abbreviation_is_reported() -> None:
    module_in = parse_annotation(
        {"2d-feature": "(b, l_1, l_2, .., m_1)", "augs": {"aug2": "(b, l_2, ..)"}}, "module"
    )
    module_out = parse_annotation("(b)", "module", output=True)
    with pytest.raises(AnnotationError, match="bound differently"):
        resolve_output_signatures(module_in, module_out, convert_keys(DATA, KEYS))


@pytest.mark.parametrize(
    ("module_in", "module_out", "match"),
    [
        ("(b, l_x, 3)", "(b, l_y)", "does not appear in the input"),
        ("(b, m_x, 3)", "(b)", "faces"),
        ("(b, l_x, l_y, m_z, 4)", "(b)", "different number of dimensions"),
        ({"missing": "(b, l_x)"}, "(b)", "expects key"),
        ("(b, l_x, 5)", "(b)", "constant 5 faces 3"),
    ],
)
def test_binding_errors(module_in, module_out, match) -> None:
    data = parse_annotation("(B, L_seq, 3)")
    with pytest.raises(AnnotationError, match=match):
        resolve_output_signatures(
            parse_annotation(module_in, "module"),
            parse_annotation(module_out, "module", output=True),
            data,
        )


def test_grammar_errors() -> None:
    with pytest.raises(AnnotationError, match="at most one abbreviation"):
        parse_signature("(b, .., .2.)", side="module")
    with pytest.raises(AnnotationError, match="cannot read dimension"):
        parse_signature("(b, L_x)", side="module")
    with pytest.raises(AnnotationError, match="empty dict"):
        parse_annotation({})
    with pytest.raises(TypeError, match="should be a string"):
        parse_annotation(3)
