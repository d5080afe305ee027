"""Every private torch API paratrain uses, in one place, each behind a guard.

Private APIs change between torch releases without notice. Keeping them here means a
torch upgrade that removes one breaks a single function, which then either degrades
(returns "unknown") or raises one line naming the API and the torch version, instead
of an AttributeError deep in a training step. ``tests/distributed/test_compat.py``
exercises each function on the installed torch. The pipelining and compiler internals
live in this package's two submodules and are re-exported here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single", "collective_sequence_number", "ddp_buffer_sync_kwargs", "default_store",
    "flattened_group", "make_tensor_subclass", "shard_indices", "nvml_device_index", "rebind_lr_scheduler", "release_ddp_reducer",
    "allow_recompiles", "compile_backend", "compiled_by_user", "detect_fake_mode", "global_flop_counter", "is_fake", "torch_function_disabled", "transposed_linear_style",
    "tree_leaves", "tree_map", "keep_forwards_only", "schedule_actions", "hash_tensor",
    "clear_dtensor_caches", "torch_modes_active",
]


from paratrain.distributed._compat.compiler import (
    allow_recompiles,
    compile_backend,
    compiled_by_user,
    detect_fake_mode,
    global_flop_counter,
    is_fake,
    tree_leaves,
)
from paratrain.distributed._compat.errors import missing as _missing
from paratrain.distributed._compat.pipelining import keep_forwards_only, schedule_actions


def collective_sequence_number() -> int:
    """How many collectives the default group has issued on this rank; -1 if unknown.

    There is no public API for it. Where a torch version lacks the private one, every
    rank reports -1, so comparisons across ranks still agree.
    """
    try:
        group = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError, ValueError):
        return -1


def default_store() -> Any:
    """The job's key-value store, or None where it is unavailable (no group, old torch)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def release_ddp_reducer(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Drop a DDP module's reducer, which holds the process group alive.

    Without it, destroying the group while a wrapped model is still referenced leaves a
    reducer pointing at a freed communicator (see ``process_group.destroy_process_group``).
    """
    if hasattr(ddp, "reducer"):
        ddp.reducer = None  # type: ignore[assignment]


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of nested lists/tuples/dicts (torch's pytree)."""
    try:
        from torch.utils._pytree import tree_map as torch_tree_map
    except ImportError:
        raise _missing("torch.utils._pytree.tree_map") from None
    return torch_tree_map(fn, tree)


def make_tensor_subclass(cls: type, data: torch.Tensor, requires_grad: bool = False) -> Any:
    """An instance of the tensor subclass ``cls`` sharing ``data``'s storage."""
    make = getattr(torch.Tensor, "_make_subclass", None)
    if make is None:
        raise _missing("torch.Tensor._make_subclass")
    return make(cls, data, requires_grad)


def nvml_device_index(device: torch.device) -> int:
    """NVML's index of a CUDA device named by UUID in ``CUDA_VISIBLE_DEVICES``."""
    lookup = getattr(torch.cuda, "_get_nvml_device_index", None)
    if lookup is None:
        raise _missing("torch.cuda._get_nvml_device_index")
    return int(lookup(device))


def ddp_buffer_sync_kwargs(sync: bool) -> dict[str, bool]:
    """DDP's keyword for syncing buffers in forward (torch 2.14 renamed
    ``broadcast_buffers`` to ``forward_sync_buffers``)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}


def torch_function_disabled() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called."""
    disable = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    if disable is None:
        raise _missing("torch._C.DisableTorchFunctionSubclass")
    return disable()


