"""Background checkpoint writes (``RunConfig(async_save=True)``).

The rank-0 write is held at a gate (a slow disk, made deterministic) so that the
tests can train, save and close while it is in flight.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.checkpoint import files as checkpoint
from paratrain.checkpoint.files import CheckpointError
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification


class GatedWrites:
    """Replaces ``files.atomic_save``: each write waits until :meth:`open` is called."""

    def __init__(self, *, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = fail
        self._original = checkpoint.atomic_save

    def __call__(self, state, path):
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"
        if self.fail:
            raise OSError(28, "No space left on device")
        return self._original(state, path)

    def open(self) -> None:
        self.gate.set()


def make_run(directory, **config):
    run = paratrain.Run(strategy="single", accelerator="cpu", progress=False, seed=5,
                        checkpoint_dir=str(directory), async_save=True, **config)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    batches = iter(run.loader(synthetic_classification(64), batch_size=8))

    def step():
        x, y = next(batches)
        run.backward(F.cross_entropy(model(x), y))
        run.step(optimizer)

    run.state.maybe_resume()
    run.state.start_epoch(0)
    return run, model, step


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_file_holds_the_save_steps_values_while_training_goes_on(tmp_path, monkeypatch):
    gated = GatedWrites()
    monkeypatch.setattr(checkpoint, "atomic_save", gated)
    run, model, step = make_run(tmp_path)
    step()
    saved_values = params(model)
    path = run.save()
    assert gated.started.wait(30)
    for _ in range(3):  # training changes the parameters in place while the write waits
        step()
    assert not os.path.exists(path)  # not even visible before it is complete
    gated.open()
    run.close()
    state = checkpoint.safe_load(path)
    assert state["global_step"] == 1
    changed = params(model)
    for name, value in saved_values.items():
        assert torch.equal(state["models"][0][name], value)
        assert not torch.equal(changed[name], value)


def test_the_next_save_waits_for_the_previous_write(tmp_path, monkeypatch):
    gated = GatedWrites()
    monkeypatch.setattr(checkpoint, "atomic_save", gated)
    run, _, step = make_run(tmp_path)
    step()
    first = run.save()
    assert gated.started.wait(30)
    step()
    second = threading.Thread(target=run.save)
    second.start()
    second.join(0.5)
    assert second.is_alive()  # held behind the first write
    assert not os.path.exists(first)
    gated.open()
    second.join(30)
    assert not second.is_alive() and os.path.exists(first)
    run.close()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step-000000001.pt", "step-000000002.pt"]


def test_close_waits_for_the_write(tmp_path, monkeypatch):
    gated = GatedWrites()
    monkeypatch.setattr(checkpoint, "atomic_save", gated)
    run, _, step = make_run(tmp_path, checkpoint_every=2)
    step()
    step()  # checkpoint_every writes step 2 in the background
    assert gated.started.wait(30)
    threading.Timer(0.3, gated.open).start()
    run.close()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-000000002.pt"]
    assert not run.state._writer.pending


def test_a_failed_background_write_is_reported_at_the_next_save_and_at_close(tmp_path,
                                                                             monkeypatch):
    gated = GatedWrites(fail=True)
    gated.open()
    monkeypatch.setattr(checkpoint, "atomic_save", gated)
    run, _, step = make_run(tmp_path)
    step()
    run.save()  # returns: the failure happens in the background
    step()
    with pytest.raises(CheckpointError, match=r"^writing checkpoint .*step-000000001\.pt in the "
                       r"background failed \(OSError: \[Errno 28\] No space left on device\); "
                       r"the previous checkpoint is kept"):
        run.save()
    run.save()  # step 2 is written in the background and fails too
    with pytest.raises(CheckpointError, match=r"step-000000002\.pt in the background failed"):
        run.close()
    assert checkpoint.list_checkpoints(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left


def test_async_save_must_be_a_bool():
    with pytest.raises(ValueError, match=r"^async_save must be True or False, got 'yes'"):
        paratrain.RunConfig(async_save="yes")


# -- resume equals the synchronous path, also with two gloo ranks ---------------------------

def train(directory: str, *, strategy: str, async_save: bool, steps: int) -> dict:
    """Up to ``steps`` optimizer steps with a checkpoint every 2, resuming from ``directory``."""
    with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=3,
                       checkpoint_dir=directory, checkpoint_every=2,
                       async_save=async_save) as run:
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        loader = run.loader(synthetic_classification(48), batch_size=4)
        for _ in run.epochs(2):
            for x, y in loader:
                if run.global_step == steps:
                    break
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
        return full_params(run, model)


def full_params(run, model) -> dict[str, torch.Tensor]:
    """Unsharded parameters (collective under fsdp)."""
    state = run.strategy.unwrap(model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()}


def sync_and_async_differences(directory: str, strategy: str) -> list[str]:
    """Interrupted at step 4, resumed to step 10, once saving synchronously, once not."""
    ends = {}
    for mode in (False, True):
        where = f"{directory}/{strategy}-{mode}"
        train(where, strategy=strategy, async_save=mode, steps=4)
        ends[mode] = train(where, strategy=strategy, async_save=mode, steps=10)
    found = [k for k in ends[False] if not torch.equal(ends[False][k], ends[True][k])]
    for name in ("step-000000008.pt", "step-000000010.pt"):
        sync, background = (checkpoint.safe_load(Path(f"{directory}/{strategy}-{mode}") / name)
                            for mode in (False, True))
        if not _equal(sync, background):
            found.append(name)
    return found


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_from_a_background_checkpoint_equals_the_synchronous_path(tmp_path):
    assert sync_and_async_differences(str(tmp_path), "single") == []


def slowly(write):
    def slow(*args, **kwargs):
        time.sleep(1.0)  # training takes several steps meanwhile
        return write(*args, **kwargs)
    return slow


def isolation_differences(directory: str, strategy: str) -> list[str]:
    """Saved at step 2 with slow writes (shards and small file), then 3 more steps:
    the checkpoint resumes with step 2's parameters."""
    from torch.distributed.checkpoint import FileSystemWriter

    where = f"{directory}/{strategy}-isolation"
    originals = FileSystemWriter.write_data, checkpoint.atomic_save
    FileSystemWriter.write_data = slowly(originals[0])
    checkpoint.atomic_save = slowly(originals[1])
    try:
        with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=3,
                           checkpoint_dir=where, async_save=True) as run:
            model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
            model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
            loader = run.loader(synthetic_classification(48), batch_size=4)
            for _ in run.epochs(1):
                for x, y in loader:
                    run.backward(F.cross_entropy(model(x), y))
                    run.step(optimizer)
                    if run.global_step == 2:
                        saved = full_params(run, model)
                        run.save()
                    if run.global_step == 5:
                        break
            trained = full_params(run, model)
    finally:
        FileSystemWriter.write_data, checkpoint.atomic_save = originals
    resumed = train(where, strategy=strategy, async_save=True, steps=2)
    return ([f"resumed {k}" for k in saved if not torch.equal(saved[k], resumed[k])]
            + [f"untrained {k}" for k in saved if torch.equal(saved[k], trained[k])])


def two_rank_worker(rank, world_size, directory, strategy):
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    return (sync_and_async_differences(directory, strategy)
            + isolation_differences(directory, strategy))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_resume_from_background_checkpoints_exactly(tmp_path, strategy):
    assert spawn(two_rank_worker, 2, str(tmp_path), strategy, timeout=300) == [[], []]
