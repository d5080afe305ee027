"""Tensor parallelism through DTensor (``tp``) and its 2-D layout with FSDP (``fsdp_tp``)."""

from paratrain.strategies.tensor.strategy import (
    FSDPTPOptions,
    FSDPTPStrategy,
    TPOptions,
    TPStrategy,
)

__all__ = ["FSDPTPOptions", "FSDPTPStrategy", "TPOptions", "TPStrategy"]
