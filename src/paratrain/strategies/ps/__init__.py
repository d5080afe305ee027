"""A parameter server (sync, async, bounded staleness) over ``torch.distributed``."""

from paratrain.strategies.ps.strategy import PSOptions, PSStrategy

__all__ = ["PSOptions", "PSStrategy"]
