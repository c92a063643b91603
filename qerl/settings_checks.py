"""Checks shared by the settings dataclasses (``model.lora``, ``model.loss``, ``model.optimizer``,
``model.eval``, the rollout's ``sampling``) and the data module's counts (``data.*``): a bad YAML value
fails at start, naming its key."""

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


def require_counts(section: str, counts) -> None:
    """Each ``(key, value, least, null)`` of ``counts`` holds an integer >= ``least`` (not a bool), or
    None where ``null`` says what None means; otherwise a ValueError naming ``<section>.<key>``.
    ``not value >= least`` also refuses a NaN or a string that slipped through."""
    for key, value, least, null in counts:
        if value is None and null is not None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not value >= least:
            either = f" or null ({null})" if null is not None else ""
            raise ValueError(f"{section}.{key} must be >= {least}{either}, an integer; got {value!r}")


def require_full_precision(precision) -> None:
    """``trainer.precision`` must stay 32(-true): model.dtype sets the base's dtype and LoRA trains in
    fp32 masters; a ``*-true`` precision cast those to 16-bit and rebuilt each batch (the data
    position riding on it was lost: a resume restarted the prompt stream), ``*-mixed`` autocast the
    NVFP4 path. None (unset) passes."""
    if precision is not None and str(precision) not in ("32", "32-true"):
        raise ValueError(f"trainer.precision {precision}: leave it at 32-true; model.dtype sets the base model's dtype "
                         "(bf16 | fp16 | fp32) and the LoRA weights train in fp32")
