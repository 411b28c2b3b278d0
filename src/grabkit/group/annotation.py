"""Shape annotations: the grammar that names what each tensor dimension means.

Data side (``DataCollection``), one string per tensor, nested dicts for structured items::

    (B, L_<label>, M_<label>, <int>)

``B`` is the batch dimension (exactly one), ``L_x`` a length dimension that varies from item to
item (items sharing a label share the length), ``M_x`` a model dimension (same size for every
item), and an integer a constant dimension of that size.

Module side (``AnnotatedModule``), the same with lower case and one more atom::

    (b, l_<x>, m_<x>, <int>, .<x>.)

``.x.`` (``..`` when unnamed) abbreviates any run of dimensions; it is bound while matching the
module's input annotation against the data and reproduced in the output annotation. Module labels
are local names: matching binds ``l_x`` to whatever data label sits in that position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AnnotationError",
    "Dim",
    "KeyConversion",
    "Signature",
    "SignatureTree",
    "convert_keys",
    "iter_leaves",
    "map_tree",
    "parse_annotation",
    "parse_signature",
    "resolve_output_signatures",
    "tree_get",
]

BATCH, LENGTH, MODEL, CONST, ABBREV = "batch", "length", "model", "const", "abbrev"


class AnnotationError(ValueError):
    """A shape annotation is malformed or does not match the data it describes."""


@dataclass(frozen=True)
class Dim:
    """One annotated dimension: its kind, its label (length/model/abbrev) or size (const)."""

    kind: str
    label: str = ""
    size: int = 0

    def render(self, side: str) -> str:
        if self.kind == CONST:
            return str(self.size)
        if self.kind == ABBREV:
            return f".{self.label}."
        upper = side == "data"
        if self.kind == BATCH:
            return "B" if upper else "b"
        prefix = {LENGTH: "L", MODEL: "M"}[self.kind]
        return f"{prefix if upper else prefix.lower()}_{self.label}"


@dataclass(frozen=True)
class Signature:
    """A parsed annotation of one tensor; ``side`` is ``"data"`` or ``"module"``."""

    dims: tuple[Dim, ...]
    side: str = "data"

    def __len__(self) -> int:
        return len(self.dims)

    def __str__(self) -> str:
        return "(" + ", ".join(d.render(self.side) for d in self.dims) + ")"

    @property
    def batch_index(self) -> int:
        """Position of the batch dimension."""
        return next(i for i, d in enumerate(self.dims) if d.kind == BATCH)

    def length_dims(self) -> list[tuple[int, str]]:
        """``(position, label)`` of every length dimension, in order."""
        return [(i, d.label) for i, d in enumerate(self.dims) if d.kind == LENGTH]

    def item_dims(self) -> tuple[Dim, ...]:
        """The dimensions of one item: the signature without its batch dimension."""
        return tuple(d for d in self.dims if d.kind != BATCH)


SignatureTree = Signature | dict[str, Any]
KeyConversion = Mapping[str, tuple[str, "KeyConversion | None"]]


def _parse_atom(atom: str, side: str, text: str, where: str) -> Dim:
    batch, length, model = ("B", "L_", "M_") if side == "data" else ("b", "l_", "m_")
    if atom == batch:
        return Dim(BATCH)
    if atom.isdigit():
        return Dim(CONST, size=int(atom))
    if atom.startswith(length) and len(atom) > 2:
        return Dim(LENGTH, label=atom[2:])
    if atom.startswith(model) and len(atom) > 2:
        return Dim(MODEL, label=atom[2:])
    if side == "module" and len(atom) >= 2 and atom[0] == "." and atom[-1] == ".":
        return Dim(ABBREV, label=atom[1:-1])
    grammar = (
        "B, L_<label>, M_<label>, <int>" if side == "data" else "b, l_<x>, m_<x>, <int>, .<x>."
    )
    raise AnnotationError(
        f"{where}: cannot read dimension {atom!r} in {text!r}; a {side}-side annotation is a "
        f"parenthesised, comma-separated list of {grammar}"
    )


def parse_signature(
    text: str, side: str = "data", where: str = "annotation", output: bool = False
) -> Signature:
    """Parse one annotation string such as ``"(B, L_seq, M_hidden)"``.

    ``side`` selects the grammar (``"data"`` or ``"module"``); ``where`` names the annotation in
    error messages; a module's ``output`` annotation may repeat several bound abbreviations.
    """
    if not isinstance(text, str):
        raise TypeError(f"{where} should be a string or a dict of them, but got {type(text)!r}")
    stripped = text.strip()
    if len(stripped) < 2 or stripped[0] != "(" or stripped[-1] != ")":
        raise AnnotationError(f"{where} should be parenthesised like '(B, L_seq)', got {text!r}")
    body = stripped[1:-1].strip()
    atoms = [a.strip() for a in body.split(",")] if body else []
    dims = tuple(_parse_atom(a, side, text, where) for a in atoms)
    _check_dims(dims, side, text, where, output)
    return Signature(dims, side)


def _check_dims(dims: tuple[Dim, ...], side: str, text: str, where: str, output: bool) -> None:
    """One batch dim, at most one abbreviation (outside outputs), no repeated length label."""
    batch_count = sum(d.kind == BATCH for d in dims)
    if batch_count != 1:
        name = "B" if side == "data" else "b"
        raise AnnotationError(
            f"{where} should have exactly one batch dimension {name!r}, but {text!r} has "
            f"{batch_count}"
        )
    if not output and sum(d.kind == ABBREV for d in dims) > 1:
        raise AnnotationError(f"{where} may hold at most one abbreviation '.x.', got {text!r}")
    labels = [d.label for d in dims if d.kind == LENGTH]
    if len(labels) != len(set(labels)):
        raise AnnotationError(f"{where} repeats a length label in {text!r}")


def parse_annotation(
    annotation: Any, side: str = "data", where: str = "annotation", output: bool = False
) -> Any:
    """Parse a string or a nested dict of strings into a tree of :class:`Signature`."""
    if isinstance(annotation, Signature):
        return annotation
    if isinstance(annotation, Mapping):
        if not annotation:
            raise AnnotationError(f"{where} is an empty dict; give at least one annotated key")
        return {str(k): parse_annotation(v, side, f"{where}[{k!r}]") for k, v in annotation.items()}
    return parse_signature(annotation, side, where, output)


def iter_leaves(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield ``(path, leaf)`` for every non-dict leaf, in insertion order."""
    if isinstance(tree, Mapping):
        for key, sub in tree.items():
            yield from iter_leaves(sub, (*path, key))
    else:
        yield path, tree


