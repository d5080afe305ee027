"""Splitting a model's experts over an expert-parallel group.

Rank ``j`` of an ``ep``-rank group keeps experts ``j * E/ep ... (j + 1) * E/ep - 1`` of
every :class:`~.moe.MoE` layer (its slices of ``w_in``/``w_out``); the router and every
other parameter stay whole. Token copies then travel to their experts' ranks
(:mod:`.dispatch`). An expert's gradient on its rank sums the contributions of every
rank's tokens: with ``ep`` borrowed from the data-parallel ranks, that is the sum a
data-parallel all-reduce would have made, so it is divided by the data-parallel size,
as the replicated parameters' all-reduce averages theirs (:func:`average_expert_gradients`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.strategies.experts.dispatch import split_expert_weight
from paratrain.strategies.experts.moe import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's mixture-of-experts layers."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def apply_expert_parallel(model: nn.Module, group: Any, *, balance_group: Any = None,
                          mesh: Any = None) -> int:
    """Keep this rank's experts of every MoE layer; returns the number of layers split.

    ``mesh``: the 1-D expert mesh over ``group``; the expert weights then become DTensors
    ``Shard(0)`` on it (whole-named in checkpoints). ValueError in one line when the
    expert count is not divisible by the group's size.
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = moe_layers(model)
    for layer in layers:
        if layer.num_experts % ep:
            raise ValueError(f"expert parallel ep={ep} splits each MoE layer's "
                             f"{layer.num_experts} experts evenly; choose an ep dividing "
                             f"{layer.num_experts}")
        for name in ("w_in", "w_out"):
            setattr(layer.experts, name,
                    split_expert_weight(getattr(layer.experts, name), rank, ep, mesh))
        layer.experts.group = group
        layer.balance_group = balance_group if balance_group is not None else group
    return len(layers)


def expert_parameters(model: nn.Module) -> set[int]:
    """``id`` of every expert weight (split over the expert group, not replicated)."""
    return {id(p) for layer in moe_layers(model) for p in (layer.w_in, layer.w_out)}


def average_expert_gradients(model: nn.Module, data_parallel_size: int) -> None:
    """Divide the expert weights' gradients (sums over all ranks' tokens) by the
    data-parallel size, matching the averaged gradients of the replicated parameters."""
    for layer in moe_layers(model):
        for param in (layer.w_in, layer.w_out):
            if param.grad is not None:
                param.grad.div_(data_parallel_size)


def whole_experts(model: nn.Module, group: Any) -> dict[str, torch.Tensor]:
    """Every MoE layer's full ``w_in``/``w_out`` gathered from the expert group."""
    gathered, experts = {}, expert_parameters(model)
    for name, param in model.named_parameters():
        if id(param) in experts:
            pieces = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, param.detach().contiguous(), group=group)
            gathered[name] = torch.cat(pieces)
    return gathered
