"""Pipeline parallelism through ``torch.distributed.pipelining``: the pipeline axis of a
layout (:class:`~paratrain.strategies.pipeline.stages.PipelineStages`)."""

from paratrain.strategies.pipeline.layout import PipelineLayout
from paratrain.strategies.pipeline.stages import PipelineStages

__all__ = ["PipelineLayout", "PipelineStages"]