def in_backward() -> bool:
    """True while autograd runs a backward (e.g. activation checkpointing's recompute)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is None:
        raise _missing("torch._C._current_graph_task_id")
    return task() != -1


def hash_tensor(tensor: torch.Tensor) -> int | None:
    """``torch.hash_tensor`` (an xor of the elements' 64-bit patterns, reduced where the
    tensor lives) as an int; None where this torch lacks it or the dtype (float8, complex)
    or an empty tensor is refused, so the caller falls back to hashing the bytes."""
    hasher = getattr(torch, "hash_tensor", None)
    if hasher is None or tensor.numel() == 0:
        return None
    try:
        return int(hasher(tensor))
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def rebind_lr_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` drive ``optimizer`` (a strategy's rebuild of the one it was made for).

    ``LRScheduler`` wraps its optimizer's ``step`` to check the call order
    (``_opt_called``, ``_wrapped_by_lr_sched``, private); the new optimizer gets the same
    wrapper, so the scheduler neither warns nor loses count.
    """
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def all_gather_single(output: torch.Tensor, piece: torch.Tensor, group: Any, *,
                      async_op: bool = False) -> Any:
    """Every rank's equal-sized ``piece``, concatenated into ``output``, in one collective
    (its work handle with ``async_op``).

    ``all_gather_single`` where torch has it; older torch calls it
    ``all_gather_into_tensor`` (deprecated since).
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, piece, group=group, async_op=async_op)


def flattened_group(mesh: Any, name: str | None = None) -> dist.ProcessGroup:
    """The process group over all of ``mesh``'s ranks, in row-major mesh order.

    ``DeviceMesh._flatten`` (private) builds it once per mesh (a collective the first
    time: every rank of the root mesh asks at the same point) and caches it; with
    ``name`` the root mesh can then be sliced by that name (``mesh["replicate", name]``).
    """
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise _missing("DeviceMesh._flatten")
    return (flatten(name) if name else flatten()).get_group()


def shard_indices(global_shape: Sequence[int], mesh_shape: Sequence[int],
                  coordinate: Sequence[int], placements: Sequence[Any]) -> list[torch.Tensor]:
    """Per tensor dimension, the global indices the rank at ``coordinate`` holds.

    DTensor's own arithmetic (``_get_shard_size_and_offsets``, private), which also
    knows ``_StridedShard`` (FSDP over tensor-parallel pieces): those pieces are not
    one slice from one offset in general, hence whole index lists.
    """
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    except ImportError as error:
        raise _missing("torch.distributed.tensor._utils._get_shard_size_and_offsets") from error
    sizes = list(global_shape)
    indices: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate() or placement.is_partial():
            continue
        dim = placement.dim
        sizes[dim], indices[dim] = _get_shard_size_and_offsets(
            sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim], placement,
            indices.get(dim), global_shape[dim], False)
    # A rank with an empty piece gets a placeholder offset: keep no index then.
    return [indices[d][:sizes[d]] if d in indices else torch.arange(n)
            for d, n in enumerate(global_shape)]


def transposed_linear_style(style: str, **options: Any) -> Any:
    """torch's ``ColwiseParallel`` (``style="colwise"``) or ``RowwiseParallel`` for a layer
    whose weight is stored ``(in_features, out_features)``: Hugging Face's ``Conv1D``.

    torch's styles split only ``nn.Linear`` (weight ``(out, in)``) and ``nn.Embedding``;
    this one splits the other weight dimension and reuses their input and output hooks
    (private static methods), so the layer's forward (``addmm`` on DTensors) and its
    communication are those of a linear split the same way.
    """
    from functools import partial

    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[style]
    if not all(hasattr(base, a) for a in ("_prepare_input_fn", "_prepare_output_fn")):
        raise _missing(f"{base.__name__}._prepare_input_fn / _prepare_output_fn")
    placements = ({"weight": Shard(1), "bias": Shard(0)} if style == "colwise"
                  else {"weight": Shard(0), "bias": Replicate()})

    class TransposedLinearStyle(base):  # type: ignore[misc, valid-type]
        def _partition(self, _name: str, module: nn.Module, mesh: Any) -> None:
            source = ({"src_data_rank": self.src_data_rank}
                      if hasattr(self, "src_data_rank") else {})
            for name, placement in placements.items():
                param = getattr(module, name, None)
                if param is not None:
                    module.register_parameter(name, nn.Parameter(
                        distribute_tensor(param, mesh, [placement], **source),
                        requires_grad=param.requires_grad))

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if style == "rowwise":
                self.desired_input_layouts = (Shard(-1),)  # what RowwiseParallel sets
            return distribute_module(
                module, device_mesh, self._partition,
                partial(self._prepare_input_fn, self.input_layouts,
                        self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return TransposedLinearStyle(**options)


def clear_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation and redistribution caches (the C++ one
    included): they key on meshes, and a mesh of a destroyed process group must not be
    found again by the next group's (the test pool reuses one process for many groups)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):
        torch._C._clear_DTensor_sharding_propagator_cache()


def torch_modes_active() -> bool:
    """Whether a torch function mode (or CPU autocast) is on: what a finished task
    must not leave behind."""
    return bool(torch._C._len_torch_function_stack()) or torch.is_autocast_enabled("cpu")
