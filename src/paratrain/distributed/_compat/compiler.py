"""Private compiler internals: fake tensors, backends, Dynamo's limits (used by paratrain.compile and flop_counter)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from paratrain.distributed._compat.errors import missing as _missing


def tree_leaves(tree: Any) -> list[Any]:
    """Every leaf of nested lists/tuples/dicts/model outputs (torch's pytree)."""
    try:
        from torch.utils._pytree import tree_leaves as torch_tree_leaves
    except ImportError:
        raise _missing("torch.utils._pytree.tree_leaves") from None
    return torch_tree_leaves(tree)


def detect_fake_mode(inputs: Sequence[Any]) -> Any:
    """The fake-tensor mode of a compiler's example inputs, or None."""
    try:
        from torch._guards import detect_fake_mode as torch_detect_fake_mode
    except ImportError:
        return None  # degrades: the graph's FLOPs are then unknown
    return torch_detect_fake_mode(inputs)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (a compiler's stand-in without data)."""
    try:
        from torch._subclasses.fake_tensor import is_fake as torch_is_fake
    except ImportError:
        return False
    return bool(torch_is_fake(tensor))


def compile_backend(backend: Any, *, mode: str | None, options: dict[str, Any] | None,
                    dynamic: bool | None) -> Callable[..., Any]:
    """The compiler ``torch.compile(backend=..., mode=..., options=...)`` would call.

    Built as ``torch.compile`` builds it, so that a wrapper around it (the FLOP count)
    keeps what ``mode`` and ``options`` mean for inductor (its config patches).
    """
    if backend == "inductor":
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:
            raise _missing("torch._TorchCompileInductorWrapper")
        return wrapper(mode, options, dynamic)
    wrapper = getattr(torch, "_TorchCompileWrapper", None)
    if wrapper is None:
        raise _missing("torch._TorchCompileWrapper")
    return wrapper(backend, mode, options, dynamic)


class _GlobalOnly:
    """Stands in for FlopCounterMode's module tracker: every FLOP is the model's."""

    parents = frozenset({"Global"})

    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def global_flop_counter() -> Any:
    """A ``FlopCounterMode`` that counts the total only, without tracking modules.

    Its module tracker hooks every module's inputs with multi-grad hooks, which
    ``torch.autograd.grad`` refuses (the pipelining schedules' backward uses it); the
    total needs no tracking. Where the tracker's attribute is gone, the plain counter.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    if hasattr(counter, "mod_tracker"):
        counter.mod_tracker = _GlobalOnly()
    return counter


def compiled_by_user(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule was compiled by the script itself
    (``torch.compile(module)``, an ``OptimizedModule``, or ``module.compile()``)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        OptimizedModule = ()  # noqa: N806  (no such class: only .compile() is seen)
    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None)
               is not None for m in module.modules())


def allow_recompiles(count: int) -> None:
    """Let Dynamo keep at least ``count`` graphs of one function before it gives up.

    Past its limit (8) Dynamo runs the function eagerly, silently: a model whose blocks
    each specialise the shared block code (a Hugging Face layer updating its own slot of
    the KV cache) would run its later blocks uncompiled.
    """
    try:
        import torch._dynamo.config as dynamo_config
    except ImportError:
        return
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    if getattr(dynamo_config, name, count) < count:
        setattr(dynamo_config, name, count)
