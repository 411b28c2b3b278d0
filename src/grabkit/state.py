"""State declared once: ``state_dict``, ``load_state_dict`` and the key check derived from one
declaration per attribute.

A ``Stateful`` class declares, in its ``__init__``, which attributes make up its saved state::

    self.add_state("acc", None)                            # saved as is, restored as saved
    self.add_state("count", 0, load=int)                   # restored through a conversion
    self.add_state("placement", FrontBackOrder())          # a Stateful: saved and restored
                                                           # through its own declarations
    self.add_state("stepped", 0, attribute="_stepped")     # saved under another name

and, for the settings a saved state must have been written with::

    self.add_config("window", window)                      # saved, and compared on load

gets ``state_dict()`` (plain data for ``torch.save`` / ``torch.load(weights_only=True)``) and
``load_state_dict()`` (a state with unknown or missing keys is refused, naming them; a state
written with other settings is refused, naming each that differs, before anything changes; then
each attribute is restored, and ``after_load()`` rebuilds whatever is derived from them). A
subclass adds its own attributes in its own ``__init__``; the keys are the union, in declaration
order. The settings sit beside the state, or under one key (``config_key = "config"``). A key
added after states were saved is declared ``optional``: a state without it loads, with the
default. The declaration is the documentation of the checkpoint layout: nothing else lists keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Stateful", "check_state_keys", "setting_differences"]

_KEEP = object()  # add_state without a default: the attribute is set elsewhere


def setting_differences(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """Each setting that differs between a saved state and this object, as "key: saved ...,
    here ..." joined by commas ("" when none does)."""
    differing = sorted(k for k in set(mine) | set(saved) if saved.get(k) != mine.get(k))
    return ", ".join(f"{k}: saved {saved.get(k)!r}, here {mine.get(k)!r}" for k in differing)


def check_state_keys(where: str, state: Mapping[str, Any], expected: set[str]) -> None:
    """Reject a state dict whose keys differ from ``expected``, naming the difference."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: a state dict should be a dict, but got {type(state).__name__}")
    unknown, missing = set(state) - expected, expected - set(state)
    if unknown or missing:
        raise ValueError(
            f"{where}: state dict does not match this object (unexpected keys "
            f"{sorted(unknown)}, missing keys {sorted(missing)}); it was saved by one of "
            "another kind or configuration."
        )


@dataclass(frozen=True)
class _Field:
    attribute: str
    save: Callable[[Any], Any] | None
    load: Callable[[Any], Any] | None
    optional: bool = False
    default: Any = None


class Stateful:
    """An object whose saved state is declared with ``add_state`` and ``add_config`` (see the
    module docstring)."""

    _state_fields: dict[str, _Field]
    _declared_config: dict[str, Any]
    #: None: the settings sit beside the state's keys; else the key they are saved under
    config_key: str | None = None

    @property
    def state_owner(self) -> str:
        """How errors about this object's state name it."""
        return type(self).__name__

    def add_state(
        self,
        key: str,
        default: Any = _KEEP,
        *,
        attribute: str | None = None,
        save: Callable[[Any], Any] | None = None,
        load: Callable[[Any], Any] | None = None,
        optional: bool = False,
    ) -> None:
        """Declare ``key`` part of the saved state, held in ``attribute`` (default: ``key``).

        Args:
            default: the attribute's initial value (left alone when not given).
            save: value -> plain data (default: the value itself, or its ``state_dict()``).
            load: plain data -> value (default: the data itself, or the current value's
                ``load_state_dict``).
            optional: a saved state may lack the key (it was added later); the attribute then
                gets ``default`` again.
        """
        fields = self.__dict__.setdefault("_state_fields", {})
        name = key if attribute is None else attribute
        if default is not _KEEP:
            setattr(self, name, default)
        fields[key] = _Field(name, save, load, optional, None if default is _KEEP else default)

    def add_config(self, key: str, value: Any) -> None:
        """Declare a setting (plain data) that a loaded state must have been written with."""
        self.__dict__.setdefault("_declared_config", {})[key] = value

    def config(self) -> dict[str, Any]:
        """The declared settings."""
        return dict(self.__dict__.get("_declared_config", {}))

    def state_dict(self) -> dict[str, Any]:
        """The declared settings and state, key by key, as plain data."""
        fields = self.__dict__.get("_state_fields", {})
        state = {key: self._save(field) for key, field in fields.items()}
        config = self.config()
        if self.config_key is not None:
            return {self.config_key: config, **state}
        return {**config, **state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()`` of an object declared alike (else a ValueError)."""
        fields = self.__dict__.get("_state_fields", {})
        config = self.config()
        settings = {self.config_key} if self.config_key is not None else set(config)
        optional = {key for key, field in fields.items() if field.optional}
        present = set(state) if isinstance(state, Mapping) else set()
        check_state_keys(self.state_owner, state, settings | set(fields) - (optional - present))
        if self.config_key is not None:
            self.check_config(state[self.config_key])
        else:
            self.check_config({key: state[key] for key in config})
        for key, field in fields.items():
            if key in state:
                self._load(field, state[key])
            else:
                setattr(self, field.attribute, field.default)
        self.after_load()

    def check_config(self, saved: Mapping[str, Any]) -> None:
        """Refuse settings that differ from the declared ones, naming each difference."""
        detail = setting_differences(saved, self.config())
        if detail:
            raise ValueError(
                f"{self.state_owner}: the state was written with another configuration "
                f"({detail}); build it with the saved options (the same blocks and settings) "
                "to resume."
            )

    def after_load(self) -> None:
        """Rebuild what derives from the state (caches); runs after every load."""

    def _save(self, field: _Field) -> Any:
        value = getattr(self, field.attribute)
        if field.save is not None:
            return field.save(value)
        if isinstance(value, Stateful):
            return value.state_dict()
        return value

    def _load(self, field: _Field, saved: Any) -> None:
        if field.load is not None:
            setattr(self, field.attribute, field.load(saved))
            return
        current = getattr(self, field.attribute, None)
        if isinstance(current, Stateful):
            current.load_state_dict(saved)
        else:
            setattr(self, field.attribute, saved)
