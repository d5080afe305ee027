"""A group's state in memory, for a healing peer: taken on a live rank, put on a new one.

What a rank sends is what a checkpoint holds of it (weights, optimizer, schedulers, loss
scaler, counters, the data cursor), as tensors of this rank only: rank ``i`` of a group
heals rank ``i`` of another group with the same layout, so a sharded parameter travels as
its local shard and is put back into the same place. Weights are copied into the live
tensors (nothing is reallocated); the optimizer's state is loaded whole, since a group
that has just restarted has none yet, with each sharded state tensor made a DTensor of its
parameter's mesh and placements again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from paratrain.data.loader import DataCursor

__all__ = ["restore", "snapshot"]

_SHARD = "__paratrain_local_shard__"


def _local(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard, marked as one."""
    if isinstance(value, DTensor):
        return {_SHARD: value.to_local().detach()}
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    return value[_SHARD] if isinstance(value, dict) and _SHARD in value else value


def snapshot(state: Any, precision: Any, cursor: DataCursor) -> dict[str, Any]:
    """The state of this rank that a peer needs to continue as this group does."""
    return {
        "models": [_local(m.state_dict()) for m in state.models],
        "optimizers": [_local(o.state_dict()) for o in state.optimizers],
        "schedulers": [s.state_dict() for s in state.schedulers],
        "precision": precision.state_dict(),
        "global_step": state.global_step,
        "cursor": {"epoch": cursor.epoch, "offset": cursor.offset},
        "nonfinite_batches": list(state.nonfinite_batches),
        "loss_spikes": {key: list(items) for key, items in state.loss_spikes.items()},
    }


def _load_model(model: torch.nn.Module, received: dict[str, Any]) -> None:
    own = model.state_dict()
    if own.keys() != received.keys():
        missing = sorted(set(own) ^ set(received))[:3]
        raise RuntimeError(f"the healing peer's model differs from this one (keys {missing}); "
                           "every replica group must build the same model and layout")
    with torch.no_grad():
        for name, tensor in own.items():
            target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            target.copy_(_plain(received[name]))


def _optimizer_state(optimizer: torch.optim.Optimizer, received: dict[str, Any]) -> dict:
    """``received`` with each marked shard a DTensor shaped as its parameter again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in received["state"].items():
        param = params[int(index)]
        state[index] = {
            key: (DTensor.from_local(value[_SHARD], param.device_mesh, param.placements,
                                     shape=param.shape, stride=param.stride(), run_check=False)
                  if isinstance(value, dict) and _SHARD in value and isinstance(param, DTensor)
                  else _plain(value))
            for key, value in values.items()}
    return {**received, "state": state}


def restore(state: Any, precision: Any, received: dict[str, Any]) -> DataCursor:
    """Put a peer's ``received`` snapshot into this rank's registered state; return the
    data cursor it was at (the next sample this group trains on)."""
    if len(received["models"]) != len(state.models) or \
            len(received["optimizers"]) != len(state.optimizers):
        raise RuntimeError("the healing peer prepared another number of models or optimizers; "
                           "every replica group must run the same script")
    for model, model_state in zip(state.models, received["models"]):
        _load_model(model, model_state)
    for optimizer, optimizer_state in zip(state.optimizers, received["optimizers"]):
        optimizer.load_state_dict(_optimizer_state(optimizer, optimizer_state))
    for scheduler, scheduler_state in zip(state.schedulers, received["schedulers"]):
        scheduler.load_state_dict(scheduler_state)
    precision.load_state_dict(received["precision"])
    state.nonfinite_batches[:] = received["nonfinite_batches"]
    for key, items in state.loss_spikes.items():  # in place: the spike check holds them
        items[:] = received["loss_spikes"].get(key, [])
    state.global_step = int(received["global_step"])
    return DataCursor(**received["cursor"])
