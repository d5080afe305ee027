"""paratrain: one PyTorch training script for one CPU, one GPU, many GPUs or many machines.

The packages follow a step's path: ``launch`` starts the processes, ``distributed`` holds the
topology and process group, ``strategies`` wrap the model, ``run`` is the loop, ``checkpoint``
saves and resumes; ``reliability`` watches all of it; ``bench``, ``plan`` and ``verify`` are
the tools beside it. ``docs/architecture.md`` is the map.

Example:
    >>> import paratrain
    >>> run = paratrain.Run(strategy="auto")     # doctest: +SKIP
"""

from paratrain import datasets
from paratrain.checkpoint import CheckpointError
from paratrain.config import RunConfig
from paratrain.data import DataCursor, DistributedLoader, ShardedSampler
from paratrain.distributed.topology import Topology
from paratrain.fault_tolerance import FaultTolerance
from paratrain.parallel import (
    ContextParallel,
    DiLoCo,
    LocalSGD,
    Parallel,
    Pipeline,
    Sharding,
    TensorParallel,
)
from paratrain.run import Run, seed_everything
from paratrain.strategies import Strategy, available_strategies

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ContextParallel",
    "DataCursor",
    "DiLoCo",
    "DistributedLoader",
    "FaultTolerance",
    "LocalSGD",
    "Parallel",
    "Pipeline",
    "Run",
    "RunConfig",
    "ShardedSampler",
    "Sharding",
    "datasets",
    "Strategy",
    "TensorParallel",
    "Topology",
    "available_strategies",
    "seed_everything",
]
