"""The pipeline dimension of a layout: split the model into stages, run their schedule.

The model's layers are split into stages, one (or, interleaved, several) per rank of the
``pipeline`` axis. A batch is split into micro-batches that flow through the stages under
a ``torch.distributed.pipelining`` schedule: GPipe (all forwards, then all backwards),
1F1B (one forward, one backward in the steady state, so fewer activations are alive),
interleaved 1F1B (``v`` smaller stages per rank, in a loop) or the zero-bubble schedules
(interleaved zero bubble, ZB-V, DualPipeV: :mod:`.schedules`). Stages idle while the
pipeline fills and drains: the bubble is ``(p - 1) / (m + p - 1)`` of the step for ``p``
stages and ``m`` micro-batches, ``(p - 1) / (v m + p - 1)`` interleaved; :mod:`.bubble`
computes it for every schedule from torch's own plan.

The user's loop does not change: see :mod:`.deferred` for how
``loss = F.cross_entropy(model(x), y); run.backward(loss)`` becomes one schedule step.
``nn.Sequential`` models are split automatically (balanced by parameter count) or at
``split_points``; models with an embedding, a ``ModuleList`` of blocks and a head describe
themselves with a ``pipeline_layout()`` (:mod:`.layout`); Hugging Face models are described
by their model adapter (:mod:`.adapted`). Tied parameters on two stages stay one parameter
(:mod:`.ties`).

:class:`PipelineStages` is what the layout strategy holds when ``pp > 1``: the split, the
ties and the schedule step. The stage itself is then parallelized like any model (tensor
parallel, FSDP/HSDP over the data axes: replicas average gradients through FSDP, inside
the schedule, which delays the reduction to the last micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.mesh import ParallelMesh
from paratrain.parallel.options import Pipeline, Sharding, TensorParallel
from paratrain.strategies.clipping import clip_grad_norm, scale_gradients
from paratrain.strategies.pipeline.adapted import (
    AdaptedStage,
    adapted_layout,
    prepare_inputs,
    stage_sharding,
)
from paratrain.strategies.pipeline.layout import StageParts, layout_of, split_model, stage_layers
from paratrain.strategies.pipeline.module import PipelineModule
from paratrain.strategies.pipeline.outputs import OutputSpec
from paratrain.strategies.pipeline.schedules import (
    check_microbatches,
    microbatch_refusal,
    stage_indices,
    stage_rank,
)
from paratrain.strategies.pipeline.ties import TiedCopies

__all__ = ["PipelineStages", "check_stage_options"]


def check_stage_options(mesh: ParallelMesh, options: Pipeline, *, sharding: Sharding | None,
                        tensor: TensorParallel | None) -> None:
    """ValueError naming what a split stage cannot do yet."""
    d = mesh.degrees
    if sharding is not None and sharding.offload:
        raise ValueError("fsdp offload inside a pipeline is not supported; use offload=False")
    if tensor is not None and (tensor.sequence_parallel or tensor.loss_parallel):
        raise ValueError("sequence_parallel and loss_parallel are not supported on pipeline "
                         "stages; leave them out of the tensor options")
    if options.num_local_stages > 1 and (d.data_parallel_degree > 1 or d.tensor_degree > 1):
        raise ValueError(f"schedule '{options.schedule}' with replicated, sharded or "
                         "tensor-parallel stages is not supported yet; use schedule '1f1b'")
    p = d.pipeline_degree
    # The runtime takes the largest count <= microbatches that the batch divides and the
    # schedule runs: refuse now only when no count up to the requested one can run.
    if all(microbatch_refusal(options.schedule, m, p) for m in range(1, options.microbatches + 1)):
        check_microbatches(options.schedule, options.microbatches, p)
    if d.context_degree > 1 or d.expert_degree > 1:
        raise ValueError("a pipeline with cp or ep is not supported yet; drop pp, or cp/ep")


class PipelineStages:
    """This rank's stages of the pipeline and the step that runs their schedule.

    Args:
        mesh: the layout's mesh (``pipeline`` axis > 1).
        options: the pipeline's options.
        device: this process's device.
        rank: this process's global rank (rank 0 decides a measured split).
    """

    def __init__(self, mesh: ParallelMesh, options: Pipeline, *, device: torch.device,
                 rank: int) -> None:
        self.mesh, self.options, self.device, self.rank = mesh, options, device, rank
        self.ties: TiedCopies | None = None  # tied parameters on several stages
        self._prepare_inputs: Callable[[tuple, dict], tuple[tuple, dict]] | None = None
        self._adapted_blocks: str | None = None  # the blocks of an AdaptedStage
        self._outputs: OutputSpec | None = None  # what a Hugging Face model returns

    @property
    def ranks(self) -> int:
        return self.mesh.degrees.pipeline_degree

    def indices(self) -> list[int]:
        """This rank's stages, placed as torch's schedule expects: rank r runs stages r,
        r + p, r + 2p, ... (looped), or r and 2p - 1 - r (a V: zbv, dualpipev)."""
        return stage_indices(self.options.schedule, self.mesh.pipeline_rank, self.ranks,
                             self.options.num_local_stages)

    def split(self, model: nn.Module) -> StageParts:
        """``model`` cut into stages; this rank's parts (a collective for a measured split)."""
        stages, indices = self.ranks * self.options.num_local_stages, self.indices()
        if isinstance(model, nn.Sequential):
            return stage_layers(model, num_stages=stages, stage_indices=indices,
                                split_points=self.options.split_points)
        layout = layout_of(model)
        if layout is None:  # its model adapter describes it, or one line names the ways
            model, layout = adapted_layout(model)
            if isinstance(model, AdaptedStage):
                self._prepare_inputs = partial(prepare_inputs, model.model_class)
                self._adapted_blocks = layout.blocks
                self._outputs = model.outputs
        return split_model(model, layout, num_stages=stages, stage_indices=indices,
                           split_points=self.options.split_points, device=self.device,
                           agree=self._agree)

    def sharding(self, stage: nn.Module, options: Sharding) -> Sharding:
        """FSDP options for this stage (an adapted stage's blocks are its units)."""
        return stage_sharding(stage, self._adapted_blocks, options)

    def tie(self, parts: StageParts, split: frozenset[str]) -> None:
        """Agree on the parameters tied across stages (a collective: builds their groups)."""
        self.ties = TiedCopies(parts.ties, self.mesh, split=split, device=self.device,
                               rank_of=partial(stage_rank, self.options.schedule,
                                               num_ranks=self.ranks))

    def wrap(self, parts: StageParts) -> PipelineModule:
        """The stage module the run trains (its forward defers to the schedule)."""
        self.ties.bind(parts.whole)
        return PipelineModule(parts.whole, chunks=parts.chunks, stage_indices=self.indices(),
                              num_stages=self.ranks * self.options.num_local_stages,
                              group=self.mesh.group("pipeline"), device=self.device,
                              schedule=self.options.schedule,
                              num_microbatches=self.options.microbatches,
                              sharded=self.mesh.degrees.shard_degree > 1,
                              prepare_inputs=self._prepare_inputs, outputs=self._outputs)

    def _agree(self, measure: Callable[[], list[float]], count: int) -> list[float]:
        # Timings differ per process: rank 0 measures and decides the split for every
        # pipeline; the others only receive it.
        if self.rank == 0:
            tensor = torch.tensor(measure(), dtype=torch.float64, device=self.device)
        else:
            tensor = torch.zeros(count, dtype=torch.float64, device=self.device)
        dist.broadcast(tensor, src=0)
        return tensor.tolist()

    def backward(self, loss: Any, *, sync: bool) -> None:
        """One schedule step for ``loss``; tied copies' gradients summed when ``sync``."""
        from paratrain.strategies.pipeline.deferred import loss_chain

        root, _ = loss_chain(loss)
        root.context.module.run_step(loss)
        if sync and self.ties:
            self.ties.sum_gradients()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global norm covers every stage's gradients, a tied tensor's once."""
        params = [p for p in model.parameters() if p.grad is not None]
        ties = self.ties
        norm = clip_grad_norm(ties.counted(params) if ties else params, max_norm,
                              across=self.mesh.group("pipeline"), device=self.device)
        if ties:  # the copies the norm left out, scaled alike
            scale_gradients(ties.copies(params), norm, max_norm)
        return norm

    def gather_stages(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's state, in stage order, on every rank (collective over the pipeline).
        Pickled through CPU: a stage's tensors must not name another rank's device."""
        parts: list[Any] = [None] * self.ranks
        dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()},
                               group=self.mesh.group("pipeline"))
        return {k: v.to(self.device) for part in parts for k, v in part.items()}
