"""Horovod's lifetime, identity, compression and collectives (see :mod:`paratrain.horovod`)."""

from __future__ import annotations

import atexit
from typing import Any

import torch
import torch.distributed as dist

from paratrain.distributed.process_group import destroy_process_group, init_process_group
from paratrain.distributed.topology import Topology

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


__all__ = [
    "Average", "Compression", "Max", "Min", "Sum", "allgather",
    "allgather_object", "allreduce", "allreduce_", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "cross_rank", "cross_size",
    "gloo_enabled", "init", "is_initialized", "local_rank", "local_size", "mpi_enabled",
    "nccl_built", "rank", "shutdown", "size",
]
