"""Distributed sampling and loading with an exact, resumable cursor."""

from paratrain.data.batched import BatchedLoader, batched_source, build_loader
from paratrain.data.loader import (
    DataCursor,
    DistributedLoader,
    ShardedSampler,
    epoch_order,
    move_to_device,
)

__all__ = ["BatchedLoader", "DataCursor", "DistributedLoader", "ShardedSampler", "batched_source",
           "build_loader", "epoch_order", "move_to_device"]
