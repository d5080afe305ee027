"""``mp``: classic single-process model parallelism over the GPUs of one machine.

The children of an ``nn.Sequential`` are placed on ``cuda:0``, ``cuda:1``, ...
(balanced by parameter count, or at ``split_points``) and activations are moved
to the next device between them. Only one device computes at a time, so this
buys memory, not speed; use ``pipeline`` (several processes, micro-batches) to
keep the devices busy. Without at least two GPUs it runs as ``single``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.distributed.partition import balanced_split
from paratrain.strategies.base import Strategy


@dataclass(frozen=True, kw_only=True)
class ModelParallelOptions:
    """Options of the ``mp`` strategy."""

    device_ids: tuple[int, ...] | None = None
    """GPUs to spread the layers over; all visible ones by default."""

    split_points: tuple[int, ...] | None = None
    """Child indices where devices 1.. begin; None balances by parameter count."""


def place_layers(model: nn.Sequential, devices: list[torch.device],
                 split_points: tuple[int, ...] | None = None) -> nn.Sequential:
    """Move consecutive children of ``model`` to ``devices`` in place; return the sequence
    with transfers between them (parameter names unchanged)."""
    children = list(model.named_children())
    if split_points is None:
        starts = balanced_split([sum(p.numel() for p in c.parameters()) for _, c in children],
                                len(devices))
    else:
        starts = list(split_points)
        if len(starts) != len(devices) - 1:
            raise ValueError(f"split_points={split_points} must give {len(devices) - 1} indices")
    bounds = [0, *starts, len(children)]
    for index, device in enumerate(devices):
        for _, child in children[bounds[index]:bounds[index + 1]]:
            child.to(device)
        # The last layer on each device hands its output to the next device; the final
        # output returns to the first device, where the batch and targets live. Hooks
        # (not extra modules) keep the state_dict keys of the user's model.
        following = devices[(index + 1) % len(devices)]
        children[bounds[index + 1] - 1][1].register_forward_hook(
            lambda _m, _i, out, d=following: out.to(d, non_blocking=True))
    return model


class ModelParallelStrategy(Strategy):
    """Layers on several GPUs of one process; falls back to one device with a notice."""

    name = "mp"
    Options = ModelParallelOptions

    def __init__(self, topology, options=None, *, timeout_s: float = 300.0) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        if topology.is_distributed:
            raise ValueError(
                "strategy 'mp' runs in one process but the job has "
                f"{topology.world_size}; use strategy='pipeline' with several processes"
            )
        ids = self.options.device_ids
        if ids is None and torch.cuda.is_available():
            ids = tuple(range(torch.cuda.device_count()))
        self.devices = [torch.device("cuda", i) for i in (ids or ())]
        self.active = topology.device.type == "cuda" and len(self.devices) > 1

    def notice(self) -> str | None:
        if self.active:
            return None
        return "strategy 'mp' needs 2 or more GPUs: running as 'single'"

    def setup_model(self, model: nn.Module) -> nn.Module:
        if not self.active:
            return model.to(self.topology.device)
        if not isinstance(model, nn.Sequential):
            raise ValueError(f"strategy 'mp' splits nn.Sequential models; got {type(model).__name__}")
        return place_layers(model, self.devices, self.options.split_points)
