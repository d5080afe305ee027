"""Every composed layout of degrees, run by one strategy: the degrees resolved once, one
mesh, one function that applies the parallelisms in one order (:mod:`.apply`), presets
that expand to layouts (:mod:`.presets`)."""

from paratrain.strategies.layout.strategy import LayoutStrategy

__all__ = ["LayoutStrategy"]
