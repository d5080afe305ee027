"""The global gradient norm of a layout whose experts are split.

Dense gradients are DTensors on the layout's mesh (or plain), and
:func:`~paratrain.strategies.clipping.global_grad_norm` sums their squares over it. An
expert's gradient is sharded over the ranks that hold the *same* experts; the ranks of
its expert group hold *other* experts, so their squares are summed over that group too.
Without split experts this is :func:`~paratrain.strategies.clipping.clip_grad_norm` as is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.mesh import ParallelMesh
from paratrain.strategies.clipping import clip_grad_norm, global_grad_norm, scale_gradients

__all__ = ["layout_grad_norm"]


def layout_grad_norm(model: nn.Module, max_norm: float, mesh: ParallelMesh, *,
                     experts: int = 0) -> torch.Tensor:
    """Clip ``model``'s gradients to ``max_norm`` by their global norm; return that norm.

    ``experts``: how many MoE layers expert parallel split (0: none).
    """
    if not experts:
        return clip_grad_norm(model.parameters(), max_norm)
    from paratrain.strategies.layout.apply import expert_modules

    split = {id(p) for module in expert_modules(model) for p in module.parameters()}
    params = [p for p in model.parameters() if p.grad is not None]
    dense = [p for p in params if id(p) not in split]
    expert = [p for p in params if id(p) in split]
    squares = global_grad_norm(expert).to(torch.float64) ** 2
    dist.all_reduce(squares, group=mesh.expert_mesh.get_group("expert"))
    norm = (global_grad_norm(dense).to(torch.float64) ** 2 + squares).sqrt().float()
    scale_gradients(params, norm, max_norm)
    return norm
