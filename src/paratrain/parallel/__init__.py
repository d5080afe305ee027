"""A layout as degrees: ``Parallel(dp_replicate=, dp_shard=, cp=, tp=, pp=, ep=)``.

:mod:`~paratrain.parallel.degrees` holds the user's description (a dataclass, a dict or
a string such as ``"dp_shard=4,tp=2"``, one degree may be ``-1``), validated once;
:mod:`~paratrain.parallel.options` the typed options of each parallelism;
:mod:`~paratrain.parallel.presets` the named strategies as presets of degrees and the
one function that chooses what runs a resolved layout. Nothing here imports the runtime
(``strategies/`` sits above).
"""

from paratrain.parallel.degrees import Parallel
from paratrain.parallel.options import (
    ContextParallel,
    DiLoCo,
    LocalSGD,
    Pipeline,
    Sharding,
    TensorParallel,
)

__all__ = ["ContextParallel", "DiLoCo", "LocalSGD", "Parallel", "Pipeline", "Sharding",
           "TensorParallel"]
