"""Activation checkpointing: recompute chosen submodules' activations during backward.

A checkpointed module keeps only its inputs from the forward pass and runs its
forward again during backward, trading compute for memory. The recomputation
uses non-reentrant ``torch.utils.checkpoint``, which restores the RNG state
(dropout draws the same mask) and the autocast state, so gradients are the
same as without checkpointing.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> wrapped = apply_activation_checkpointing(model, nn.Linear)
    >>> [name for name, _ in wrapped]
    ['0', '2']
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

CheckpointSpec = type | str | Callable[[nn.Module], bool] | Sequence[type | str] | None
"""What to checkpoint: a module class, a name, a predicate ``fn(module) -> bool``,
or a list of classes and names. A name matches a submodule whose class is called
that (``"TransformerEncoderLayer"``) or whose dotted path matches it as a glob
(``"layers.*"``, ``"encoder.layers.3"``)."""

_MARK = "_paratrain_checkpointed"


def validate_spec(spec: Any) -> None:
    """ValueError naming ``checkpoint_activations`` when ``spec`` is not a valid choice."""
    if spec is None or isinstance(spec, (type, str)) or callable(spec):
        if isinstance(spec, str) and not spec:
            raise ValueError("checkpoint_activations must not be an empty name")
        return
    if isinstance(spec, (list, tuple, set, frozenset)) and spec:
        bad = [item for item in spec if not isinstance(item, (type, str))]
        if not bad:
            return
        raise ValueError(
            f"checkpoint_activations list items must be module classes or names, got {bad[0]!r}"
        )
    raise ValueError(
        "checkpoint_activations must be a module class, a name, a predicate "
        f"fn(module) -> bool, or a non-empty list of classes and names; got {spec!r}"
    )


def _matcher(spec: CheckpointSpec) -> Callable[[str, nn.Module], bool]:
    validate_spec(spec)
    if spec is None:
        return lambda name, module: False
    if callable(spec) and not isinstance(spec, type):
        return lambda name, module: bool(spec(module))
    items = [spec] if isinstance(spec, (type, str)) else list(spec)
    classes = tuple(item for item in items if isinstance(item, type))
    names = [item for item in items if isinstance(item, str)]

    def matches(name: str, module: nn.Module) -> bool:
        if classes and isinstance(module, classes):
            return True
        return any(type(module).__name__ == pattern or (name and fnmatch.fnmatchcase(name, pattern))
                   for pattern in names)

    return matches


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module`` recompute its activations in backward; returns it (patched in place).

    The forward is replaced on the instance rather than wrapping the module, so
    parameter names and state-dict keys stay the same and checkpoints written
    with and without activation checkpointing are interchangeable.
    """
    if getattr(module, _MARK, False):
        return module
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not module.training:
            return original(*args, **kwargs)  # nothing to save for backward in eval
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    setattr(module, _MARK, True)
    return module


def apply_activation_checkpointing(model: nn.Module,
                                   spec: CheckpointSpec) -> list[tuple[str, nn.Module]]:
    """Checkpoint every submodule of ``model`` that ``spec`` selects; return ``(name, module)``.

    Submodules inside an already selected module are left alone: the outer
    recomputation covers them. ValueError if ``spec`` is set but selects nothing.
    """
    matches = _matcher(spec)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") or prefix == "" for prefix, _ in chosen):
            continue
        if matches(name, module):
            chosen.append((name, module))
    if spec is not None and not chosen:
        raise ValueError(
            f"checkpoint_activations={spec!r} matches no submodule of {type(model).__name__}; "
            "give a module class, a class name or a dotted path (globs allowed)"
        )
    for _, module in chosen:
        checkpoint_module(module)
    return chosen
