"""Horovod's PyTorch API (the commonly used subset) on top of paratrain and torch.distributed.

A Horovod script runs under ``paratrain launch`` after changing only its import:

    >>> import paratrain.horovod as hvd                     # was: import horovod.torch as hvd
    >>> hvd.init()                                           # doctest: +SKIP
    >>> optimizer = hvd.DistributedOptimizer(                # doctest: +SKIP
    ...     optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=2)
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)      # doctest: +SKIP
    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)          # doctest: +SKIP

The ranks come from the launcher's environment through :class:`paratrain.Topology`;
collectives are torch.distributed ones (gloo on CPU, NCCL on CUDA). Horovod's API is
built on process-wide state (``hvd.rank()`` takes no arguments), so this module keeps
one private :class:`_State`; nothing else in paratrain reads it.

Not provided: Adasum, process sets, elastic training, sparse gradients, tensor fusion
(each gradient is reduced on its own, overlapping the rest of the backward pass).
"""

from paratrain.horovod._api import *  # noqa: F403
from paratrain.horovod._api import __all__ as _api_names
from paratrain.horovod.optimizer import DistributedOptimizer

__all__ = [*_api_names, "DistributedOptimizer"]
