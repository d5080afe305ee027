"""Save -> resume for every strategy and optimizer family, bitwise equal to an uninterrupted run.

One spawned job per case runs three trainings in one process group: uninterrupted,
stopped after the checkpoint of step ``STOP_AT`` (as if killed), and resumed from
that checkpoint. Each rank's final parameters (its shard or stage under ``fsdp``,
``pipeline`` and ``hybrid``) of the resumed run must equal the uninterrupted run's
bit for bit. Across strategies, the loaded parameters and optimizer state must
equal what was saved.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.strategies.capabilities import local_module
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

GLOBAL_BATCH, NUM_SAMPLES, EPOCHS, STOP_AT = 8, 24, 2, 2  # 3 steps per epoch
HYBRID_PP = {"pipeline_degree": 2, "pipeline": {"num_microbatches": 2}}
# name -> (strategy, options, data-parallel size at 2 ranks)
CASES = {
    "single": ("single", {}, 1),
    "ddp": ("ddp", {}, 2),
    "fsdp": ("fsdp", {}, 2),
    "zero1": ("zero1", {}, 2),
    "zero2": ("zero2", {}, 2),
    "pipeline": ("pipeline", {"num_microbatches": 2}, 1),
    "hybrid-pp": ("hybrid", HYBRID_PP, 1),
    "hybrid-hsdp": ("hybrid", {}, 1),
}


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def local_state(run, model) -> dict[str, torch.Tensor]:
    """This rank's parameters (its shard or stage), as plain tensors."""
    state = local_module(run.strategy, model).state_dict()
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in state.items()}


def full_state(run, model, optimizer) -> dict[str, torch.Tensor]:
    """Unsharded parameters and optimizer tensors of all ranks, by name (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    module = local_module(run.strategy, model)
    state = {f"param.{k}": v for k, v in module.state_dict().items()}
    optimizer = whole_optimizer(module, optimizer)
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    state.update(get_optimizer_state_dict(module, optimizer, options=options))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not dist.is_initialized():
        return state
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state)
    return {k: v for part in parts for k, v in part.items()}  # pipeline stages: disjoint


def whole_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` itself, or for ``zero1``'s sharded optimizer a plain one holding the
    gathered state of every shard (collective)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    for rank in range(dist.get_world_size()):
        optimizer.consolidate_state_dict(to=rank)
        if rank == dist.get_rank():
            whole = optimizer.state_dict()
    plain = type(optimizer.optim)(module.parameters(), lr=0.0)
    plain.load_state_dict(whole)
    return plain


def train(case: str, optimizer_kind: str, *, checkpoint_dir: str | None = None,
          stop_at: int | None = None, inspect=None, steps: bool = True) -> dict:
    strategy, options, dp_size = CASES[case]
    with paratrain.Run(strategy=strategy, strategy_options=options, accelerator="cpu",
                       progress=False, seed=3, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=stop_at) as run:
        model = make_model()
        model, optimizer = run.prepare(model, make_optimizer(optimizer_kind, model))
        loader = run.loader(synthetic_classification(NUM_SAMPLES),
                            batch_size=GLOBAL_BATCH // dp_size)
        for _ in run.epochs(EPOCHS if steps else 0):
            for x, y in loader:
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
                if run.global_step == stop_at:
                    break
            if run.global_step == stop_at:
                break
        if not steps:
            run.load(sorted(Path(checkpoint_dir).glob("step-*.pt"))[-1])
        return (inspect or (lambda r, m, o: local_state(r, m)))(run, model, optimizer)


def _init_group(world_size: int) -> None:
    if world_size > 1:
        # Owned here, so the three runs of a case share it.
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))


OPTIMIZERS = ("adamw", "sgd")


def resume_mismatches(case: str, directory: str) -> list[str]:
    """Uninterrupted vs stopped-and-resumed, per optimizer: what differs on this rank."""
    found = []
    for kind in OPTIMIZERS:
        full = train(case, kind)
        train(case, kind, checkpoint_dir=f"{directory}/{case}-{kind}", stop_at=STOP_AT)
        resumed = train(case, kind, checkpoint_dir=f"{directory}/{case}-{kind}")
        different = sorted(k for k in full.keys() | resumed.keys()
                           if k not in full or k not in resumed
                           or not torch.equal(full[k], resumed[k]))
        if different:
            found.append(f"{case} ({kind}): {different[:3]}")
    return found


def same_strategy_worker(rank, world_size, directory):
    # One job for every two-rank case: process start-up dominates these tiny runs.
    _init_group(world_size)
    return [m for case in CASES if case != "single" for m in resume_mismatches(case, directory)]


@pytest.mark.slow
def test_single_resume_is_bitwise_equal_to_uninterrupted(tmp_path):
    assert resume_mismatches("single", str(tmp_path)) == []


@pytest.mark.slow
def test_resume_is_bitwise_equal_to_uninterrupted_for_every_strategy(tmp_path):
    """Each rank's parameters (shard or stage) after resuming equal the uninterrupted run's."""
    assert spawn(same_strategy_worker, 2, str(tmp_path), timeout=540) == [[], []]


# Pairs documented to load (docs/strategies.md, "Sharded checkpoints"), and one-file into sharded.
CROSS = [("pipeline", "ddp"), ("pipeline", "fsdp"), ("fsdp", "pipeline"), ("ddp", "fsdp"),
         ("ddp", "pipeline"), ("hybrid-pp", "hybrid-hsdp"), ("zero1", "ddp"), ("ddp", "zero1"),
         ("zero2", "ddp"), ("ddp", "zero2"), ("zero1", "zero2"), ("zero2", "fsdp"),
         ("fsdp", "zero1")]


def cross_worker(rank, world_size, directory):
    _init_group(world_size)
    mismatches = []
    for source, target in CROSS:
        for kind in OPTIMIZERS:
            where = f"{directory}/{source}-{target}-{kind}"
            saved = train(source, kind, checkpoint_dir=where, stop_at=STOP_AT, inspect=full_state)
            loaded = train(target, kind, checkpoint_dir=where, inspect=full_state, steps=False)
            different = sorted(k for k in saved.keys() | loaded.keys()
                               if k not in saved or k not in loaded
                               or not torch.equal(saved[k], loaded[k]))
            if different:
                mismatches.append(f"{source} -> {target} ({kind}): {different[:3]}")
    return mismatches


@pytest.mark.slow
def test_checkpoints_load_across_strategies_exactly(tmp_path):
    """Parameters and optimizer state loaded by another strategy equal what was saved."""
    assert spawn(cross_worker, 2, str(tmp_path), timeout=480) == [[], []]
