"""What tensor parallelism does to one model, measured once for ``tp`` and ``fsdp_tp``.

The runtime splits only the linear layers of its plan
(:func:`paratrain.strategies.tensor.plan.automatic_plan`): embeddings, norms, the output
layer and the loss stay whole on every tensor rank. Each rowwise layer all-reduces its
output in forward and each colwise layer its input's gradient in backward (DTensor
reduces every colwise layer on its own, so separate q/k/v projections cost three).
:func:`tensor_parallel_fields` measures those all-reduces and the share of the work and
of the parameters that is split, for :class:`~paratrain.plan.types.ModelProfile`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

__all__ = ["tensor_parallel_fields"]


def _outermost(names: set[str]) -> list[str]:
    # A parent nested in another would be timed twice.
    return sorted(n for n in names
                  if not any(n != m and (m == "" or n.startswith(m + ".")) for m in names))


def _nbytes(value: Any) -> int:
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    return first.numel() * first.element_size() if hasattr(first, "element_size") else 0


def tensor_parallel_fields(model: Any, forward: Callable[[], Any], *, batch: int,
                           now: Callable[[], float], repeats: int = 3) -> dict[str, Any]:
    """The ``tp_*`` fields of a :class:`~paratrain.plan.types.ModelProfile` for ``model``,
    or ``{}`` when the automatic tensor-parallel plan finds no layers to split.

    ``forward()`` runs the model on one batch of ``batch`` samples and returns its loss.
    The split share of the compute is the forward time spent in the modules that own
    the planned layers (attention, MLP: everything between a colwise input and a rowwise
    output is split), median of ``repeats`` passes; backward is assumed to split alike.
    """
    import torch

    from paratrain.strategies.tensor.plan import automatic_plan

    try:
        plan = automatic_plan(model)
    except ValueError:
        return {}
    modules = dict(model.named_modules())
    comm = [0]

    def rowwise_output(module: Any, args: Any, output: Any) -> None:
        comm[0] += _nbytes(output)

    def colwise_input(module: Any, args: Any) -> None:
        comm[0] += _nbytes(args)  # its gradient is all-reduced in backward

    parents = _outermost({name.rpartition(".")[0] for name in plan})
    inside = [0.0]
    started: dict[int, float] = {}

    def enter(module: Any, args: Any) -> None:
        started[id(module)] = now()

    def leave(module: Any, args: Any, output: Any) -> None:
        inside[0] += now() - started.pop(id(module))

    hooks = [modules[name].register_forward_hook(rowwise_output)
             if style == "rowwise" else modules[name].register_forward_pre_hook(colwise_input)
             for name, style in plan.items()]
    shares = []
    try:
        with torch.enable_grad():
            forward()  # counts the all-reduced bytes once
            for hook in hooks:
                hook.remove()
            hooks = [h for name in parents for h in (
                modules[name].register_forward_pre_hook(enter),
                modules[name].register_forward_hook(leave))]
            for _ in range(repeats):
                inside[0] = 0.0
                t0 = now()
                forward()
                total = now() - t0
                shares.append(min(1.0, inside[0] / total) if total > 0 else 1.0)
    finally:
        for hook in hooks:
            hook.remove()
    split = {id(p) for name in plan for p in modules[name].parameters()}
    params = list(model.parameters())
    return {
        "tp_allreduces": len(plan),
        "tp_allreduce_bytes_per_sample": comm[0] / batch,
        "tp_split_fraction": statistics.median(shares),
        "tp_split_param_fraction": sum(p.numel() for p in params if id(p) in split)
        / sum(p.numel() for p in params),
    }
