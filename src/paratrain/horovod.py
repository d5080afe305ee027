"""Horovod's PyTorch API (the commonly used subset) on top of paratrain and torch.distributed.

A Horovod script runs under ``paratrain launch`` after changing only its import:

    >>> import paratrain.horovod as hvd                     # was: import horovod.torch as hvd
    >>> hvd.init()                                           # doctest: +SKIP
    >>> optimizer = hvd.DistributedOptimizer(                # doctest: +SKIP
    ...     optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=2)
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)      # doctest: +SKIP
    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)          # doctest: +SKIP

The ranks come from the launcher's environment through :class:`paratrain.Topology`;
collectives are torch.distributed ones (gloo on CPU, NCCL on CUDA). Horovod's API is
built on process-wide state (``hvd.rank()`` takes no arguments), so this module keeps
one private :class:`_State`; nothing else in paratrain reads it.

Not provided: Adasum, process sets, elastic training, sparse gradients, tensor fusion
(each gradient is reduced on its own, overlapping the rest of the backward pass).
"""

from __future__ import annotations

import atexit
import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from paratrain.runtime import destroy_process_group, init_process_group
from paratrain.topology import Topology

# Reduction ops, under Horovod's names.
Average, Sum, Min, Max = "average", "sum", "min", "max"
_DIST_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM,
             Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX}


class _State:
    topology: Topology | None = None
    owns_group = False


_state = _State()


# -- lifetime and identity ------------------------------------------------------------
def init(comm: Any = None, *, timeout_s: float = 300.0) -> None:
    """Join the job started by ``paratrain launch`` (or torchrun, SLURM, Open MPI).

    Unlaunched, this is a job of one process. ``comm`` (an MPI communicator in
    Horovod) is not supported.
    """
    if comm is not None:
        raise ValueError("init(comm=...) is not supported: start the job with `paratrain launch` "
                         "and call hvd.init() without arguments")
    if _state.topology is not None:
        return
    topology = Topology.from_env()
    _state.owns_group = init_process_group(topology, timeout_s=timeout_s)
    _state.topology = topology
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the job: destroy the process group created by :func:`init`."""
    if _state.owns_group:
        destroy_process_group()
    _state.topology, _state.owns_group = None, False


def is_initialized() -> bool:
    return _state.topology is not None


def _topology() -> Topology:
    if _state.topology is None:
        raise ValueError("paratrain.horovod has not been initialized; call hvd.init() first")
    return _state.topology


def rank() -> int:
    """Global rank of this process."""
    return _topology().rank


def size() -> int:
    """Number of processes in the job."""
    return _topology().world_size


def local_rank() -> int:
    """Rank among the processes on this node (use it to pick the GPU)."""
    return _topology().local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return _topology().local_world_size


def cross_rank() -> int:
    """Index of this node."""
    return _topology().node_rank


def cross_size() -> int:
    """Number of nodes."""
    return _topology().num_nodes


def nccl_built() -> bool:
    return dist.is_nccl_available()


def gloo_enabled() -> bool:
    return dist.is_gloo_available()


def mpi_enabled() -> bool:
    return False


# -- compression -------------------------------------------------------------------
class NoneCompressor:
    """Send gradients as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Send floating-point tensors as float16 (half the bytes); restore the dtype after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """Gradient compression choices, as in Horovod: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


# -- collectives ---------------------------------------------------------------------
def _resolve_op(op: str | None, average: bool | None) -> str:
    if op is None:
        op = Sum if average is False else Average
    if op not in _DIST_OPS:
        raise ValueError(f"op must be one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, got {op!r}")
    return op


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None, compression: Any = NoneCompressor,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` in place across all processes and return it."""
    op = _resolve_op(op, average)
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    if size() > 1:
        buffer = tensor.detach()
        sent, ctx = compression.compress(buffer)
        staged = sent.contiguous()
        dist.all_reduce(staged, op=_DIST_OPS[op])
        result = compression.decompress(staged, ctx)
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)
    if op == Average and size() > 1:
        tensor.div_(size())
    if postscale_factor != 1.0:
        tensor.mul_(postscale_factor)
    return tensor


