"""``AnnotatedModule``: an ``nn.Module`` that states its input and output shapes.

``DataCollection.apply`` reads the annotations to know which output dims are lengths (so the
outputs can be unpadded and regrouped) and which mask, if any, ``forward`` takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from .annotation import AnnotationError, parse_annotation, resolve_output_signatures

__all__ = ["AnnotatedModule"]


class AnnotatedModule(nn.Module):
    """Base class for modules run group by group by :meth:`DataCollection.apply`.

    Override:

    * ``get_input_annot()``: module-side annotation of ``forward``'s first argument, e.g.
      ``"(b, l_seq)"`` or a nested dict of such strings;
    * ``get_output_annot()``: annotation of what ``forward`` returns, e.g. ``"(b)"``;
    * ``get_mask_hint()`` (optional): ``None`` (``forward(x)``), ``"copy"`` (``forward(x,
      mask)`` with a boolean mask shaped like each input tensor) or a list of module length
      labels such as ``["seq"]`` (``forward(x, mask)`` with one ``(b, l_seq)`` mask);
    * ``get_output_lengths()`` (optional): for outputs whose length differs from the input's
      (strided convolution, pooling), ``{module_label: fn}`` with ``fn`` mapping an int64
      tensor of input lengths to output lengths, e.g. ``lambda L: (L - 3) // 2 + 1``.
    """

    def get_input_annot(self) -> str | dict[str, Any] | None:
        return None

    def get_output_annot(self) -> str | dict[str, Any] | None:
        return None

    def get_mask_hint(self) -> str | list[str] | None:
        return None

    def get_output_lengths(self) -> dict[str, Callable[[Tensor], Tensor]]:
        return {}

    def resolve(self, data_signatures: Any) -> tuple[Any, dict[str, str]]:
        """Output signatures (data side) and the module-label -> data-label length binding."""
        name = type(self).__name__
        annot_in, annot_out = self.get_input_annot(), self.get_output_annot()
        if annot_in is None or annot_out is None:
            missing = "get_input_annot()" if annot_in is None else "get_output_annot()"
            raise AnnotationError(
                f"{name} should override {missing} to return an annotation such as '(b, l_seq)'"
            )
        module_in = parse_annotation(annot_in, "module", f"{name}.get_input_annot()")
        module_out = parse_annotation(annot_out, "module", f"{name}.get_output_annot()", True)
        return resolve_output_signatures(module_in, module_out, data_signatures)
