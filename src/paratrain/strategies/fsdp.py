"""FSDP units: which submodules ``fully_shard`` wraps on their own (the wrap policy).

Each rank keeps 1/N of every parameter, gradient and optimizer state. Before a
wrapped block runs forward (and again in backward) its parameters are
all-gathered; after backward its gradients are reduce-scattered, so each rank
updates only its shard. Blocks are wrapped one by one (the wrap policy) so that
only one block is ever unsharded at a time, then the root is wrapped. The layout
strategy applies it over the data axes of its mesh
(:func:`paratrain.strategies.layout.apply.apply_fsdp`); ``fsdp`` is the preset that
shards over every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def wrap_predicate(policy: Any, root: nn.Module) -> Callable[[nn.Module], bool]:
    """The wrap policy as a predicate over submodules (the root is handled separately)."""
    if policy is None and _no_split_classes(root):
        return _per_block(root)
    if policy is None:
        blocks = set()
        for child in root.children():
            members = child.children() if isinstance(child, _CONTAINERS) else [child]
            blocks.update(id(m) for m in members if any(True for _ in m.parameters()))
        return lambda module: id(module) in blocks
    if isinstance(policy, (str, type)):
        policy = (policy,)
    if isinstance(policy, (tuple, list)):
        classes = tuple(p for p in policy if isinstance(p, type))
        names = {p for p in policy if isinstance(p, str)}
        return lambda module: isinstance(module, classes) or type(module).__name__ in names
    return policy


def _no_split_classes(root: nn.Module) -> frozenset[str]:
    # A Hugging Face model names the classes that must stay whole on one device: its
    # blocks (LlamaDecoderLayer, GPTNeoXLayer, ...).
    names = getattr(type(root), "_no_split_modules", None)
    if not isinstance(names, (list, tuple, set)):
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str))


def _per_block(root: nn.Module) -> Callable[[nn.Module], bool]:
    """Units for a Hugging Face model: each block its own (the classes of its
    ``_no_split_modules``), and the input embedding and output layer each their own, so
    the forward gathers one block at a time, never the base model whole. Tied ones stay
    with the unit around them (``shard_units`` checks)."""
    classes = _no_split_classes(root)
    units = {id(m) for m in root.modules() if m is not root and type(m).__name__ in classes}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            layer = getattr(root, getter)() if hasattr(root, getter) else None
        except (AttributeError, NotImplementedError):
            layer = None
        if isinstance(layer, nn.Module) and any(True for _ in layer.parameters()):
            units.add(id(layer))
    return lambda module: id(module) in units
