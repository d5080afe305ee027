"""Expert parallel for Hugging Face mixtures of experts, found by their structure.

transformers 5 stores a MoE layer's experts as one module with stacked weights,
``gate_up_proj (E, 2 I, H)`` and ``down_proj (E, H, I)``, called as
``experts(hidden_states, top_k_index, top_k_weights)`` after the layer's router (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, and every family built the same way; a shared expert,
Qwen2-MoE's, is an ordinary MLP beside it and stays replicated). :class:`DispatchedExperts`
replaces such a module: it keeps this rank's ``E / ep`` experts and sends each token copy
to the rank holding its expert (:mod:`.dispatch`), so the router, attention and norms
are untouched and compute what the model computes.

transformers' own expert parallel is not used (its outputs were silently wrong in
released versions). Layouts it describes with flags other than the default one
(transposed or interleaved weights, biases, no gate, a norm after each expert) are
refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.strategies.experts.dispatch import local_weight, run_experts, split_expert_weight

_DEFAULT_LAYOUT = {"is_transposed": False, "is_concatenated": True, "has_bias": False,
                   "has_gate": True, "has_post_expert_norm": False}


def is_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds a transformers-style stack of experts."""
    weights = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    return (all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)
            and isinstance(getattr(module, "num_experts", None), int))


def _check_layout(name: str, module: nn.Module) -> None:
    for flag, expected in _DEFAULT_LAYOUT.items():
        if getattr(module, flag, expected) != expected:
            raise ValueError(
                f"expert parallel supports stacked experts as [gate; up] then down without "
                f"biases; {name} ({type(module).__name__}) has {flag}={not expected}: train "
                "this model with its experts replicated or sharded (no ep)")


class DispatchedExperts(nn.Module):
    """This rank's share of a stacked-experts module; tokens travel to their experts.

    Args:
        experts: the model's experts module (all ``E`` experts).
        group: the expert-parallel group of ``ep`` ranks; rank ``j`` keeps experts
            ``j * E/ep ... (j + 1) * E/ep - 1``.
    """

    def __init__(self, experts: nn.Module, group: Any, mesh: Any = None) -> None:
        super().__init__()
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = experts.num_experts
        for name in ("gate_up_proj", "down_proj"):
            self.register_parameter(name, split_expert_weight(getattr(experts, name), rank, ep,
                                                              mesh))
        self.act_fn = experts.act_fn
        self.group = group
        self.grad_scale = 1.0
        """Factor on the weights' gradients (``1 / ep`` under FSDP, see ``scale_gradient``)."""
        self.tokens_per_expert: torch.Tensor | None = None

    def _experts(self) -> Any:
        gate_up = local_weight(self.gate_up_proj, self.grad_scale)
        down = local_weight(self.down_proj, self.grad_scale)

        def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(rows, gate_up[index]).chunk(2, dim=-1)
            return F.linear(self.act_fn(gate) * up, down[index])

        return expert

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        flat = top_k_index.flatten()
        order = torch.argsort(flat, stable=True)
        source = order // top_k
        outputs = run_experts(hidden_states.index_select(0, source), flat.index_select(0, order),
                              self.num_experts, self._experts(), self.group)
        weighted = outputs * top_k_weights.flatten().index_select(0, order).unsqueeze(-1)
        # This rank's routing counts, for statistics; no collective in the step.
        self.tokens_per_expert = torch.bincount(flat, minlength=self.num_experts).float()
        return torch.zeros_like(hidden_states).index_add(0, source,
                                                         weighted.to(hidden_states.dtype))


def dispatch_stacked_experts(model: nn.Module, group: Any, *, mesh: Any = None) -> int:
    """Replace every stacked-experts module of ``model`` by its :class:`DispatchedExperts`;
    the number replaced. One-line ValueError for an expert count ep does not divide.
    ``mesh``: the 1-D expert mesh over ``group`` (weights become DTensors on it)."""
    ep = dist.get_world_size(group)
    found = [(name, module) for name, module in model.named_modules()
             if is_stacked_experts(module)]
    for name, module in found:
        _check_layout(name, module)
        if module.num_experts % ep:
            raise ValueError(f"expert parallel ep={ep} splits {name}'s {module.num_experts} "
                             f"experts evenly; choose an ep dividing {module.num_experts}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, DispatchedExperts(module, group, mesh))
    return len(found)
