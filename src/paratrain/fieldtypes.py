"""Checking configuration values against their dataclass annotations, in one line each.

``RunConfig`` and the strategies' ``Options`` dataclasses declare every field's type. A
value of another type fails far from its cause with a traceback (``timeout_s="300"``,
``{"bucket_cap_mb": "50"}``), or worse, runs with another meaning (``progress="no"`` is
true). :func:`check_types` compares each value with its annotation first and raises a
``ValueError`` naming the field and the expected type; ranges and choices stay with
each class's own checks.

``bool`` is not an integer or a number here (``accumulate=True`` is a mistake, not 1),
and numbers must be finite unless a field says otherwise (an infinite timeout
overflows, an infinite peak FLOP/s reports an MFU of 0).

Example::

    >>> from paratrain.config import RunConfig
    >>> check_types(RunConfig, {"seed": "42"})
    Traceback (most recent call last):
    ...
    ValueError: seed must be an integer, got '42' (str)
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import numbers
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["check_types", "describe", "field_types", "from_fields"]

_NONE = type(None)
_PLURAL = {bool: "True/False values", int: "integers", float: "numbers", str: "strings"}


def from_fields(cls: type, values: Mapping[str, Any], *, name: str) -> Any:
    """``cls(**values)`` for an options dataclass, refusing unknown keys in one line that
    names the option (``name``) and lists the known fields."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}; known: {', '.join(known)}")
    return cls(**values)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``cls``'s fields and their evaluated annotations (``from __future__`` strings)."""
    return typing.get_type_hints(cls)


def check_types(cls: type, values: Mapping[str, Any], *,
                label: Callable[[str], str] = str, infinite_ok: Collection[str] = ()) -> None:
    """ValueError for the first value in ``values`` whose type its field of ``cls`` refuses.

    ``label(name)`` is how the message names the field; fields in ``infinite_ok`` accept
    ``inf`` (never NaN). Names that are not fields of ``cls`` are left to the caller.
    """
    hints = field_types(cls)
    for name, value in values.items():
        if name not in hints:
            continue
        finite = name not in infinite_ok
        if not _matches(value, hints[name], finite):
            raise ValueError(f"{label(name)} must be {describe(hints[name], finite)}, "
                             f"got {value!r} ({type(value).__name__})")


def describe(annotation: Any, finite: bool = True) -> str:
    """``annotation`` in words, e.g. ``int | None`` -> "an integer or None"."""
    if annotation is Any:
        return "anything"
    if annotation is None or annotation is _NONE:
        return "None"
    if _is_union(annotation):
        words = [describe(a, finite) for a in typing.get_args(annotation)]
        return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (tuple, list):
        item = args[0] if args else Any
        return f"a tuple or list of {_PLURAL.get(item, describe(item, finite) + ' items')}"
    if origin in (dict, collections.abc.Mapping):
        keys = args[0] if args else Any
        return "a dict" if keys is Any else f"a dict keyed by {_PLURAL.get(keys, str(keys))}"
    if origin is collections.abc.Callable or annotation is collections.abc.Callable:
        return "a callable"
    simple = {bool: "True or False", int: "an integer", str: "a string",
              float: "a finite number" if finite else "a number"}
    if annotation in simple:
        return simple[annotation]
    if isinstance(annotation, type):
        return "a path" if annotation.__name__ == "PathLike" else f"a {annotation.__name__}"
    return str(annotation)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _matches(value: Any, annotation: Any, finite: bool) -> bool:
    if annotation is Any:
        return True
    if annotation is None or annotation is _NONE:
        return value is None
    if _is_union(annotation):
        return any(_matches(value, a, finite) for a in typing.get_args(annotation))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        return math.isfinite(value) or (not finite and not math.isnan(value))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(
                _matches(v, a, finite) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0], finite) for v in value)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            return False
        key, item = args if args else (Any, Any)
        return all(_matches(k, key, finite) and _matches(v, item, finite)
                   for k, v in value.items())
    if origin is collections.abc.Callable or annotation is collections.abc.Callable:
        return callable(value)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # a construct these checks do not model: left to the class's own checks