def map_tree(fn: Callable[..., Any], tree: Any, *others: Any) -> Any:
    """Apply ``fn(leaf, *other_leaves)`` over trees that share ``tree``'s dict structure."""
    if isinstance(tree, Mapping):
        return {k: map_tree(fn, v, *(o[k] for o in others)) for k, v in tree.items()}
    return fn(tree, *others)


def tree_get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def convert_keys(tree: Any, conversion: KeyConversion | None) -> Any:
    """Rename dict keys: ``{old: (new, sub_conversion_or_None)}``; other keys are kept as is."""
    if conversion is None or not isinstance(tree, Mapping):
        return tree
    out = {}
    for key, value in tree.items():
        if key in conversion:
            new_key, sub = conversion[key]
            out[new_key] = convert_keys(value, sub)
        else:
            out[key] = value
    return out


def _zip_module_leaves(module_tree: Any, data_tree: Any, path: tuple[str, ...] = ()):
    if isinstance(module_tree, Mapping):
        for key, sub in module_tree.items():
            if not isinstance(data_tree, Mapping) or key not in data_tree:
                raise AnnotationError(
                    f"the module's input annotation expects key {'/'.join((*path, key))!r}, "
                    f"which the data does not have; rename keys with input_key_conv"
                )
            yield from _zip_module_leaves(sub, data_tree[key], (*path, key))
    else:
        if isinstance(data_tree, Mapping):
            raise AnnotationError(
                f"the module expects a tensor at {'/'.join(path) or 'the root'!r}, but the data "
                "holds a dict there"
            )
        yield path, module_tree, data_tree


def resolve_output_signatures(
    module_input: Any, module_output: Any, data_input: Any
) -> tuple[Any, dict[str, str]]:
    """Bind the module's input annotation to the data, then write its output on the data side.

    Returns the output signature tree (data side) and the binding of module length labels to
    data length labels (used to translate a module's ``mask_hint``).
    """
    lengths: dict[str, str] = {}
    models: dict[str, str] = {}
    abbrevs: dict[str, tuple[Dim, ...]] = {}

    def bind(path: tuple[str, ...], pre: Signature, sig: Signature) -> None:
        where = f"input {'/'.join(path) or '(root)'}: module {pre} vs data {sig}"
        has_abbrev = any(d.kind == ABBREV for d in pre.dims)
        span = len(sig) - len(pre) + 1 if has_abbrev else 0
        if (has_abbrev and span < 0) or (not has_abbrev and len(sig) != len(pre)):
            raise AnnotationError(f"{where}: different number of dimensions")
        j = 0
        for d in pre.dims:
            if d.kind == ABBREV:
                bound = sig.dims[j : j + span]
                if abbrevs.setdefault(d.label, bound) != bound:
                    raise AnnotationError(f"{where}: '.{d.label}.' was bound differently before")
                j += span
                continue
            got = sig.dims[j]
            j += 1
            if d.kind != got.kind:
                raise AnnotationError(f"{where}: {d.render('module')} faces {got.render('data')}")
            if d.kind == CONST and d.size != got.size:
                raise AnnotationError(f"{where}: constant {d.size} faces {got.size}")
            table = lengths if d.kind == LENGTH else models if d.kind == MODEL else None
            if table is not None and table.setdefault(d.label, got.label) != got.label:
                raise AnnotationError(
                    f"{where}: {d.render('module')} was bound to {table[d.label]!r} before"
                )

    for path, pre, sig in _zip_module_leaves(module_input, data_input):
        bind(path, pre, sig)

    def convert(pre: Signature) -> Signature:
        dims: list[Dim] = []
        for d in pre.dims:
            if d.kind == ABBREV:
                if d.label not in abbrevs:
                    raise AnnotationError(
                        f"output {pre}: '.{d.label}.' does not appear in the input annotation"
                    )
                dims.extend(abbrevs[d.label])
            elif d.kind == LENGTH:
                if d.label not in lengths:
                    raise AnnotationError(
                        f"output {pre}: length 'l_{d.label}' does not appear in the input "
                        "annotation; an output length must come from an input length"
                    )
                dims.append(Dim(LENGTH, lengths[d.label]))
            elif d.kind == MODEL:
                dims.append(Dim(MODEL, models.get(d.label, d.label)))
            else:
                dims.append(d)
        labels = [d.label for d in dims if d.kind == LENGTH]
        if len(labels) != len(set(labels)):
            raise AnnotationError(f"output {pre} repeats a data length label: {labels}")
        return Signature(tuple(dims), "data")

    return map_tree(convert, module_output), lengths