class _AllreduceFunction(torch.autograd.Function):
    """Differentiable all-reduce: the gradient of an average is the average of the gradients."""

    @staticmethod
    def forward(ctx, tensor, op, compression):  # noqa: ANN001 - autograd signature
        ctx.op = op
        return allreduce_(tensor.detach().clone(), op=op, compression=compression)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        if ctx.op not in (Average, Sum):
            raise RuntimeError("hvd.allreduce with op Min or Max is not differentiable")
        return allreduce_(grad.clone(), op=ctx.op), None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = NoneCompressor, op: str | None = None) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced across processes (averaged by default).

    Example:
        >>> mean_loss = hvd.allreduce(loss.detach(), name="loss")   # doctest: +SKIP
    """
    return _AllreduceFunction.apply(tensor, _resolve_op(op, average), compression)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate ``tensor`` from every process along dimension 0 (first sizes may differ)."""
    if size() == 1:
        return tensor.detach().clone()
    tensor = tensor.detach().contiguous()
    length = torch.tensor([tensor.shape[0] if tensor.dim() else 1], device=tensor.device)
    lengths = [torch.zeros_like(length) for _ in range(size())]
    dist.all_gather(lengths, length)
    longest = int(max(int(n) for n in lengths))
    padded = tensor.reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.reshape(1)
    if padded.shape[0] < longest:
        filler = padded.new_zeros((longest - padded.shape[0], *padded.shape[1:]))
        padded = torch.cat([padded, filler])
    parts = [torch.empty_like(padded) for _ in range(size())]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(n)] for part, n in zip(parts, lengths)])


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s value and return it."""
    if size() > 1:
        buffer = tensor.detach()
        staged = buffer if buffer.is_contiguous() else buffer.contiguous()
        dist.broadcast(staged, src=root_rank)
        if staged is not buffer:
            buffer.copy_(staged)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s value of ``tensor``."""
    return broadcast_(tensor.detach().clone(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` (any picklable object) on every process."""
    if size() == 1:
        return obj
    holder = [obj if rank() == root_rank else None]
    dist.broadcast_object_list(holder, src=root_rank)
    return holder[0]


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every process's ``obj``, as a list indexed by rank."""
    if size() == 1:
        return [obj]
    gathered: list[Any] = [None] * size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy ``root_rank``'s parameters to every process, in place.

    ``params`` is a ``state_dict()`` or an iterable of ``(name, tensor)`` pairs such as
    ``model.named_parameters()``. Call it after building the model so that all ranks
    start from the same weights.
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in items):
        raise ValueError("params must be a state_dict or (name, tensor) pairs, e.g. "
                         "model.named_parameters()")
    for _, tensor in items:
        if isinstance(tensor, torch.Tensor):
            broadcast_(tensor, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every process ``root_rank``'s optimizer state and hyper-parameters (e.g. after a
    resume on rank 0 only)."""
    if size() == 1:
        return
    state = broadcast_object(optimizer.state_dict() if rank() == root_rank else None, root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


# -- the distributed optimizer ---------------------------------------------------------
class _DistributedOptimizerMixin:
    """What :func:`DistributedOptimizer` adds to the user's optimizer class.

    Each parameter's gradient is all-reduced as soon as its last backward pass of the
    step has produced it (a post-accumulate-grad hook), so communication overlaps the
    rest of the backward pass. Reductions are started in one fixed order (reverse
    parameter order, which is roughly the order backward produces them) on every rank:
    torch.distributed matches collectives by order, not by name as Horovod does.
    """

    def _hvd_setup(self, named_parameters: Iterable[tuple[str, Any]] | None, compression: Any,
                   backward_passes_per_step: int, op: str,
                   gradient_predivide_factor: float) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            pairs = list(named_parameters)
            if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
                raise ValueError("named_parameters must be (name, parameter) pairs, usually "
                                 "model.named_parameters()")
            names = [name for name, _ in pairs]
            duplicates = sorted({name for name in names if names.count(name) > 1})
            if duplicates:
                raise ValueError(f"named_parameters has duplicate names: {duplicates}")
            named = {id(p) for _, p in pairs}
            if any(id(p) not in named for p in params):
                raise ValueError("named_parameters was given but does not name every parameter "
                                 "of the optimizer; pass model.named_parameters() of the whole model")
        self._hvd_compression = compression
        self._hvd_op = op
        self._hvd_predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_order = [p for p in reversed(params) if p.requires_grad]
        self._hvd_hooks = []
        self._hvd_should_synchronize = True
        self._hvd_synchronized = False
        self._hvd_reset()
        if size() > 1:
            self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_on_grad)
                               for p in self._hvd_order]

    def _hvd_reset(self) -> None:
        self._hvd_passes = {id(p): 0 for p in self._hvd_order}
        self._hvd_ready: set[int] = set()
        self._hvd_next = 0
        self._hvd_pending: list[tuple[torch.Tensor, Any, torch.Tensor, Any]] = []

    def _hvd_on_grad(self, param: torch.Tensor) -> None:
        passes = self._hvd_passes[id(param)] + 1
        if passes > self.backward_passes_per_step:
            raise AssertionError(
                f"gradients were computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before step(); raise "
                "backward_passes_per_step to accumulate gradients locally")
        self._hvd_passes[id(param)] = passes
        if passes == self.backward_passes_per_step:
            self._hvd_ready.add(id(param))
            self._hvd_launch(only_ready=True)

    def _hvd_launch(self, *, only_ready: bool) -> None:
        while self._hvd_next < len(self._hvd_order):
            param = self._hvd_order[self._hvd_next]
            if only_ready and id(param) not in self._hvd_ready:
                return  # keep the fixed order: wait for this one before starting later ones
            if param.grad is None:
                # This rank produced no gradient, another may have: reduce zeros.
                param.grad = torch.zeros_like(param)
            sent, ctx = self._hvd_compression.compress(param.grad)
            sent = sent.contiguous()
            if self._hvd_op == Average and self._hvd_predivide != 1.0:
                sent.div_(self._hvd_predivide)
            work = dist.all_reduce(sent, op=dist.ReduceOp.SUM, async_op=True)
            self._hvd_pending.append((param, ctx, sent, work))
            self._hvd_next += 1

    def synchronize(self) -> None:
        """Wait for every gradient reduction and write the results into ``.grad``."""
        if size() > 1:
            self._hvd_launch(only_ready=False)
            scale = self._hvd_predivide / size() if self._hvd_op == Average else 1.0
            for param, ctx, sent, work in self._hvd_pending:
                work.wait()
                result = self._hvd_compression.decompress(sent, ctx)
                if result is not param.grad:
                    param.grad.copy_(result)
                if scale != 1.0:
                    param.grad.mul_(scale)
            self._hvd_reset()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` skip the synchronisation already done by :meth:`synchronize`.

        Example (clipping the averaged gradients):
            >>> optimizer.synchronize()                                   # doctest: +SKIP
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # doctest: +SKIP
            >>> with optimizer.skip_synchronize():                        # doctest: +SKIP
            ...     optimizer.step()
        """
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        self._hvd_reset()

    def step(self, closure: Any = None) -> Any:
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): the gradients are reduced twice",
                              stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_pending or any(self._hvd_passes.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        self._hvd_reset()
        self._hvd_synchronized = False
        super().load_state_dict(state_dict)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, Any]] | None = None,
                         compression: Any = NoneCompressor, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all processes.

    The result is still an instance of the optimizer's class and shares its state and
    parameter groups. With ``backward_passes_per_step=N`` the gradients of N backward
    passes are summed locally and reduced once, before the N-th pass's ``step()``;
    as in Horovod, scale the loss by ``1/N`` if the update should use their mean.
    ``num_groups``/``groups`` (Horovod's grouped all-reduce) are accepted and ignored.
    """
    _topology()
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum (Adasum is not supported), got {op!r}")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if op != Average and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {})
    wrapped = cls.__new__(cls)
    # Share state and param groups; drop per-instance wrappers of step (e.g. an LR
    # scheduler's) so that calls reach the synchronising step.
    wrapped.__dict__.update({k: v for k, v in vars(optimizer).items()
                             if k not in ("step", "zero_grad")})
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor)
    return wrapped


__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Sum", "allgather",
    "allgather_object", "allreduce", "allreduce_", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "cross_rank", "cross_size",
    "gloo_enabled", "init", "is_initialized", "local_rank", "local_size", "mpi_enabled",
    "nccl_built", "rank", "shutdown", "size",
]
