"""A mixture-of-experts feed-forward layer: top-k router, dropless experts, balance loss.

Each token is scored by a linear router (softmax over the experts), sent to its ``top_k``
experts (every copy computed: dropless), and the experts' outputs are summed with the
router's weights (renormalised over the chosen ``k``, as Mixtral does). The experts are
two-layer GELU MLPs whose weights are stacked, ``w_in (E, d, h)`` and ``w_out (E, h, d)``,
so expert parallel splits them along the first dimension (:mod:`.apply`).

The load-balancing loss (Switch Transformer) is ``E * sum_e f_e * P_e``: ``f_e`` the
share of token copies routed to expert ``e``, ``P_e`` the mean router probability of
``e``. It is 1 for a perfectly even router. With ``global_balance`` the counts ``f_e``
are summed over the balance group (the data-parallel ranks) first, so the loss sees the
global batch's routing rather than each rank's micro-batch.

After each forward, :attr:`MoE.tokens_per_expert` holds the layer's routing counts on
this rank; :func:`router_statistics` sums them over the expert group when asked.

Example:
    >>> layer = MoE(dim=8, hidden=16, num_experts=4, top_k=2)
    >>> layer(torch.randn(2, 5, 8)).shape
    torch.Size([2, 5, 8])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.strategies.experts.dispatch import local_weight, run_experts


class StackedExperts(nn.Module):
    """The experts of one layer, weights stacked along the expert dimension.

    Its own module so that its weights are placed apart from the dense ones: expert
    parallel keeps a slice of the experts per rank and FSDP shards them over the ranks
    that hold the same slice (see :mod:`paratrain.strategies.layout.apply`). Its forward
    runs every (sorted) token copy through its expert, wherever that expert lives.
    """

    def __init__(self, *, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, dim))
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02)
        self.group: Any = None
        """Expert-parallel group: this rank holds ``num_experts / ep`` of the experts."""
        self.grad_scale = 1.0
        """Factor on the weights' gradients (``1 / ep`` under FSDP, see ``scale_gradient``)."""

    def forward(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """``rows`` sorted by ``expert_ids``, through their experts (in that order)."""
        w_in = local_weight(self.w_in, self.grad_scale)
        w_out = local_weight(self.w_out, self.grad_scale)

        def expert(index: int, chunk: torch.Tensor) -> torch.Tensor:
            return F.gelu(chunk @ w_in[index]) @ w_out[index]

        return run_experts(rows, expert_ids, self.num_experts, expert, self.group)


class MoE(nn.Module):
    """Router + ``num_experts`` MLP experts, each token to ``top_k`` of them.

    Args:
        dim: model width.
        hidden: each expert's hidden width.
        num_experts: experts in the layer (all ranks together).
        top_k: experts per token.
        global_balance: count the balance loss's routing shares over the balance group.
    """

    def __init__(self, *, dim: int, hidden: int, num_experts: int, top_k: int = 2,
                 global_balance: bool = False) -> None:
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an integer in [1, num_experts={num_experts}], "
                             f"got {top_k!r}")
        self.num_experts, self.top_k, self.global_balance = num_experts, top_k, global_balance
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = StackedExperts(num_experts=num_experts, dim=dim, hidden=hidden)
        self.balance_group: Any = None
        """Group the balance loss's counts are summed over when ``global_balance``."""
        self.balance_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    @property
    def expert_group(self) -> Any:
        """Expert-parallel group (set by :func:`~.apply.apply_expert_parallel`), or None."""
        return self.experts.group

    @property
    def w_in(self) -> nn.Parameter:
        return self.experts.w_in

    @property
    def w_out(self) -> nn.Parameter:
        return self.experts.w_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        source = order // self.top_k
        outputs = self.experts(tokens.index_select(0, source), flat.index_select(0, order))
        weighted = outputs * weights.flatten().index_select(0, order).unsqueeze(-1)
        combined = torch.zeros_like(tokens).index_add(0, source, weighted)
        self._route_statistics(probs, flat)
        return combined.view(shape)

    def _route_statistics(self, probs: torch.Tensor, flat: torch.Tensor) -> None:
        counts = torch.bincount(flat, minlength=self.num_experts).to(probs.dtype)
        local_counts = counts
        if self.global_balance and self.balance_group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.balance_group)
        share = counts / counts.sum()
        self.balance_loss = self.num_experts * (share * probs.mean(0)).sum()
        # This rank's counts: summed over the expert group only when they are reported
        # (router_statistics), not by a collective in every forward.
        self.tokens_per_expert = local_counts.detach()


def balance_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the model's MoE layers' load-balancing losses from their last forward."""
    losses = [m.balance_loss for m in model.modules()
              if isinstance(m, MoE) and m.balance_loss is not None]
    if not losses:
        raise ValueError("balance_loss: the model has no MoE layer that ran a forward")
    return torch.stack(losses).sum()


def router_statistics(model: nn.Module) -> dict[str, float]:
    """``router_max_over_mean_load`` (1 = even) and the tokens routed, over the MoE
    layers' last forward, summed over each layer's expert group (a collective there:
    call it on every rank of the group)."""
    counts = []
    for layer in model.modules():
        if isinstance(layer, MoE) and layer.tokens_per_expert is not None:
            routed = layer.tokens_per_expert.clone()
            if layer.expert_group is not None:  # every rank of the group calls this
                dist.all_reduce(routed, group=layer.expert_group)
            counts.append(routed)
    if not counts:
        return {}
    stacked = torch.stack(counts)
    load = stacked.max(dim=1).values / stacked.mean(dim=1).clamp(min=1e-9)
    return {"router_max_over_mean_load": float(load.max()),
            "router_tokens": float(stacked.sum(dim=1)[0])}
