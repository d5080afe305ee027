"""Process-group lifetime: a second ``Run`` in the same process forms a fresh group; a
group made by someone else (a script, Ray Train) is reused only when it agrees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed.process_group import init_process_group
from paratrain.distributed.topology import Topology
from paratrain.testing.pool import spawn

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def one_step(strategy: str) -> tuple[float, float]:
    """One training step under ``strategy``; (mean loss over ranks, mean weight after it)."""
    with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False,
                       timeout_s=30) as run:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = run.prepare(model, optimizer)
        g = torch.Generator().manual_seed(run.rank)
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        return run.mean(loss), run.mean(sum(p.detach().sum() for p in model.parameters()))


def runs_in_sequence(rank, world_size, strategies):
    return [one_step(s) for s in strategies]


@pytest.mark.slow
def test_a_second_run_in_the_same_processes_forms_a_fresh_group():
    # ddp then fsdp then ddp again: each generation's keys are apart from the last's, so
    # no rank connects to the addresses a closed group left in the store.
    results = spawn(runs_in_sequence, 2, ["ddp", "fsdp", "ddp"], timeout=240)
    assert results[0] == results[1]
    (ddp_loss, ddp_w), (fsdp_loss, fsdp_w), (again_loss, again_w) = results[0]
    # The same step from the same weights and data: ddp twice is the same arithmetic.
    # fsdp computes the same forward and reduces the same gradients in another order: each
    # of the 15 parameters may move by a few float32 ulps of lr * grad (< 1e-7), so their
    # sum by less than 15 * 1e-7; the bounds below leave room above that.
    assert (again_loss, again_w) == (ddp_loss, ddp_w)
    assert fsdp_loss == pytest.approx(ddp_loss, rel=1e-6)
    assert fsdp_w == pytest.approx(ddp_w, rel=1e-5, abs=1e-5)


@pytest.mark.slow
def test_a_second_run_under_the_launcher():
    # Under `paratrain launch` the store is the agent's and outlives each group: this is
    # where the second group used to read the first one's addresses and wait 200 s.
    out = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2",
         str(SCRIPTS / "two_runs.py"), "ddp", "fsdp", "ddp"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    # Counted, not split into lines: the two ranks' prints may interleave on the pipe.
    for index, strategy in enumerate(["ddp", "fsdp", "ddp"]):
        for rank in (0, 1):
            assert out.stdout.count(f"run {index} {strategy} rank {rank} done") == 1, out.stdout


def test_a_group_made_beforehand_is_reused_when_it_agrees(port):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=0, world_size=1)
    assert init_process_group(Topology(), timeout_s=10) is False  # reused, not created
    assert torch.distributed.is_initialized()


def test_a_group_made_beforehand_that_disagrees_is_one_line(port):
    # A script that formed a 1-rank group by hand while the environment says 2 ranks would
    # otherwise train unsynchronised; a gloo group under a CUDA run fails far from here.
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=0, world_size=1)
    with pytest.raises(RuntimeError) as ranks:
        init_process_group(Topology(rank=1, local_rank=1, world_size=2, local_world_size=2),
                           timeout_s=10)
    assert str(ranks.value) == (
        "a process group already exists with this process as rank 0 of 1, but the "
        "environment says rank 1 of 2; set RANK, WORLD_SIZE and LOCAL_RANK to match it "
        "(torchrun, paratrain launch and Ray Train do)")
    with pytest.raises(RuntimeError) as backend:
        init_process_group(Topology(device=torch.device("cuda", 0), backend="nccl"),
                           timeout_s=10)
    assert str(backend.value) == (
        "the process group that already exists uses gloo but this run computes on cuda with "
        "nccl; make them agree (Ray Train: ScalingConfig(use_gpu=...) and "
        "Run(accelerator=...))")
