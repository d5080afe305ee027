"""``single``: one process, one device, no communication."""

from __future__ import annotations

from paratrain.strategies.base import Strategy


class SingleDevice(Strategy):
    """Train on one device. The reference every other strategy must match."""

    name = "single"
