"""Pieces shared by strategies whose ranks hold different parameters (FSDP, pipeline).

* :func:`rebuild_optimizer`: the user built the optimizer over the original
  parameters; after sharding or splitting, the module holds new (DTensor or
  stage-local) parameters, so an optimizer of the same class and param-group
  hyperparameters is built over those.
* :func:`save_sharded` / :func:`load_sharded`: ``torch.distributed.checkpoint``
  (DCP) with fully-qualified parameter names, so a checkpoint written at one
  world size or layout loads at another; :func:`start_save_sharded` writes in
  the background (DCP's ``async_save``).
* Buffers are also saved per rank (``rank_buffers_<model>.<rank>of<world>.<name>``) and
  restored on the rank that wrote them: BatchNorm statistics differ per rank under
  ``fsdp``, and one shared copy made a resumed run differ from an uninterrupted one.
* :func:`lockstep_batches`: evaluation where every rank runs the same number
  of forward passes, because a sharded forward is collective.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.data.loader import move_to_device


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> fully-qualified name``, recorded before a module is transformed."""
    return {id(p): name for name, p in module.named_parameters()}


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                      params_by_name: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``params_by_name``, group by group.

    ``names`` maps the original parameters (by id) to names; a name missing from
    ``params_by_name`` belongs to another rank (a pipeline stage) and is dropped.
    Hyperparameters of every group are kept; optimizer *state* is not carried
    over (it is empty right after construction, the only time this is called).
    """
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                "the optimizer holds parameters that are not in the prepared model; "
                "build it over model.parameters() and pass both to run.prepare()"
            )
        params = [params_by_name[names[id(p)]] for p in group["params"]
                  if names[id(p)] in params_by_name]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not any(group["params"] for group in groups):
        raise ValueError("this rank holds no trainable parameters; move split points so "
                         "every stage has parameters")
    rebuilt = type(optimizer)(groups, **constructor_defaults(optimizer))
    rebuilt.defaults = dict(optimizer.defaults)  # derived keys too (see constructor_defaults)
    return rebuilt


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` as keyword arguments to build another of its class.

    The defaults may hold derived keys the constructor does not take (AdamW's
    ``decoupled_weight_decay``): only those its signature accepts are kept.
    """
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


# -- checkpoints through torch.distributed.checkpoint ------------------------------

def _state(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
           flat: bool = True) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    # Flat optimizer state keys every hyperparameter by parameter name
    # ("param_groups.<fqn>.lr"). The nested layout stores ``param_groups`` as a
    # list indexed by group, so pipeline stages wrote the same keys with different
    # parameters and a resumed stage found its groups without hyperparameters.
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    state: dict[str, Any] = {}
    for index, module in enumerate(modules):
        state[f"model_{index}"] = get_model_state_dict(module)
        state.update(_rank_buffers(index, module, state[f"model_{index}"]))
    for index, optimizer in enumerate(optimizers):
        # Optimizers are registered against the first model (see RunState).
        state[f"optimizer_{index}"] = get_optimizer_state_dict(modules[0], optimizer,
                                                               options=options)
    return state


_RANK_BUFFERS = "rank_buffers_"


def _rank_buffers(index: int, module: nn.Module, saved: Iterable[str]) -> dict[str, torch.Tensor]:
    """This rank's own copy of each persistent buffer of model ``index`` (those named in
    ``saved``), under keys that only this rank writes.

    DCP writes a plain tensor that every rank holds under one key once, as if it were
    replicated. Buffers each rank updates from its own batches (BatchNorm statistics
    under ``fsdp``, or on pipeline replicas) are not: the other ranks would resume with a
    copy that is not theirs. The key names the world size, so that only a run of the
    same size takes them back (see :func:`_own_buffers`).
    """
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    prefix = f"{_RANK_BUFFERS}{index}.{dist.get_rank()}of{dist.get_world_size()}."
    names = set(saved)
    return {prefix + name: buffer.detach() for name, buffer in module.named_buffers()
            if name in names and not isinstance(buffer, DTensor)}


def _own_buffers(state: dict[str, Any], directory: str | os.PathLike) -> dict[str, Any]:
    """``state`` asking only for the per-rank buffers the checkpoint holds, read into copies.

    A checkpoint from before per-rank buffers, from another world size or from a layout
    that kept a buffer on another rank lacks some keys: those buffers keep the shared copy.
    """
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key: value.clone() if key.startswith(_RANK_BUFFERS) else value
            for key, value in state.items()
            if not key.startswith(_RANK_BUFFERS) or key in saved}


def _restore_own_buffers(modules: list[nn.Module], state: dict[str, Any]) -> None:
    """Copy the per-rank buffers read into ``state`` over the shared copy just loaded."""
    for index, module in enumerate(modules):
        own = _rank_buffers(index, module, dict(module.named_buffers()))
        with torch.no_grad():
            for key, buffer in own.items():
                if key in state:
                    buffer.copy_(state[key])


