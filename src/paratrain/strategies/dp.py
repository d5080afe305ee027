"""``dp``: single-process ``nn.DataParallel`` over the GPUs of one machine.

One process drives every visible GPU: the batch is scattered, the module is
replicated each step and outputs are gathered on the first device. On CPU or
with a single GPU there is nothing to parallelise, so it behaves as ``single``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.strategies.base import Strategy


@dataclass(frozen=True, kw_only=True)
class DPOptions:
    """Options of the ``dp`` strategy."""

    device_ids: tuple[int, ...] | None = None
    """GPUs to use; all visible ones by default."""


class DataParallelStrategy(Strategy):
    """``nn.DataParallel`` in one process; falls back to one device with a notice."""

    name = "dp"
    Options = DPOptions

    def __init__(self, topology, options=None, *, timeout_s: float = 300.0) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        if topology.is_distributed:
            raise ValueError(
                "strategy 'dp' runs in one process but the job has "
                f"{topology.world_size}; use strategy='ddp' with several processes"
            )
        device_ids = self.options.device_ids
        if device_ids is None and torch.cuda.is_available():
            device_ids = tuple(range(torch.cuda.device_count()))
        self.device_ids = tuple(device_ids or ())
        self.active = topology.device.type == "cuda" and len(self.device_ids) > 1

    def notice(self) -> str | None:
        """The one-line fallback notice, or None when DataParallel is really used."""
        if self.active:
            return None
        where = "CPU" if self.topology.device.type == "cpu" else "a single GPU"
        return f"strategy 'dp' on {where}: nothing to parallelise, running as 'single'"

    def setup_model(self, model: nn.Module) -> nn.Module:
        if not self.active:
            return model.to(self.topology.device)
        model = model.to(torch.device("cuda", self.device_ids[0]))
        return nn.DataParallel(model, device_ids=list(self.device_ids))

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model
