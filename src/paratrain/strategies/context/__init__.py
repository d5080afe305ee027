"""Context parallel: one sequence split across ranks, attention exact over all of it.

:mod:`.sequence` cuts a batch's sequence-shaped tensors (load-balanced head-tail order);
:mod:`.attention` computes attention across the cut (ring or all-to-all);
:mod:`.batch` cuts a whole training batch and counts its targets;
:mod:`.apply` runs a model's forwards under context parallel (:class:`ContextParallel`).
"""

from paratrain.strategies.context.apply import ContextParallel
from paratrain.strategies.context.batch import SlicedBatch, slice_batch

__all__ = ["ContextParallel", "SlicedBatch", "slice_batch"]
