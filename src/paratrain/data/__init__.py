"""Distributed sampling and loading with an exact, resumable cursor."""

from paratrain.data.loader import (
    DataCursor,
    DistributedLoader,
    ShardedSampler,
    epoch_order,
    move_to_device,
)

__all__ = ["DataCursor", "DistributedLoader", "ShardedSampler", "epoch_order", "move_to_device"]
