"""paratrain: one PyTorch training script for one CPU, one GPU, many GPUs or many machines.

The packages follow a step's path: ``launch`` starts the processes, ``distributed`` holds the
topology and process group, ``strategies`` wrap the model, ``run`` is the loop, ``checkpoint``
saves and resumes; ``reliability`` watches all of it; ``bench``, ``plan`` and ``verify`` are
the tools beside it. ``docs/architecture.md`` is the map.

Example:
    >>> import paratrain
    >>> run = paratrain.Run(strategy="auto")     # doctest: +SKIP
"""

import importlib
from typing import TYPE_CHECKING, Any

# What ``paratrain.X`` names, imported on first use: ``import paratrain`` alone (as the
# launcher's command line and each tool do) then costs nothing beyond torch, which a
# launch pays once per process.
_EXPORTS = {
    "datasets": "paratrain.datasets",
    "CheckpointError": "paratrain.checkpoint",
    "RunConfig": "paratrain.config",
    "DataCursor": "paratrain.data",
    "DistributedLoader": "paratrain.data",
    "ShardedSampler": "paratrain.data",
    "Topology": "paratrain.distributed.topology",
    "FaultTolerance": "paratrain.fault_tolerance",
    "ContextParallel": "paratrain.parallel",
    "DiLoCo": "paratrain.parallel",
    "LocalSGD": "paratrain.parallel",
    "Parallel": "paratrain.parallel",
    "Pipeline": "paratrain.parallel",
    "Sharding": "paratrain.parallel",
    "TensorParallel": "paratrain.parallel",
    "Run": "paratrain.run",
    "seed_everything": "paratrain.run",
    "Strategy": "paratrain.strategies",
    "available_strategies": "paratrain.strategies",
}

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if name == "datasets" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


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
