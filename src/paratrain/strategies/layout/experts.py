"""Whole state of a layout whose experts are split over an expert group.

Each rank of an expert group holds ``E / ep`` experts of every MoE layer (sharded further
by FSDP over the ranks holding the same ones). The whole model's state puts them back
together: each expert weight is gathered whole over its FSDP mesh, then the groups'
slices are concatenated along the expert dimension, in rank order (rank ``j`` holds
experts ``j E/ep ...``).

Sharded checkpoints (``torch.distributed.checkpoint``) of split experts are not written
yet: every rank of an expert group would store a different tensor under one name. They
are refused in one line (:data:`SHARDED_REFUSAL`); the whole state (exports,
``full_state_dict``) goes through :func:`whole_experts_state`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SHARDED_REFUSAL", "expert_parameter_names", "whole_experts_state"]

SHARDED_REFUSAL = ("checkpoints with ep > 1 are not written yet (each expert group holds "
                   "other experts under the same names); export the weights with "
                   "run.save_pretrained(), or train without ep")


def expert_parameter_names(module: nn.Module) -> set[str]:
    """Names (in ``module``'s state) of the split expert weights."""
    from paratrain.strategies.layout.apply import expert_modules

    split = {id(p) for m in expert_modules(module) for p in m.parameters()}
    return {name for name, p in module.named_parameters() if id(p) in split}


def whole_experts_state(state: dict[str, torch.Tensor], module: nn.Module,
                        group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """``state`` (whole over each tensor's own mesh) with every split expert weight
    concatenated over the expert ``group`` (a collective over it)."""
    names = expert_parameter_names(module)
    size = dist.get_world_size(group)
    whole = dict(state)
    for name in sorted(names):
        piece = state[name].contiguous()
        parts = [torch.empty_like(piece) for _ in range(size)]
        dist.all_gather(parts, piece, group=group)
        whole[name] = torch.cat(parts)
    return whole
