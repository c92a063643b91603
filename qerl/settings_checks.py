"""Checks shared by the settings dataclasses (``model.lora``, ``model.loss``, ``model.optimizer``,
``model.eval``, the rollout's ``sampling``): a bad YAML value fails at start, naming its key."""

from __future__ import annotations

import dataclasses
import numbers
import typing


def require_numbers(settings, section: str) -> None:
    """Every field annotated ``int`` or ``float`` (not optional) holds one: ``lr: null`` or ``rank: ~``
    reach the dataclass from the CLI as None, and the range checks after this one would fail with a
    ``TypeError`` naming no key. Booleans are not numbers here; an ``int`` field takes integers only."""
    hints = typing.get_type_hints(type(settings))
    for f in dataclasses.fields(settings):
        kind, value = hints.get(f.name), getattr(settings, f.name)
        if kind is int:
            ok, what = isinstance(value, numbers.Integral), "an integer"
        elif kind is float:
            ok, what = isinstance(value, numbers.Real), "a number"
        else:
            continue
        if not ok or isinstance(value, bool):
            raise ValueError(f"{section}.{f.name} must be {what}, got {'null' if value is None else repr(value)}")
