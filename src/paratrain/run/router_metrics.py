"""How evenly a mixture of experts routes its tokens, counted over an epoch.

:class:`RouterLoad` hooks every router of a model: paratrain's own
:class:`~paratrain.strategies.experts.moe.MoE` layers and Hugging Face routers (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE and the other transformers families whose ``*TopKRouter`` is
the ``gate`` of a ``*SparseMoeBlock``). Each training forward adds the top-k experts
chosen for every token to a per-layer count held on the router's device: no host sync
per step. Evaluation forwards (``module.eval()`` or ``torch.no_grad()``) and the
recomputation of activation checkpointing in backward are not counted.

:meth:`RouterLoad.epoch_metrics` sums the counts over a process group (a collective), turns
them into a few numbers for the epoch's stats and resets them.

Example:
    >>> from paratrain.models import GPT
    >>> model = GPT(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8, experts=4)
    >>> load = RouterLoad.attach(model)
    >>> _ = model(torch.randint(0, 16, (2, 4)))
    >>> sorted(load.epoch_metrics())
    ['router_max_over_mean_load', 'router_tokens_per_expert_max', 'router_tokens_per_expert_min']
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed._compat import in_backward
from paratrain.strategies.experts.moe import MoE


def _config_value(model: nn.Module, names: tuple[str, ...]) -> int | None:
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _is_hf_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter")


def _hf_routers(model: nn.Module) -> list[nn.Module]:
    """Routers of transformers' MoE blocks: a ``*TopKRouter`` or a ``*SparseMoeBlock``'s
    ``gate`` (a plain Linear in older transformers)."""
    routers: dict[int, nn.Module] = {}
    for module in model.modules():
        gate = getattr(module, "gate", None)
        if type(module).__name__.endswith("SparseMoeBlock") and isinstance(gate, nn.Module):
            routers.setdefault(id(gate), gate)
        elif _is_hf_router(module):
            routers.setdefault(id(module), module)
    return list(routers.values())


def _chosen_experts(output: Any, num_experts: int, top_k: int) -> torch.Tensor:
    """The expert indices a HF router chose: its integer output (transformers 5 routers
    return ``(logits, scores, indices)``), else the top-k of its logits (a Linear gate)."""
    tensors = [output] if isinstance(output, torch.Tensor) else \
        [t for t in output if isinstance(t, torch.Tensor)]
    indices = [t for t in tensors if not t.is_floating_point()]
    if indices:
        return indices[-1]
    logits = next(t for t in tensors if t.shape[-1] == num_experts)
    return logits.reshape(-1, num_experts).topk(top_k, dim=-1).indices


class RouterLoad:
    """Tokens per expert of every router of a model, summed over training forwards.

    Build it with :meth:`attach`. The counts are token copies: a token routed to its
    ``top_k`` experts adds one to each of them.
    """

    def __init__(self, routers: list[tuple[nn.Module, int, int]]) -> None:
        self._routers = routers
        self._counts: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [module.register_forward_hook(self._hook(index))
                         for index, (module, _, _) in enumerate(routers)]

    @classmethod
    def attach(cls, model: nn.Module) -> RouterLoad | None:
        """Hook the routers of ``model`` (paratrain MoE layers, transformers MoE blocks);
        None when the model has no experts."""
        routers: list[tuple[nn.Module, int, int]] = [
            (layer, layer.num_experts, layer.top_k)
            for layer in model.modules() if isinstance(layer, MoE)]
        config_experts = _config_value(model, ("num_local_experts", "num_experts"))
        config_top_k = _config_value(model, ("num_experts_per_tok",))
        for gate in _hf_routers(model):
            experts = getattr(gate, "num_experts", None) or config_experts or \
                getattr(gate, "out_features", None)
            top_k = getattr(gate, "top_k", None) or config_top_k
            if not experts or not top_k:
                raise ValueError(f"router_metrics: cannot tell the experts and top_k of "
                                 f"{type(gate).__name__}; set num_experts/num_experts_per_tok "
                                 "in the model's config")
            routers.append((gate, int(experts), int(top_k)))
        return cls(routers) if routers else None

    def _hook(self, index: int) -> Any:
        module, experts, top_k = self._routers[index]
        own = isinstance(module, MoE)

        def count(layer: nn.Module, args: Any, output: Any) -> None:
            if not (layer.training and torch.is_grad_enabled()) or in_backward():
                return
            if own:
                routed = layer.tokens_per_expert  # this forward's counts (float)
                if routed is None:
                    return
                added = routed.detach().to(torch.int64)
            else:
                chosen = _chosen_experts(output, experts, top_k).detach().reshape(-1)
                added = torch.zeros(experts, dtype=torch.int64, device=chosen.device)
                added.index_add_(0, chosen.long(), torch.ones_like(chosen, dtype=torch.int64))
            total = self._counts[index]
            self._counts[index] = added if total is None else total.add_(added)

        return count

    def _device(self) -> torch.device:
        for counts in self._counts:
            if counts is not None:
                return counts.device
        for module, _, _ in self._routers:
            for param in module.parameters():
                return param.device
        return torch.device("cpu")

    def counts(self) -> list[torch.Tensor]:
        """This rank's counts since the last reset: one ``(num_experts,)`` int64 per router."""
        device = self._device()
        return [torch.zeros(experts, dtype=torch.int64, device=device) if counts is None
                else counts for counts, (_, experts, _) in zip(self._counts, self._routers)]

    def reset(self) -> None:
        """Forget the counts."""
        self._counts = [None] * len(self._routers)

    def epoch_metrics(self, group: Any = None, *, reduce: bool = True) -> dict[str, float]:
        """Sum the counts over ``group`` (every rank of it must call this; None: the
        default group, or this process alone when none is initialized; ``reduce=False``:
        this process's counts alone), reset them and return, always with these keys:

        - ``router_max_over_mean_load``: the largest, over layers, of a layer's most
          loaded expert's tokens over its mean tokens per expert (1.0 = even; nan when
          no training forward was counted).
        - ``router_tokens_per_expert_min`` / ``router_tokens_per_expert_max``: the fewest
          and most token copies one expert of one layer received.

        The group should hold the ranks that see different tokens (data parallel and
        context parallel); tensor-parallel peers see the same tokens and would scale
        the two token counts (not the ratio). Every rank must hold the same routers.
        """
        per_layer = self.counts()
        flat = torch.cat(per_layer)
        if reduce and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, group=group)
        self.reset()
        ratio, low, high = -math.inf, math.inf, -math.inf
        summed, start = flat.tolist(), 0  # the one host sync of the epoch
        for layer in per_layer:
            values = summed[start:start + layer.numel()]
            start += layer.numel()
            low, high = min(low, min(values)), max(high, max(values))
            if sum(values):
                ratio = max(ratio, max(values) * len(values) / sum(values))
        return {"router_max_over_mean_load": ratio if ratio > -math.inf else math.nan,
                "router_tokens_per_expert_min": float(low),
                "router_tokens_per_expert_max": float(high)}

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
