"""Pieces shared by strategies whose ranks hold different parameters (FSDP, pipeline).

* :func:`rebuild_optimizer`: the user built the optimizer over the original
  parameters; after sharding or splitting, the module holds new (DTensor or
  stage-local) parameters, so an optimizer of the same class and param-group
  hyperparameters is built over those.
* :func:`save_sharded` / :func:`load_sharded`: ``torch.distributed.checkpoint``
  (DCP) with fully-qualified parameter names, so a checkpoint written at one
  world size or layout loads at another.
* :func:`lockstep_batches`: evaluation where every rank runs the same number
  of forward passes, because a sharded forward is collective.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.data import move_to_device


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
    cls = type(optimizer)
    # defaults may hold derived keys the constructor does not take (AdamW's
    # decoupled_weight_decay): pass what it accepts, then copy them all.
    accepted = inspect.signature(cls.__init__).parameters
    rebuilt = cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    rebuilt.defaults = dict(optimizer.defaults)
    return rebuilt


# -- checkpoints through torch.distributed.checkpoint ------------------------------

def _state(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {}
    for index, module in enumerate(modules):
        state[f"model_{index}"] = get_model_state_dict(module)
    for index, optimizer in enumerate(optimizers):
        # Optimizers are registered against the first model (see RunState).
        state[f"optimizer_{index}"] = get_optimizer_state_dict(modules[0], optimizer)
    return state


def save_sharded(directory: str | os.PathLike, modules: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer]) -> None:
    """Write every rank's shards of models and optimizers to ``directory`` (collective)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # A single process saves without a process group on purpose (its notice says so).
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        dcp.save(_state(modules, optimizers), checkpoint_id=str(directory))


def load_sharded(directory: str | os.PathLike, modules: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer]) -> None:
    """Read ``directory`` into this rank's shards, whatever layout wrote it (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"sharded checkpoint directory {directory} is missing")
    state = _state(modules, optimizers)
    own_groups = {key: [list(group["params"]) for group in value["param_groups"]]
                  for key, value in state.items() if key.startswith("optimizer_")}
    with warnings.catch_warnings():
        # A single process loads without a process group on purpose.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(state, checkpoint_id=str(directory))
    for key, groups in own_groups.items():
        _adopt_own_parameter_names(state[key], groups, directory)
    for index, module in enumerate(modules):
        set_model_state_dict(module, state[f"model_{index}"])
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(modules[0], optimizer, state[f"optimizer_{index}"])


def _adopt_own_parameter_names(optimizer_state: dict[str, Any], own_groups: list[list[str]],
                               directory: str | os.PathLike) -> None:
    """Give each loaded param group this rank's parameter names, keeping its hyperparameters.

    DCP stores non-tensor entries once, from one rank: every rank reads back the
    ``param_groups`` of the rank that wrote them, whose name lists cover only *that*
    rank's parameters (a pipeline stage, say). Groups line up by index on every rank
    (``rebuild_optimizer`` keeps empty groups), so the hyperparameters are shared and
    only the names are this rank's own; without this, a group of another stage's names
    leaves this rank's parameters in a group without ``lr``/``betas``/``momentum``.
    """
    loaded = optimizer_state["param_groups"]
    if len(loaded) != len(own_groups):
        raise ValueError(
            f"checkpoint {directory} has {len(loaded)} optimizer param group(s) but this "
            f"optimizer has {len(own_groups)}; build the optimizer with the same groups"
        )
    optimizer_state["param_groups"] = [
        {**group, "params": names} for group, names in zip(loaded, own_groups)
    ]


def load_full_model_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Load a one-file (unsharded) model state into a sharded ``module`` on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    """Load ``optimizer.state_dict()`` of a replicated run into ``module``'s shards.

    The one-file format numbers parameters 0..n-1 in param-group order; the rebuilt
    optimizer keeps the groups and their order, so index i is the i-th parameter here.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    names = {id(p): name for name, p in module.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    loaded = [index for group in state["param_groups"] for index in group["params"]]
    if len(loaded) != len(ordered):
        raise ValueError(f"the checkpoint's optimizer holds {len(loaded)} parameters, "
                         f"this one {len(ordered)}")
    by_index = dict(zip(loaded, ordered))
    converted = {
        "state": {by_index[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [by_index[i] for i in group["params"]]}
                         for group in state["param_groups"]],
    }
    set_optimizer_state_dict(module, optimizer, converted,
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
