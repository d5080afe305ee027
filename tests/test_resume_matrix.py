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

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.testing.reference import synthetic_classification
from paratrain.testing.spawn import spawn

GLOBAL_BATCH, NUM_SAMPLES, EPOCHS, STOP_AT = 8, 32, 2, 3  # 4 steps per epoch
HYBRID_PP = {"pipeline_degree": 2, "pipeline": {"num_microbatches": 2}}
# name -> (strategy, options, data-parallel size at 2 ranks)
CASES = {
    "single": ("single", {}, 1),
    "ddp": ("ddp", {}, 2),
    "fsdp": ("fsdp", {}, 2),
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
    state = run.strategy.checkpoint_module(model).state_dict()
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in state.items()}


def train(case: str, optimizer_kind: str, *, checkpoint_dir: str | None = None,
          stop_at: int | None = None) -> dict[str, torch.Tensor]:
    strategy, options, dp_size = CASES[case]
    with paratrain.Run(strategy=strategy, strategy_options=options, accelerator="cpu",
                       progress=False, seed=3, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=stop_at) as run:
        model = make_model()
        model, optimizer = run.prepare(model, make_optimizer(optimizer_kind, model))
        loader = run.loader(synthetic_classification(NUM_SAMPLES),
                            batch_size=GLOBAL_BATCH // dp_size)
        for _ in run.epochs(EPOCHS):
            for x, y in loader:
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
                if run.global_step == stop_at:
                    break
            if run.global_step == stop_at:
                break
        return local_state(run, model)


def _init_group(world_size: int) -> None:
    if world_size > 1:
        # Owned here, so the three runs of a case share it.
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))


def same_strategy_worker(rank, world_size, case, optimizer_kind, directory):
    _init_group(world_size)
    full = train(case, optimizer_kind)
    train(case, optimizer_kind, checkpoint_dir=directory, stop_at=STOP_AT)
    resumed = train(case, optimizer_kind, checkpoint_dir=directory)
    return full, resumed


def run_case(case, optimizer_kind, directory):
    if case == "single":
        return [same_strategy_worker(0, 1, case, optimizer_kind, directory)]
    return spawn(same_strategy_worker, 2, case, optimizer_kind, directory, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, case, optimizer_kind):
    for rank, (full, resumed) in enumerate(run_case(case, optimizer_kind, str(tmp_path))):
        assert full.keys() == resumed.keys()
        for name, expected in full.items():
            assert torch.equal(resumed[name], expected), f"rank {rank}: {name} differs"
