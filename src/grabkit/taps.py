"""Gradient taps: see each backward's gradient of a parameter before autograd accumulates it.

A tensor hook on a leaf runs with the gradient one backward is about to add to ``.grad``: with
gradient accumulation that is the microbatch's own increment, and under
``DistributedDataParallel`` it is the rank's local gradient, before DDP averages it (DDP reduces
after accumulation). So for plain parameters a tap is ``p.register_hook``.

Under ``fully_shard`` (FSDP2) the parameters are sharded ``DTensor``\\ s that the forward never
uses: before each forward FSDP all-gathers an unsharded parameter, puts it on the module in
place of the shard and differentiates through it, then reduce-scatters its gradient into the
shard's ``.grad``. Hooks on the shard never run. The tap then goes on the tensor that the module
actually computes with: a forward pre-hook on the parameter's owning module (registered after
FSDP's, so it runs once FSDP has swapped the unsharded parameter in) hooks that tensor, once per
tensor object (FSDP keeps the same unsharded parameter from step to step). Its gradient is the
rank's local gradient of the whole parameter, before the reduce-scatter.

A tensor hook also runs in ``torch.autograd.grad`` over the parameter, which accumulates
nothing (SAM's ascent direction, a look-ahead). Given ``commit``, a plain parameter's tap keeps
what ``fn`` made of the gradient (a squared norm, not the gradient: holding the gradient would
make autograd copy it rather than adopt it as ``.grad``) and hands it to ``commit`` from a hook
that runs only once autograd has accumulated into ``.grad``; a pass that accumulates nothing
is then never committed. FSDP's unsharded tensors are no leaves, so their taps commit at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from grabkit.sharding import is_sharded

__all__ = ["GradientTaps"]

TapFn = Callable[[int, torch.Tensor], Any]
CommitFn = Callable[[int, Any], None]


class GradientTaps:
    """Call ``fn(index, grad)`` with every backward's gradient of ``named[index]``'s parameter.

    Args:
        named: ``(name, parameter)`` pairs; for sharded (``DTensor``) parameters the names must
            be those of ``module.named_parameters()``.
        fn: called inside backward, before the gradient is accumulated.
        module: the module owning the parameters; required when they are sharded.
        commit: given, ``commit(index, fn(index, grad))`` runs once the backward accumulated
            the gradient into ``.grad`` (see module): passes that accumulate nothing
            (``torch.autograd.grad``) are left out.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        fn: TapFn,
        module: nn.Module | None = None,
        *,
        commit: CommitFn | None = None,
    ) -> None:
        self._fn = fn if commit is None else lambda index, grad: commit(index, fn(index, grad))
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # unsharded tensor -> its hook, by identity; weak: a tensor FSDP drops takes its hook
        self._tapped = WeakIdKeyDictionary()
        self._pending: dict[int, Any] = {}  # index -> fn's value of the pass not yet accumulated
        plain = [(i, p) for i, (_, p) in enumerate(named) if not is_sharded(p)]
        for index, p in plain:
            if commit is None:
                self._handles.append(p.register_hook(self._bind(index)))
                continue
            self._handles.append(p.register_hook(self._hold(index, fn)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._commit(index, commit)))
        sharded = [(i, name) for i, (name, p) in enumerate(named) if is_sharded(p)]
        if sharded:
            if module is None:
                raise ValueError(
                    "sharded (fully_shard) parameters are differentiated through unsharded "
                    "copies made in each forward; pass the module, not its parameters, so that "
                    "the copies can be found"
                )
            self._tap_owners(module, sharded)

    def _bind(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._fn(index, grad)

        return hook

    def _hold(self, index: int, fn: TapFn) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._pending[index] = fn(index, grad)  # replaces a pass that accumulated nothing

        return hook

    def _commit(self, index: int, commit: CommitFn) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if index in self._pending:
                commit(index, self._pending.pop(index))

        return hook

    def _tap_owners(self, module: nn.Module, sharded: list[tuple[int, str]]) -> None:
        owners: dict[str, list[tuple[int, str]]] = {}
        for index, name in sharded:
            owner, _, attr = name.rpartition(".")
            owners.setdefault(owner, []).append((index, attr))
        for owner_name, attrs in owners.items():
            owner = module.get_submodule(owner_name)
            self._handles.append(owner.register_forward_pre_hook(self._owner_hook(attrs)))

    def _owner_hook(self, attrs: list[tuple[int, str]]) -> Callable[..., None]:
        def pre_forward(owner: nn.Module, _args: object) -> None:
            for index, attr in attrs:
                tensor = getattr(owner, attr)
                if is_sharded(tensor) or not tensor.requires_grad or tensor in self._tapped:
                    continue  # not unsharded (FSDP did not gather it), frozen, or already tapped
                self._tapped[tensor] = tensor.register_hook(self._bind(index))

        return pre_forward

    def remove(self) -> None:
        """Detach every hook."""
        for handle in self._handles:
            handle.remove()
        for handle in list(self._tapped.values()):
            handle.remove()  # type: ignore[attr-defined]
        self._handles = []
        self._tapped = WeakIdKeyDictionary()
