"""What strategies whose parameters become DTensors share (``fsdp``, ``zero2``, ``tp``, ``fsdp_tp``).

``fully_shard`` and ``parallelize_module`` replace a model's parameters by DTensors, so
the user's optimizer must be rebuilt over the new ones, one-file checkpoints must be
scattered into the local pieces, evaluation must run in lockstep (forward communicates),
and accumulation turns FSDP's gradient reduction off. One mix-in holds that, so the two
families differ only in how they lay the model out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.sharded import (
    load_full_model_state,
    load_full_optimizer_state,
    lockstep_batches,
    rebuild_optimizer,
)
from paratrain.distributed.dtensor import whole

__all__ = ["DTensorParameters", "gradient_sync_disabled", "mixed_precision_policy",
           "shard_units", "whole_model_state"]


def whole_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state with every DTensor gathered whole (collective over its mesh).

    Gathered by :func:`~paratrain.distributed.dtensor.whole`, one all_gather per
    tensor: DCP's ``full_state_dict`` gathers FSDP-over-TP pieces one mesh dimension
    at a time, and DTensor warns about it on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sharded = get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))
    return {name: whole(value) for name, value in sharded.items()}


def mixed_precision_policy(precision: Any, *, refuse_fp16: str) -> Any:
    """FSDP2's policy for the run's precision: gathered parameters in the compute dtype,
    gradients reduced in float32; None without autocast.

    ``16-mixed`` is refused with ``refuse_fp16`` as the reason: GradScaler's inf check
    sees only local pieces of the gradients, so ranks could disagree on skipping a step.
    """
    if precision.mode == "16-mixed":
        raise ValueError(f"precision '16-mixed' is not supported {refuse_fp16}; "
                         "use 'bf16-mixed' (no loss scaling needed)")
    if precision.autocast_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)


def shard_units(model: nn.Module, wrap: Callable[[nn.Module], bool], *,
                before_shard: Callable[[nn.Module], None] | None = None,
                **fully_shard_kwargs: Any) -> None:
    """``fully_shard`` every submodule ``wrap`` selects, bottom-up (a unit must be wrapped
    before the unit that contains it), then the root. ``before_shard`` runs on each unit
    first (per-block compile)."""
    from torch.distributed.fsdp import fully_shard

    shared = shared_outside(model)
    for name, module in reversed(list(model.named_modules())[1:]):
        # A unit must own its parameters: one tied to a module outside it (GPT-2's
        # embedding and head) stays with the enclosing unit, so both uses see one tensor.
        if wrap(module) and not shared(name, module):
            if before_shard is not None:
                before_shard(module)
            fully_shard(module, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)


def shared_outside(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """A test ``(name, module) -> bool``: does ``module`` hold a parameter that is also
    registered outside it (tied weights)?"""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = {key: value for key, value in names.items() if len(value) > 1}

    def test(prefix: str, module: nn.Module) -> bool:
        inside = prefix + "."
        return any(not all(n.startswith(inside) for n in tied[id(p)])
                   for p in module.parameters() if id(p) in tied)

    return test


@contextlib.contextmanager
def gradient_sync_disabled(model: nn.Module) -> Iterator[None]:
    """FSDP2 keeps gradients unsharded and local until the sync is turned back on."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class DTensorParameters:
    """Mix-in (before :class:`~paratrain.strategies.base.Strategy` in the bases) for a
    strategy whose ``setup_model`` replaces parameters by DTensors when ``active``.

    The strategy starts with empty ``_names`` and ``_params`` and records the original
    parameter names and the new parameters with :meth:`_remember` at the end of
    ``setup_model``.
    """

    active: bool
    topology: Any
    _names: dict[int, str]
    _params: dict[str, nn.Parameter]

    def _remember(self, model: nn.Module, names: dict[int, str]) -> None:
        self._names.update(names)
        self._params.update(dict(model.named_parameters()))

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.active:
            return optimizer
        # The optimizer was built over the parameters the layout replaced: step the new ones.
        return rebuild_optimizer(optimizer, self._names, self._params)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if not self.active:
            return contextlib.nullcontext()
        return gradient_sync_disabled(model)

    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        if not self.active:
            yield from ((batch, True) for batch in batches)
            return
        yield from lockstep_batches(batches, device=self.topology.device)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        # A one-file checkpoint holds whole tensors: each rank keeps its piece.
        load_full_model_state(model, state, partial=False)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        load_full_optimizer_state(model, optimizer, state)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model state on every rank (collective), e.g. for export."""
        if not self.active:
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
        return whole_model_state(model)

    def teardown(self) -> None:
        # The new parameters keep the groups alive: drop them before the group goes.
        self._names.clear()
        self._params.clear()
