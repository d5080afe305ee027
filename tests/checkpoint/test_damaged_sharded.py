"""A damaged sharded checkpoint (a shard file deleted or truncated) is named in one line
and every rank falls back to the same intact previous one; none left is one line too.

Before, ``torch.distributed.checkpoint`` raised ``CheckpointException`` (a
``BaseException``) with each rank's traceback, and nothing fell back.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.checkpoint.files import CheckpointError, CorruptCheckpoint
from paratrain.distributed.device import free_port
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification


def train(directory: str, steps: int) -> tuple[int, str]:
    """Resume from ``directory``, train to ``steps`` saving each; (step resumed at, rank-0 output)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), paratrain.Run(
            strategy="fsdp", accelerator="cpu", progress=False, seed=5, checkpoint_dir=directory,
            checkpoint_every=1, keep_checkpoints=3) as run:
        model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3))
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
        loader = run.loader(synthetic_classification(64), batch_size=4)
        resumed_at = None
        for _ in run.epochs(1):
            resumed_at = run.global_step if resumed_at is None else resumed_at
            for x, y in loader:
                if run.global_step >= steps:
                    break
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
    return resumed_at, out.getvalue()


def damaged_worker(rank: int, world_size: int, directory: str, ports: list[int]) -> dict:
    shards = Path(directory)

    def fresh_group() -> None:
        # A group re-created on a destroyed group's port can wait forever.
        os.environ["MASTER_PORT"] = str(ports.pop())

    def on_rank_0(damage) -> None:
        fresh_group()
        torch.distributed.init_process_group("gloo")
        if rank == 0:
            damage()
        torch.distributed.barrier()  # nobody resumes before the damage is done
        torch.distributed.destroy_process_group()

    def damage_two() -> None:
        (shards / "step-000000003.dcp" / "__1_0.distcp").unlink()
        truncated = shards / "step-000000002.dcp" / "__0_0.distcp"
        truncated.write_bytes(truncated.read_bytes()[:100])

    fresh_group()
    train(directory, 3)  # writes steps 1, 2, 3
    on_rank_0(damage_two)
    fresh_group()
    resumed_at, printed = train(directory, 1)  # resumes, trains no further
    on_rank_0(lambda: (shards / "step-000000001.dcp" / ".metadata").unlink())
    fresh_group()
    try:
        train(directory, 1)
        refused = None
    except CheckpointError as exc:
        refused = (type(exc).__name__, str(exc))
    return {"resumed_at": resumed_at, "printed": printed, "refused": refused}


@pytest.mark.slow
def test_a_damaged_sharded_checkpoint_falls_back_on_every_rank(tmp_path):
    ports = [free_port() for _ in range(5)]
    results = spawn(damaged_worker, 2, str(tmp_path), ports, timeout=300)
    assert [r["resumed_at"] for r in results] == [1, 1]  # both ranks: the same, intact one
    step = {n: tmp_path / f"step-00000000{n}.pt" for n in (1, 2, 3)}
    lines = results[0]["printed"].splitlines()
    assert lines[0] == (
        f"paratrain: warning: checkpoint {step[3]} is damaged: its shard file "
        "step-000000003.dcp/__1_0.distcp is missing; resuming from the previous checkpoint "
        f"{step[2]} instead")
    assert lines[1].startswith(
        f"paratrain: warning: checkpoint {step[2]} is damaged: its shard file "
        "step-000000002.dcp/__0_0.distcp is truncated (100 of ")
    assert lines[1].endswith(f"bytes); resuming from the previous checkpoint {step[1]} instead")
    assert results[1]["printed"] == ""
    # Nothing intact left: the same one line on every rank, no hang.
    expected = ("CorruptCheckpoint",
                f"checkpoint {step[1]} is damaged: its shard metadata step-000000001.dcp/.metadata "
                "is missing; no intact checkpoint is left to resume from: restore the damaged "
                f"files, or move the checkpoints out of {tmp_path} to start over")
    assert [r["refused"] for r in results] == [expected, expected]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_shard_check_names_the_missing_and_the_short_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    from paratrain.checkpoint import shard_files

    directory = tmp_path / "step-000000001.dcp"
    dcp.save({"w": torch.arange(64.0), "b": torch.ones(3)}, checkpoint_id=str(directory))
    assert shard_files.problem(directory) is None
    data = directory / "__0_0.distcp"
    whole = data.read_bytes()
    data.write_bytes(whole[:-1])
    assert shard_files.problem(directory) == (
        f"its shard file step-000000001.dcp/__0_0.distcp is truncated "
        f"({len(whole) - 1} of {len(whole)} bytes)")
    data.unlink()
    assert shard_files.problem(directory) == (
        "its shard file step-000000001.dcp/__0_0.distcp is missing")
    (directory / ".metadata").write_bytes(b"garbage")
    assert shard_files.problem(directory).startswith(
        "its shard metadata step-000000001.dcp/.metadata cannot be read (")
    assert shard_files.problem(tmp_path / "nope.dcp") == (
        "its shard directory nope.dcp is missing")
    assert CorruptCheckpoint.__mro__[1] is CheckpointError


def test_a_checkpoint_only_another_rank_cannot_read_is_skipped_here_too(tmp_path):
    from paratrain.checkpoint import resume
    from paratrain.checkpoint.files import atomic_save, checkpoint_name

    for step in (1, 2):
        atomic_save({"format": "paratrain", "global_step": step}, tmp_path / checkpoint_name(step))

    def agree(flags: torch.Tensor) -> torch.Tensor:  # rank 1 finds step 2 damaged
        other = flags.clone()
        other[0] = resume.DAMAGED if int(flags[1]) == 2 else resume.OK
        return torch.stack([flags, other])

    loaded, warned = [], []
    path = resume.resume_newest(tmp_path, load=lambda p, state: loaded.append(state["global_step"]),
                                agree=agree, warn=warned.append)
    assert path == tmp_path / "step-000000001.pt" and loaded == [1]
    assert warned == [
        f"paratrain: warning: checkpoint {tmp_path / 'step-000000002.pt'} is damaged as rank(s) 1 "
        "see it (this rank reads it whole: do the nodes share the checkpoint_dir?); resuming "
        f"from the previous checkpoint {tmp_path / 'step-000000001.pt'} instead"]
