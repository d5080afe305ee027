"""Tensor parallelism through DTensor: plans (:mod:`.plan`), sequence and loss parallel
(:mod:`.sequence`) and how they are applied (:mod:`.apply`), the ``tensor`` axis of a
layout."""

from paratrain.strategies.tensor.apply import apply_tensor_parallel, complete_gradients

__all__ = ["apply_tensor_parallel", "complete_gradients"]
