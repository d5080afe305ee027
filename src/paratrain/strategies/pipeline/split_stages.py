"""What a pipeline stage needs when ``hybrid`` splits it further (the 3-D layouts).

Under ``hybrid`` a stage can be split by tensor parallel over the mesh's ``tensor`` axis
and sharded by FSDP2 over its data axes, in torchtitan's order (TP, then
``fully_shard``; HSDP when both ``replicate`` and ``shard`` are > 1). Its parameters
become DTensors, so its gradient norm and its whole state go through DTensor
collectives (the whole state: ``dtensor_params.whole_model_state``). :class:`SplitStages`
holds the rest for :class:`~paratrain.strategies.pipeline.strategy.PipelineStrategy`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh
from paratrain.distributed.topology import Topology
from paratrain.strategies.fsdp import FSDPOptions
from paratrain.strategies.tensor.plan import resolve_plan
from paratrain.strategies.tensor.strategy import (
    TPOptions,
    global_grad_norm,
    parallelize,
    scale_gradients,
)

__all__ = ["SplitStages", "check_split_options"]


def check_split_options(degrees: ParallelDegrees, *, num_local_stages: int,
                        fsdp: FSDPOptions, tp: TPOptions) -> None:
    """ValueError naming what a split stage cannot do yet."""
    if fsdp.offload:
        raise ValueError("fsdp offload inside a pipeline is not supported; use offload=False")
    if tp.sequence_parallel or tp.loss_parallel:
        raise ValueError("sequence_parallel and loss_parallel are not supported on pipeline "
                         "stages; leave them out of hybrid's tensor options")
    if num_local_stages > 1 and (degrees.shard_degree > 1 or degrees.tensor_degree > 1):
        raise ValueError("schedule 'interleaved_1f1b' with sharded or tensor-parallel "
                         "stages is not supported yet; use schedule '1f1b'")


class SplitStages:
    """Mix-in: tensor parallel and FSDP inside this rank's stage, and what follows from it."""

    mesh: ParallelMesh
    topology: Topology
    fsdp_options: FSDPOptions
    tp_options: TPOptions
    _mp_policy: Any

    def _split_stage(self, stage: nn.Module) -> None:
        """Tensor parallel, then FSDP, over this stage (the one composition)."""
        plan = (resolve_plan(stage, self.tp_options.plan)
                if self.mesh.degrees.tensor_degree > 1 else None)
        parallelize(stage, self.mesh, plan=plan, sharding=self.fsdp_options,
                    mp_policy=self._mp_policy)

    def _clip_dtensor_grads(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        # This stage's norm (DTensor reductions over the stage's mesh), then every stage's.
        squares = global_grad_norm(params).to(self.topology.device, torch.float64) ** 2
        dist.all_reduce(squares, group=self.mesh.group("pipeline"))
        norm = squares.sqrt().float()
        scale_gradients(params, norm, max_norm)
        return norm
