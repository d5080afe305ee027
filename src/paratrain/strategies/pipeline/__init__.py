"""Pipeline parallelism through ``torch.distributed.pipelining``."""

from paratrain.strategies.pipeline.strategy import PipelineOptions, PipelineStrategy

__all__ = ["PipelineOptions", "PipelineStrategy"]
