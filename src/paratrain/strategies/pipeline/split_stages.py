"""What a pipeline stage needs when ``hybrid`` splits it further (the 3-D layouts).

Under ``hybrid`` a stage can be split by tensor parallel over the mesh's ``tensor`` axis
and sharded by FSDP2 over its data axes, in torchtitan's order (TP, then
``fully_shard``; HSDP when both ``replicate`` and ``shard`` are > 1). Its parameters
become DTensors, so its gradient norm and its whole state go through DTensor
collectives (the norm: :mod:`paratrain.strategies.clipping`; the whole state:
``dtensor_params.whole_model_state``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh
from paratrain.strategies.fsdp import FSDPOptions
from paratrain.strategies.tensor.plan import resolve_plan
from paratrain.strategies.tensor.strategy import TPOptions, parallelize

__all__ = ["check_split_options", "split_stage", "stage_plan"]


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


def stage_plan(stage: nn.Module, mesh: ParallelMesh, tp: TPOptions) -> dict[str, str] | None:
    """The tensor-parallel plan of this rank's stage; None without tensor parallel."""
    return resolve_plan(stage, tp.plan) if mesh.degrees.tensor_degree > 1 else None


def split_stage(stage: nn.Module, mesh: ParallelMesh, *, sharding: FSDPOptions,
                plan: dict[str, str] | None, mp_policy: Any) -> None:
    """Tensor parallel (``plan``, from :func:`stage_plan`), then FSDP, over this rank's
    stage (the one composition)."""
    parallelize(stage, mesh, plan=plan, sharding=sharding, mp_policy=mp_policy)