def save_sharded(directory: str | os.PathLike, modules: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], *, lowest_rank: bool = False) -> None:
    """Write every rank's shards of models and optimizers to ``directory`` (collective).

    ``lowest_rank``: a tensor several ranks hold under one name is written by the lowest
    of them (DCP otherwise balances the writers), so copies that differ (semi-synchronous
    replica groups) are saved consistently, from one group.
    """
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.save(_state(modules, optimizers), checkpoint_id=str(directory),
                 planner=_planner(lowest_rank))


def _planner(lowest_rank: bool) -> Any:
    if not lowest_rank:
        return None  # DCP's default
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def start_save_sharded(directory: str | os.PathLike, modules: list[nn.Module],
                       optimizers: list[torch.optim.Optimizer], *,
                       group: dist.ProcessGroup, lowest_rank: bool = False) -> Future:
    """Copy this rank's shards to the CPU now and write them on a thread (collective).

    ``group`` carries the writing threads' collectives: it must be a gloo group of
    all ranks created for checkpoints only, since collectives on the training group
    from two threads at once would interleave differently on different ranks.
    Returns the future of the write; its result raises what the write raised.
    """
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(_state(modules, optimizers), checkpoint_id=str(directory),
                          process_group=group, planner=_planner(lowest_rank))


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's "torch.distributed is disabled ... single process" warning, only that one.

    One process saves and loads without a process group on purpose; the strategy's
    own notice already says it runs unsharded.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable "
                                r"or uninitialized, assuming the intent is to (save|load) in a "
                                r"single process")
        yield


def load_sharded(directory: str | os.PathLike, modules: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], *, flat: bool = True) -> None:
    """Read ``directory`` into this rank's shards, whatever layout wrote it (collective).

    ``flat`` is False for checkpoints written before optimizer state was flattened.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"sharded checkpoint directory {directory} is missing")
    readable = [_whole_optimizer(optimizer) for optimizer in optimizers]
    state = _own_buffers(_state(modules, readable, flat=flat), directory)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(directory))
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    for index, module in enumerate(modules):
        set_model_state_dict(module, state[f"model_{index}"])
    _restore_own_buffers(modules, state)
    for index, (optimizer, whole) in enumerate(zip(optimizers, readable)):
        set_optimizer_state_dict(modules[0], whole, state[f"optimizer_{index}"],
                                 options=options)
        if whole is not optimizer:
            optimizer.load_state_dict(whole.state_dict())  # keeps this rank's shard


def _whole_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer``, or for a ``ZeroRedundancyOptimizer`` (``zero1``), whose state DCP
    cannot address, a plain optimizer of its class and groups to read the whole state
    into (transiently: the sharded optimizer then keeps its part)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    return type(optimizer.optim)([dict(group) for group in optimizer.param_groups],
                                 **constructor_defaults(optimizer.optim))


def saved_shapes(directory: str | os.PathLike, index: int) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of model ``index`` in a DCP checkpoint (read from its metadata only)."""
    from torch.distributed.checkpoint import FileSystemReader

    prefix = f"model_{index}."
    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key[len(prefix):]: tuple(item.size) for key, item in metadata.items()
            if key.startswith(prefix) and hasattr(item, "size")}


def load_full_model_state(module: nn.Module, state: dict[str, torch.Tensor], *,
                          partial: bool) -> None:
    """Load an unsharded ``state`` (a one-file checkpoint) into this rank's shards or stage.

    ``partial``: the module is one pipeline stage; the other stages' entries are skipped.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if partial:
        own = module.state_dict()
        state = {k: v for k, v in state.items() if k in own}
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    """Load an unsharded optimizer state keyed by parameter name into this rank's optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(module, optimizer, state,
                             options=StateDictOptions(full_state_dict=True))


# -- evaluation in lockstep ----------------------------------------------------------

_END = object()


def _template_batch(batches: Iterable[Any]) -> Any:
    """A one-sample batch from a paratrain loader, for a rank whose shard is empty."""
    dataset = getattr(batches, "dataset", None)
    dataloader = getattr(batches, "dataloader", None)
    if dataset is None or dataloader is None or len(dataset) == 0:
        return _END
    batch = dataloader.collate_fn([dataset[0]])
    return move_to_device(batch, batches.device)


def lockstep_batches(batches: Iterable[Any], *, device: torch.device,
                     group: dist.ProcessGroup | None = None) -> Iterator[tuple[Any, bool]]:
    """Yield ``(batch, counted)`` so that every rank of ``group`` yields equally often.

    A rank that ran out of batches re-runs its last one (or one sample of the
    dataset) with ``counted=False``, so its collectives in forward match the
    others' and its results are discarded: evaluation stays exact. Costs one
    small all-reduce per batch.
    """
    iterator = iter(batches)
    filler: Any = None
    while True:
        batch = next(iterator, _END)
        if batch is not _END:
            filler = batch
        elif filler is None:
            filler = _template_batch(batches)
        flags = torch.tensor([batch is not _END, filler is _END], dtype=torch.int32,
                             device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        if flags[0] and flags[1]:
            raise ValueError("a rank has no evaluation batches and no sample to stand in; "
                             "use a dataset with at least as many samples as ranks")
        if not flags[0]:
            return
        yield (filler, False) if batch is _END else (batch, True)
