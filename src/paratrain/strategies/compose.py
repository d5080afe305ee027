"""Build a strategy from others: forward chosen contract members to an inner strategy.

A composite (``hybrid``) lists every contract member it does not implement itself
and forwards exactly those, so that no member silently falls back to the base
class's single-process default.
"""

from __future__ import annotations

import abc
import inspect
import operator
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def delegate(attribute: str, members: Iterable[str]) -> Callable[[T], T]:
    """Class decorator: each of ``members`` forwards to ``self.<attribute>``.

    Properties stay properties; methods keep their name and gain a docstring that
    says where they go.

    Example:
        >>> @delegate("inner", ["setup_model", "data_parallel_size"])  # doctest: +SKIP
        ... class Composite(Strategy): ...
    """
    members = tuple(members)

    def decorate(cls: T) -> T:
        for name in members:
            if name in vars(cls):
                raise TypeError(f"{cls.__name__}.{name} is implemented and also delegated")
            declared = inspect.getattr_static(cls, name)
            target = operator.attrgetter(f"{attribute}.{name}")
            if isinstance(declared, property):
                forward: Any = property(target, doc=f"``self.{attribute}.{name}``.")
            else:
                forward = _method(target, name, f"``self.{attribute}.{name}(...)``.")
                forward.__qualname__ = f"{cls.__qualname__}.{name}"
            setattr(cls, name, forward)
        # The forwards implement abstract capability methods declared before them.
        abc.update_abstractmethods(cls)
        return cls

    return decorate


def _method(target: Callable[[Any], Any], name: str, doc: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return target(self)(*args, **kwargs)

    forward.__name__ = name
    forward.__doc__ = doc
    return forward
