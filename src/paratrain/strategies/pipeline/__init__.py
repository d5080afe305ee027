"""Pipeline parallelism through ``torch.distributed.pipelining``."""

from paratrain.strategies.pipeline.layout import PipelineLayout
from paratrain.strategies.pipeline.strategy import PipelineOptions, PipelineStrategy

__all__ = ["PipelineLayout", "PipelineOptions", "PipelineStrategy"]
