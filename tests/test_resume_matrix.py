"""Save -> resume for every strategy that runs on CPU and each optimizer family.

Each case trains uninterrupted with a checkpoint every ``STOP_AT`` steps, deletes every
checkpoint after ``STOP_AT`` (as if the job had been killed there), resumes, and compares:
the same strategy must continue bitwise equal to the uninterrupted run; another strategy
(where docs/strategies.md says a checkpoint moves) must resume and continue close to it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.testing.reference import synthetic_classification
from paratrain.testing.spawn import spawn

pytestmark = pytest.mark.slow

STOP_AT, EPOCHS, GLOBAL_BATCH = 3, 2, 8  # 96 samples: 12 steps per epoch at batch 8
PIPELINE = {"schedule": "1f1b", "num_microbatches": 2}
LAYOUTS: dict[str, tuple[int, dict]] = {
    "single": (1, {"strategy": "single"}),
    "ddp": (2, {"strategy": "ddp"}),
    "fsdp": (2, {"strategy": "fsdp"}),
    "pipeline": (2, {"strategy": "pipeline", "strategy_options": PIPELINE}),
    "hybrid-pp": (2, {"strategy": "hybrid",
                      "strategy_options": {"pipeline_degree": 2, "pipeline": PIPELINE}}),
}


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def worker(rank: int, world_size: int, run_kwargs: dict, optimizer_name: str,
           directory: str) -> tuple[list[float], int, dict]:
    with paratrain.Run(progress=False, accelerator="cpu", seed=5, checkpoint_dir=directory,
                       checkpoint_every=STOP_AT, keep_checkpoints=100, **run_kwargs) as run:
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              nn.Linear(16, 3))
        model, optimizer = run.prepare(model, make_optimizer(optimizer_name, model.parameters()))
        batch_size = GLOBAL_BATCH // run.strategy.data_parallel_size
        loader = run.loader(synthetic_classification(96), batch_size=batch_size, shuffle=True)
        losses = []
        for _ in run.epochs(EPOCHS):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                losses.append(run.mean(loss))
        full = getattr(run.strategy, "full_state_dict", lambda m: None)(model)
        state = full if full is not None else run.strategy.checkpoint_module(model).state_dict()
        params = {k: v.detach().clone() for k, v in state.items()}
        return losses, run.global_step, params


def keep_only_first_checkpoint(directory: Path) -> None:
    """Delete every checkpoint written after step STOP_AT, as a kill right after it would."""
    for path in directory.iterdir():
        match = re.search(r"(\d+)", path.name)
        if match and int(match.group(1)) > STOP_AT:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def uninterrupted_then_resumed(source: str, target: str, optimizer_name: str, tmp_path: Path):
    num_procs, kwargs = LAYOUTS[source]
    full = spawn(worker, num_procs, kwargs, optimizer_name, str(tmp_path), timeout=240)
    keep_only_first_checkpoint(tmp_path)
    num_procs, kwargs = LAYOUTS[target]
    resumed = spawn(worker, num_procs, kwargs, optimizer_name, str(tmp_path), timeout=240)
    return full[0], resumed[0]


@pytest.mark.parametrize("layout, optimizer_name", [
    ("single", "adam"), ("ddp", "adam"), ("fsdp", "adam"), ("pipeline", "adam"),
    ("hybrid-pp", "adam"), ("pipeline", "sgd"), ("hybrid-pp", "sgd"), ("pipeline", "adamw"),
])
def test_resume_in_the_same_layout_is_bitwise_exact(layout, optimizer_name, tmp_path):
    (full_losses, full_steps, full_params), (losses, steps, params) = \
        uninterrupted_then_resumed(layout, layout, optimizer_name, tmp_path)
    assert steps == full_steps == EPOCHS * 12
    assert losses == full_losses[STOP_AT:]
    assert params.keys() == full_params.keys()
    for name, value in params.items():
        assert torch.equal(value, full_params[name]), name


@pytest.mark.parametrize("source, target", [
    ("pipeline", "ddp"), ("fsdp", "ddp"), ("pipeline", "fsdp"), ("ddp", "fsdp"),
])
def test_resume_in_another_layout_continues_the_run(source, target, tmp_path):
    (full_losses, full_steps, full_params), (losses, steps, params) = \
        uninterrupted_then_resumed(source, target, "adam", tmp_path)
    assert steps == full_steps
    # Another layout reduces in another order: close, not bitwise.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full_losses[STOP_AT:]),
                               rtol=1e-3, atol=1e-4)
    common = params.keys() & full_params.keys()  # rank 0 of a pipeline holds one stage
    assert common
    for name in common:
        torch.testing.assert_close(params[name], full_params[name], rtol=1e-3, atol=1e-4)


def test_a_one_file_checkpoint_into_a_pipeline_is_refused_in_one_line(tmp_path):
    from paratrain.testing.spawn import WorkerFailed

    with pytest.raises(WorkerFailed, match="was written by 'ddp' in the one-file format, which "
                                           "strategy 'pipeline' cannot read"):
        uninterrupted_then_resumed("ddp", "pipeline", "adam", tmp_path)
