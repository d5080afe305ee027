"""paratrain: one PyTorch training script for one CPU, one GPU, many GPUs or many machines.

Example:
    >>> import paratrain
    >>> run = paratrain.Run(strategy="auto")     # doctest: +SKIP
"""

from paratrain import datasets
from paratrain.checkpoint import CheckpointError
from paratrain.config import RunConfig
from paratrain.data import DataCursor, DistributedLoader, ShardedSampler
from paratrain.run import Run, seed_everything
from paratrain.strategies import Strategy, available_strategies
from paratrain.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "DataCursor",
    "DistributedLoader",
    "Run",
    "RunConfig",
    "ShardedSampler",
    "datasets",
    "Strategy",
    "Topology",
    "available_strategies",
    "seed_everything",
]
