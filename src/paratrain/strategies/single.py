"""``single``: one process, one device, no communication."""

from __future__ import annotations

from torch import nn

from paratrain.compile import compile_model
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import Compiles


class SingleDevice(Strategy, Compiles):
    """Train on one device. The reference every other strategy must match."""

    name = "single"

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = super().setup_model(model)
        return compile_model(model, self._compile) if self._compile is not None else model
