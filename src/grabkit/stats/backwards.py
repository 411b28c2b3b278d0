"""Which backwards belong to a step: those that accumulate into the parameters' ``.grad``.

Several autograd graph tasks may run over one forward: ``loss.backward()``, but also
``torch.autograd.grad(loss, x)`` for an input gradient (saliency, FGSM), a
``torch.autograd.grad(loss, params)`` look-ahead, a ``create_graph=True`` input-gradient
penalty. Each fires the layers' output-gradient hooks; only those that accumulate into
``.grad`` (fire a parameter's ``AccumulateGrad`` node) are the step's backwards. ``Backwards``
notes, per graph task (``torch._C._current_graph_task_id()``), which parameters it accumulated
into and whether its hooks ran with grad mode on (a ``create_graph`` backward), and keeps of a
layer call's output gradients only those of tasks that accumulated into that layer's
parameters (``kept``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["Backwards", "GradientsByTask"]

#: task id -> an output's gradient (or, for a layer with several tracked outputs, a list per slot)
GradientsByTask = dict[int, "torch.Tensor | list[torch.Tensor | None]"]


class Backwards:
    """The graph tasks seen in one step (see module docstring)."""

    def __init__(self) -> None:
        #: task -> parameters it accumulated into (filled by the parameters' AccumulateGrad
        #: pre-hooks, ``PerSampleStats._on_param_grad``)
        self.accumulated: dict[int, set[str]] = {}
        self.with_graph: set[int] = set()  # tasks whose hooks ran with grad mode on

    def output_gradient(self) -> int:
        """Note an output-gradient hook of the current task; return the task (the id of the
        autograd graph task running now)."""
        task = torch._C._current_graph_task_id()
        if torch.is_grad_enabled():
            self.with_graph.add(task)
        return task

    def double_backward(self) -> bool:
        """Whether a ``create_graph=True`` task that accumulated nothing (an
        ``autograd.grad(..., create_graph=True)``: its graph may feed the loss) ran beside an
        accumulating one."""
        return bool(self.accumulated) and any(t not in self.accumulated for t in self.with_graph)

    def kept(
        self, params: Mapping[str, str], grads: GradientsByTask, every: frozenset[str]
    ) -> list[tuple[frozenset[str], torch.Tensor | list]]:
        """A call's output gradients from the tasks that accumulated into the layer's parameters
        (``params``: local name -> full name; ``every``: all the local names), summed per set
        of such local names."""
        if len(grads) == 1:  # the usual step: one backward, into every parameter
            for task, grad in grads.items():
                names = self.accumulated.get(task)
                if names is not None and names.issuperset(params.values()):
                    return [(every, grad)]
        groups: dict[frozenset[str], torch.Tensor | list] = {}
        for task, grad in grads.items():
            names = self.accumulated.get(task)
            if not names:
                continue
            wanted = frozenset(local for local, full in params.items() if full in names)
            if not wanted:
                continue
            previous = groups.get(wanted)
            groups[wanted] = grad if previous is None else _added(previous, grad)
        return list(groups.items())


def _added(first: torch.Tensor | list, second: torch.Tensor | list) -> torch.Tensor | list:
    if isinstance(first, torch.Tensor):
        return first + second
    return [
        a if b is None else b if a is None else a + b for a, b in zip(first, second, strict=True)
    ]
