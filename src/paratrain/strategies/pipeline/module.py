"""The module a pipeline rank trains: its stage, driven by a ``torch.distributed.pipelining`` schedule.

Training mode: ``forward`` returns a :class:`~.pipeline_deferred.Deferred`; the
strategy's ``backward`` calls :meth:`PipelineModule.run_step`, which splits
the batch into micro-batches and runs one schedule step (forward, loss on the
last stage, backward) with the recorded loss. Evaluation mode (``eval()`` or
no grad): ``forward`` runs a forward-only schedule and broadcasts the output
from the last stage, so every stage returns the real output.

A schedule and its ``PipelineStage`` are built per (batch size, micro-batches)
because a stage infers the shapes it sends and receives once; every rank of the
pipeline sees the same batch, so all of them build the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed._compat import keep_forwards_only
from paratrain.strategies.pipeline.deferred import Deferred, Node, deferred_output, loss_chain
from paratrain.strategies.pipeline.outputs import OutputSpec
from paratrain.strategies.pipeline.schedules import (
    SCHEDULE_CLASSES,
    SPLIT_BACKWARD,
    V_SHAPED,
    microbatch_refusal,
    stage_rank,
)

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8)
_MAX_DIMS = 8


@dataclass
class _Forward:
    """What ``forward`` recorded: the inputs and the autocast state to replay them in."""

    args: tuple
    kwargs: dict
    autocast_dtype: torch.dtype | None
    module: PipelineModule
    shape: tuple[int, ...] | None = None
    """The output's shape, when the strategy knows it (a Hugging Face model's logits)."""


def microbatches_for(batch_size: int, requested: int, *, schedule: str = "gpipe",
                     num_ranks: int = 1) -> int:
    """The largest number of equal micro-batches <= ``requested`` that divides the batch
    and that ``schedule`` runs over ``num_ranks`` ranks (an interleaved schedule needs equal
    rounds, ``m % max(1, m // ranks) == 0``; ``dualpipev`` at least ``2 ranks``)."""
    fits = [m for m in range(1, min(requested, batch_size) + 1)
            if batch_size % m == 0 and microbatch_refusal(schedule, m, num_ranks) is None]
    if not fits:
        raise ValueError(f"a batch of {batch_size} has no number of micro-batches up to "
                         f"{requested} that schedule '{schedule}' runs over {num_ranks} ranks "
                         "(dualpipev: at least 2 x pp); use a larger batch or another schedule")
    return max(fits)


_SCALING = {"mul", "multiply", "__mul__", "__rmul__", "div", "divide", "true_divide",
            "__truediv__", "neg", "__neg__"}


def _sums(node: Node) -> bool:
    return node.kwargs.get("reduction") == "sum" or getattr(node.func, "sums_microbatches",
                                                              False)


def check_chain(chain: list[Node]) -> None:
    """ValueError in one line for a recorded loss whose per-micro-batch replay would not
    add up to the loss one process computes."""
    summed = False
    for node in chain:
        name = getattr(node.func, "__name__", repr(node.func))
        others = [a for a in (*node.args, *node.kwargs.values()) if not isinstance(a, Deferred)]
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in others):
            raise ValueError(
                f"the pipeline loss passes a tensor that requires grad but does not come "
                f"from the model's output to {name}; the schedule replays the loss on each "
                "micro-batch's output only: compute such a term (a regulariser) outside "
                "the pipelined loss")
        if summed and (name not in _SCALING or any(
                isinstance(a, torch.Tensor) and a.dim() > 0 for a in others)):
            raise ValueError(
                f"a summed pipeline loss (reduction='sum', or the model's own loss from "
                f"labels=) may only be scaled after it (loss * c, loss / c), got {name}: the "
                "micro-batches' parts are added up; apply it to a mean loss instead")
        summed = summed or _sums(node)


def _split(value: Any, batch_size: int, num_microbatches: int) -> list[Any]:
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch_size:
        return list(torch.tensor_split(value, num_microbatches))
    return [value] * num_microbatches


class PipelineModule(nn.Module):
    """One pipeline stage plus the schedules that drive it.

    Args:
        stage_module: this rank's layers (parameter names as in the full model).
        chunks: the stages this rank runs, sharing their layers with ``stage_module``
            (one: ``stage_module`` itself; several under an interleaved schedule).
        stage_indices: the chunks' positions, 0 .. num_stages - 1 (rank ``r`` of ``p``
            runs ``r, r + p, ...``, or ``r, 2p - 1 - r`` in a V).
        num_stages: stages in the whole pipeline (ranks x stages per rank).
        group: the process group of this pipeline (its rank ``i`` is stage ``i``).
        device: compute device.
        schedule: a name of :data:`~.schedules.SCHEDULE_CLASSES`.
        num_microbatches: micro-batches per step (fewer when the batch does not divide).
        sharded: the stage's forward communicates with other data-parallel ranks (FSDP),
            so evaluation runs each batch as one micro-batch: their evaluation batches
            can differ in size, and so would the number of micro-batches that divide them.
        prepare_inputs: ``(args, kwargs) -> (args, kwargs)`` run on every rank before a
            schedule (the inputs the first stage takes; refuses what cannot cross stages).
        outputs: what the model returns (:class:`~.outputs.OutputSpec`, a Hugging Face
            model's output object with ``logits`` and ``loss``); None: the last stage's
            output as it is.
    """

    def __init__(self, stage_module: nn.Module, *, chunks: list[nn.Module],
                 stage_indices: list[int], num_stages: int,
                 group: dist.ProcessGroup, device: torch.device, schedule: str,
                 num_microbatches: int, sharded: bool = False,
                 prepare_inputs: Callable[[tuple, dict], tuple[tuple, dict]] | None = None,
                 outputs: OutputSpec | None = None) -> None:
        super().__init__()
        self.prepare_inputs = prepare_inputs
        self.outputs = outputs
        self.tied_names: dict[str, str] = {}
        """A tied tensor's other names -> the name the full model gives it first (a head
        on the last stage tied to the embedding: how checkpoints without it name it)."""
        self.sharded = sharded
        self.stage_module = stage_module
        # Not registered: their parameters are stage_module's, under the same names.
        self._chunks = list(chunks)
        self.stage_indices = list(stage_indices)
        self.num_stages = num_stages
        self.num_ranks = group.size()
        self.group = group
        self.device = device
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        self._schedules: dict[tuple, Any] = {}
        self._step: dict[str, Any] = {}
        self._last_rank = dist.get_global_rank(
            group, stage_rank(schedule, num_stages - 1, self.num_ranks))

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.prepare_inputs is not None:
            args, kwargs = self.prepare_inputs(args, kwargs)
        spec = self.outputs
        labels = kwargs.pop("labels", None) if spec is not None else None
        if spec is not None:
            spec.check_labels(labels)  # on every rank, before any stage runs
        if self.training and torch.is_grad_enabled():
            device_type = self.device.type
            dtype = (torch.get_autocast_dtype(device_type)
                     if torch.is_autocast_enabled(device_type) else None)
            shape = spec.logits_shape(args[0]) if spec is not None else None
            output = deferred_output(_Forward(args, kwargs, dtype, self, shape), shape,
                                     self.device)
            return output if spec is None else spec.training_output(output, labels)
        output = self._forward_only(args, kwargs)
        return output if spec is None else spec.evaluation_output(output, labels)

    # -- schedules --------------------------------------------------------------
    def _schedule_name(self, train: bool) -> str:
        # Evaluation runs forwards only: any schedule of the same placement computes the
        # same outputs; ZB-V runs any number of micro-batches (DualPipeV needs 2 pp).
        if train or len(self._chunks) == 1:
            return self.schedule_name
        return "zbv" if self.schedule_name in V_SHAPED else "interleaved_1f1b"

    def _schedule(self, batch_size: int, num_microbatches: int, train: bool) -> Any:
        from torch.distributed import pipelining

        name = self._schedule_name(train)
        # 1F1B needs at least as many micro-batches as stages; GPipe computes the same.
        one_f_one_b = train and name == "1f1b" and num_microbatches >= self.num_ranks
        key = (batch_size, num_microbatches, train, one_f_one_b)
        if key not in self._schedules:
            stages = [pipelining.PipelineStage(chunk, index, self.num_stages, self.device,
                                               group=self.group)
                      for chunk, index in zip(self._chunks, self.stage_indices)]
            # scale_grads=False: the schedule would divide the *accumulated* gradients
            # by m; the loss of each micro-batch is divided instead (see _loss_fn).
            kwargs = {"n_microbatches": num_microbatches, "scale_grads": False,
                      "loss_fn": self._loss_fn if train else None}
            if len(stages) > 1:
                if train and name in SPLIT_BACKWARD:
                    self._refuse_compiled(name)
                cls = getattr(pipelining, SCHEDULE_CLASSES[name], None)
                if cls is None:
                    raise ValueError(f"schedule '{name}' needs a torch with "
                                     f"{SCHEDULE_CLASSES[name]}, torch {torch.__version__} "
                                     "has none; choose another schedule")
                schedule = cls(stages, **kwargs)
                # torch runs a V schedule's backward actions without a loss too (and fails)
                self._schedules[key] = (schedule if train or name not in V_SHAPED
                                        else keep_forwards_only(schedule))
            else:
                cls = pipelining.Schedule1F1B if one_f_one_b else pipelining.ScheduleGPipe
                self._schedules[key] = cls(stages[0], **kwargs)
        return self._schedules[key]

    def _refuse_compiled(self, name: str) -> None:
        # compile replaces a module's forward on the instance (paratrain.compile); torch
        # splits no compiled backward (an opaque RuntimeError mid-step). Every rank of the
        # pipeline decides together, so none is left waiting for a refusing one.
        compiled = [n or "the stage" for chunk in self._chunks
                    for n, m in chunk.named_modules() if "forward" in vars(m)]
        flag = torch.tensor([float(bool(compiled))], device=self.device)
        if self.num_ranks > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            where = f" ({compiled[0]} here)" if compiled else ""
            raise ValueError(f"schedule '{name}' splits each backward into the input's and "
                             f"the weights' part, which torch cannot do on compiled "
                             f"modules{where}; use compile=False or schedule "
                             "'interleaved_1f1b'")

    def _microbatches(self, batch_size: int, train: bool = True) -> int:
        return microbatches_for(batch_size, self.num_microbatches,
                                schedule=self._schedule_name(train),
                                num_ranks=self.num_ranks)

    def _batch_size(self, args: tuple) -> int:
        for value in args:
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                return value.shape[0]
        raise ValueError("a pipeline model's first argument must be a batched tensor")

    def _inputs(self, args: tuple, kwargs: dict, batch_size: int, m: int) -> dict[str, Any]:
        if not self.is_first:
            return {}
        arg_mbs = list(zip(*[_split(a, batch_size, m) for a in args]))
        kwarg_mbs = [{k: _split(v, batch_size, m)[i] for k, v in kwargs.items()}
                     for i in range(m)]
        return {"arg_mbs": arg_mbs, "kwarg_mbs": kwarg_mbs}

    # -- training ---------------------------------------------------------------
    def run_step(self, loss: Any) -> None:
        """Run the schedule for the batch behind ``loss`` and resolve the loss chain."""
        root, chain = loss_chain(loss)
        recorded: _Forward = root.context
        batch_size = self._batch_size(recorded.args)
        m = self._microbatches(batch_size)
        # A mean loss per micro-batch is scaled by 1/m; a sum (reduction="sum", or the
        # model's own loss divided by the whole batch's token count) is not.
        check_chain(chain)  # on every rank, before any stage runs
        summed = any(_sums(node) for node in chain)
        self._step = {"chain": chain, "batch": batch_size, "m": m,
                      "scale": 1.0 if summed else 1.0 / m, "records": [{} for _ in chain]}
        if recorded.shape is not None:
            # Every rank replays the chain on one micro-batch's shapes first: a loss that
            # cannot be replayed is refused everywhere, not by the last stage alone.
            meta = torch.empty((recorded.shape[0] // m, *recorded.shape[1:]), device="meta")
            self._replay(meta, 0, meta=True)
        schedule = self._schedule(batch_size, m, train=True)
        autocast = (torch.autocast(self.device.type, dtype=recorded.autocast_dtype)
                    if recorded.autocast_dtype is not None else torch.autocast(
                        self.device.type, enabled=False))
        with autocast:
            schedule.step(**self._inputs(recorded.args, recorded.kwargs, batch_size, m),
                          target_mbs=[torch.tensor(i) for i in range(m)], return_outputs=False)
        self._resolve(chain, summed)
        self._step = {}

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The "target" is the micro-batch index: the loss's own arguments were split
        # in run_step. A stage's first step also calls this once to infer shapes;
        # keying records by index lets the real call for micro-batch 0 overwrite it.
        index = int(target)
        value = self._replay(output, index)
        # The schedule backpropagates each micro-batch's loss separately; 1/m makes
        # their sum the gradient of the batch mean.
        return value * self._step["scale"]

    def _piece(self, arg: Any, positional: bool, parent: torch.Tensor, index: int,
               meta: bool) -> Any:
        """Micro-batch ``index``'s piece of a recorded argument: split along dim 0 when
        that is the batch, or (positional) ``m`` times the micro-batch value's dim 0."""
        if not isinstance(arg, torch.Tensor) or isinstance(arg, Deferred) or arg.dim() == 0:
            return arg
        rows, m = arg.shape[0], self._step["m"]
        if rows == self._step["batch"] or (positional and parent.dim() >= 1
                                           and rows == m * parent.shape[0]):
            arg = torch.tensor_split(arg, m)[index]
        return arg.to("meta") if meta else arg

    def _replay(self, value: torch.Tensor, index: int, meta: bool = False) -> torch.Tensor:
        """The recorded chain on micro-batch ``index``'s output ``value``."""
        for node, records in zip(self._step["chain"], self._step["records"]):
            parent = value
            try:
                value = node.call(parent, lambda a, positional, parent=parent: self._piece(
                    a, positional, parent, index, meta))
            except (RuntimeError, ValueError, IndexError, TypeError,
                    NotImplementedError) as exc:
                if meta and (isinstance(exc, NotImplementedError) or "meta" in str(exc)
                             or "data-dependent" in str(exc)):
                    return value  # no meta kernel (data-dependent): the real replay decides
                name = getattr(node.func, "__name__", repr(node.func))
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                    type(exc).__name__
                raise ValueError(
                    f"the pipeline replays {name} on each micro-batch ({self._step['m']} of "
                    f"{self._step['batch']} samples) and it failed: {detail}; take sizes from "
                    "the output as -1 (out.view(-1, V)) and give targets batch first, split "
                    "like the input (y, y.flatten(), y[:, 1:])") from None
            if not meta:
                records[index] = value.detach()
        if value.dim() != 0:
            raise ValueError("the pipeline loss must be a scalar (reduce it with mean or sum)")
        return value

    def _resolve(self, chain: list[Node], summed: bool) -> None:
        # Row 0: the values; row 1: 1 where the node is a scalar (a NaN loss is a value
        # too: it must reach every stage, for the run's non-finite check).
        values = torch.zeros((2, len(chain)), dtype=torch.float64, device=self.device)
        if self.is_last:
            for i, records in enumerate(self._step["records"]):
                if records and records[0].dim() == 0:
                    stacked = torch.stack([r.double() for r in records.values()])
                    values[0, i] = stacked.sum() if summed else stacked.mean()
                    values[1, i] = 1
        if self.num_ranks > 1:
            # Only the last stage computed the loss: every stage reports the same value.
            dist.broadcast(values, src=self._last_rank, group=self.group)
        for node, (value, scalar) in zip(chain, zip(*values.tolist())):
            if scalar:
                node.value = torch.tensor(value, dtype=torch.float32, device=self.device)

    # -- evaluation ---------------------------------------------------------------
    @torch.no_grad()
    def _forward_only(self, args: tuple, kwargs: dict) -> torch.Tensor:
        batch_size = self._batch_size(args)
        m = 1 if self.sharded else self._microbatches(batch_size, train=False)
        schedule = self._schedule(batch_size, m, train=False)
        output = schedule.step(**self._inputs(args, kwargs, batch_size, m))
        if self.num_ranks == 1:
            return output
        return self._broadcast_output(output)

    def _broadcast_output(self, output: torch.Tensor | None) -> torch.Tensor:
        meta = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        if self.is_last:
            if not isinstance(output, torch.Tensor) or output.dim() > _MAX_DIMS:
                raise ValueError("a pipeline model must return one tensor of at most 8 dims")
            meta[0], meta[1] = output.dim(), _DTYPES.index(output.dtype)
            meta[2:2 + output.dim()] = torch.tensor(output.shape)
        dist.broadcast(meta, src=self._last_rank, group=self.group)
        ndim, dtype = int(meta[0]), _DTYPES[int(meta[1])]
        if not self.is_last:
            output = torch.empty(meta[2:2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.broadcast(output, src=self._last_rank, group=self.group)
        return output
