"""``grabkit.state.Stateful``: state declared once, state_dict / load_state_dict derived."""

from __future__ import annotations

import io

import pytest
import torch

from grabkit.state import Stateful


class Counter(Stateful):
    def __init__(self) -> None:
        self.add_state("count", 0, load=int)
        self.add_state("total", None)


class Walker(Stateful):
    def __init__(self) -> None:
        self.loads = 0
        self.add_state("steps", 0, attribute="_steps")
        self.add_state("counter", Counter())
        self.add_state("seen", [], save=lambda items: torch.tensor(items), load=list)

    def after_load(self) -> None:
        self.loads += 1


class LongWalker(Walker):
    def __init__(self) -> None:
        super().__init__()
        self.add_state("extra", 1.5, load=float)


def test_state_dict_follows_the_declarations_in_order_and_round_trips():
    walker = LongWalker()
    walker._steps, walker.counter.count, walker.counter.total = 3, 2, torch.ones(2)
    walker.seen, walker.extra = [4, 5], 2.5
    state = walker.state_dict()
    assert list(state) == ["steps", "counter", "seen", "extra"]
    assert state["counter"] == {"count": 2, "total": walker.counter.total}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    other = LongWalker()
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert (other._steps, other.counter.count, other.seen, other.extra) == (3, 2, [4, 5], 2.5)
    assert isinstance(other.seen, list) and other.loads == 1
    torch.testing.assert_close(other.counter.total, torch.ones(2))


def test_a_state_of_another_layout_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\], missing keys \[\]"):
        Walker().load_state_dict(LongWalker().state_dict())
    with pytest.raises(ValueError, match=r"missing keys \['extra'\]"):
        LongWalker().load_state_dict(Walker().state_dict())
    with pytest.raises(TypeError, match="should be a dict"):
        Walker().load_state_dict([1, 2])


class Averager(Stateful):
    config_key = None

    def __init__(self, rate: float, window: str = "steps") -> None:
        self.add_config("rate", rate)
        self.add_config("window", window)
        self.add_state("value", 0.0, load=float)
        self.add_state("later", [], optional=True)  # a key states of an older layout lack


def test_settings_sit_beside_the_state_and_another_setting_is_refused_before_any_change():
    saved = Averager(0.1)
    saved.value = 3.0
    state = saved.state_dict()
    assert state == {"rate": 0.1, "window": "steps", "value": 3.0, "later": []}
    other = Averager(0.2, window="examples")
    with pytest.raises(ValueError, match=r"rate: saved 0\.1, here 0\.2, window: saved .steps."):
        other.load_state_dict(state)
    assert other.value == 0.0  # nothing changed
    older = {k: v for k, v in state.items() if k != "later"}
    resumed = Averager(0.1)
    resumed.later = [1]
    resumed.load_state_dict(older)
    assert (resumed.value, resumed.later) == (3.0, [])


def test_settings_under_one_key():
    class Nested(Averager):
        config_key = "config"

    state = Nested(0.1).state_dict()
    assert state["config"] == {"rate": 0.1, "window": "steps"} and "rate" not in state
    with pytest.raises(ValueError, match=r"rate: saved 0\.1, here 0\.3"):
        Nested(0.3).load_state_dict(state)
