"""A non-finite loss no longer trains on silently: RunConfig.nan stops, skips or warns."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.run.finite import MAX_SKIPS_IN_A_ROW, NonFiniteError
from paratrain.testing.pool import spawn


def dataset(n=64, bad=(20,)):
    """Samples of 4 features; the samples at ``bad`` hold a NaN (a corrupt record)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    for index in bad:
        x[index, 0] = float("nan")
    return TensorDataset(x, y)


def train(run, data, *, epochs=1, batch_size=8, scheduler=False):
    """Train a Linear on ``data`` in order (no shuffle); return model and scheduler."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1) if scheduler else None
    model, optimizer = run.prepare(model, optimizer, schedule)
    loader = run.loader(data, batch_size=batch_size, shuffle=False)
    for _ in run.epochs(epochs):
        for x, y in run.progress(loader):
            run.backward(F.cross_entropy(model(x), y))
            run.step(optimizer)
    return model, schedule


def make_run(**kwargs):
    kwargs.setdefault("progress", False)
    return paratrain.Run(accelerator="cpu", **kwargs)


def test_nan_policy_is_validated():
    with pytest.raises(ValueError, match=r"nan must be one of \('stop', 'skip', 'warn'\), "
                                         r"got 'ignore'"):
        make_run(nan="ignore")


def test_a_nan_loss_stops_naming_step_rank_and_batch():
    with make_run() as run, pytest.raises(NonFiniteError) as caught:
        train(run, dataset())
    # Sample 20 is in the third batch of 8 (offset 16): step 3.
    message = str(caught.value)
    assert message.startswith("non-finite loss at step 3 on ranks [0] "
                              "(batch: epoch 0, sample offset 16), so training stopped")
    assert 'Run(nan="skip")' in message and "\n" not in message
    # Found before that step's update (step 3 was not taken), recorded in the run state.
    assert "stopped before that step's update" in message
    assert run.global_step == 2
    assert run.state.nonfinite_batches == [{"step": 3, "epoch": 0, "offset": 16, "ranks": [0]}]


@pytest.mark.parametrize("bad, step, offset", [(20, 2, 16), (40, 3, 32)])
def test_with_accumulation_the_batch_is_where_the_group_starts(bad, step, offset):
    # Micro-batches of 8, groups of 2: sample 20 is in the group of samples 16-31.
    with make_run(accumulate=2) as run, pytest.raises(NonFiniteError) as caught:
        train(run, dataset(bad=(bad,)))
    assert str(caught.value).startswith(f"non-finite loss at step {step} on ranks [0] "
                                        f"(batch: epoch 0, sample offset {offset})")


def test_the_last_step_of_an_epoch_is_checked_before_the_epoch_ends():
    with make_run() as run, pytest.raises(NonFiniteError, match="at step 8 on ranks"):
        train(run, dataset(bad=(63,)))
    assert run.epoch_stats == []


def test_a_checkpoint_is_not_written_after_a_nan_step(tmp_path):
    with make_run(checkpoint_dir=str(tmp_path), checkpoint_every=1) as run, \
            pytest.raises(NonFiniteError, match="at step 3 "):
        train(run, dataset())
    # The save of step 3 checks step 3 first: the NaN model is never written.
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == [
        "step-000000001.pt", "step-000000002.pt"]


def test_skip_leaves_the_update_and_the_scheduler_out_and_counts_it(capsys):
    with make_run(nan="skip", progress=True) as run:
        model, scheduler = train(run, dataset(), epochs=2, scheduler=True)
        assert run.global_step == 16
        assert [s["skipped_steps"] for s in run.epoch_stats] == [1, 1]
        assert scheduler.last_epoch == 14  # 16 steps, 2 skipped
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert run.state.nonfinite_batches == [
            {"step": 3, "epoch": 0, "offset": 16, "ranks": [0]},
            {"step": 11, "epoch": 1, "offset": 16, "ranks": [0]}]
    bar = capsys.readouterr().err
    assert "skipped=1" in bar and "skipped=2" in bar


def test_skip_equals_training_without_the_bad_batch():
    with make_run(nan="skip", seed=3) as run:
        skipped, _ = train(run, dataset())
    clean = dataset()
    keep = [i for i in range(64) if not 16 <= i < 24]
    clean = TensorDataset(*(t[keep] for t in clean.tensors))
    with make_run(seed=3) as run:
        reference, _ = train(run, clean)
    assert all(torch.equal(a, b) for a, b in zip(skipped.parameters(), reference.parameters()))


def test_skip_stops_when_every_step_is_skipped():
    every = tuple(range(0, 64, 8))  # one NaN sample in every batch
    with make_run(nan="skip") as run, pytest.raises(NonFiniteError) as caught:
        train(run, dataset(bad=every))
    assert str(caught.value).startswith(
        f"{MAX_SKIPS_IN_A_ROW} optimizer steps in a row were skipped (steps 1 to 8, the last "
        "at batch: epoch 0, sample offset 56): non-finite loss, so nothing trains; ")


def test_warn_prints_one_line_and_trains_on(capsys):
    with make_run(nan="warn") as run:
        model, _ = train(run, dataset(), epochs=2)
        assert run.global_step == 16
    warnings = [line for line in capsys.readouterr().out.splitlines() if "non-finite" in line]
    assert warnings == [
        "paratrain: warning: non-finite loss at step 3 on ranks [0] (batch: epoch 0, sample "
        "offset 16); training goes on (nan=\"warn\"), the parameters may be non-finite now; "
        "this warning is shown once"]


def test_a_nonfinite_gradient_norm_is_seen_with_clipping():
    with make_run(max_grad_norm=1.0) as run:
        model = nn.Linear(4, 3)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = dataset(8, bad=()).tensors
        before = [p.detach().clone() for p in model.parameters()]
        run.backward(F.cross_entropy(model(x), y))  # a finite loss ...
        model.weight.grad[0, 0] = float("inf")  # ... and an overflow in the backward
        with pytest.raises(NonFiniteError, match="non-finite gradient norm at step 1 "
                                                 r"on ranks \[0\] \(batch: unknown"):
            run.step(optimizer)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def nan_worker(rank, world_size, strategy, policy):
    # Rank 1's shard holds the NaN sample: only that rank's loss is non-finite.
    with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, nan=policy,
                       seed=5) as run:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = run.loader(dataset(bad=(21,)), batch_size=4, shuffle=False)
        try:
            for _ in run.epochs(1):
                for x, y in loader:
                    run.backward(F.cross_entropy(model(x), y))
                    run.step(optimizer)
        except NonFiniteError as exc:
            return str(exc)
        from paratrain.distributed.dtensor import whole

        params = [whole(p.detach()) for p in model.parameters()]
        return run.global_step, run.epoch_stats[0]["skipped_steps"], params


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_agree_to_stop_and_name_the_rank_that_saw_it(strategy):
    # 8 samples per step (4 per rank, rank r holding samples r, r + 2, ...): sample 21 is
    # in step 3 (offset 16), on rank 1.
    messages = spawn(nan_worker, 2, strategy, "stop")
    assert messages[0] == messages[1]
    assert messages[0].startswith("non-finite loss at step 3 on ranks [1] "
                                  "(batch: epoch 0, sample offset 16), so training stopped")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_agree_to_skip(strategy):
    results = spawn(nan_worker, 2, strategy, "skip")
    (steps0, skipped0, params0), (steps1, skipped1, params1) = results
    assert steps0 == steps1 == 8 and skipped0 == skipped1 == 1
    assert all(torch.isfinite(p).all() for p in params0)
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def test_a_nonfinite_batch_is_kept_in_the_checkpoint(tmp_path):
    with make_run(nan="skip", checkpoint_dir=str(tmp_path)) as run:
        train(run, dataset())
        run.save()
    with make_run(nan="skip", checkpoint_dir=str(tmp_path)) as run:
        model = nn.Linear(4, 3)
        run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        run.state.maybe_resume()
        assert run.state.nonfinite_batches == [
            {"step": 3, "epoch": 0, "offset": 16, "ranks": [0]}]


# -- nan="stop" stops before the bad step's update ---------------------------------------
def poisoned_steps(run, model, optimizer, *, bad_step, steps=5, rank_poisoned=None):
    """Train ``steps`` steps on clean data, multiplying the loss by NaN on ``bad_step``
    (on ``rank_poisoned`` only, when given). Returns the error's message, the parameters
    and optimizer state taken just before ``bad_step``, and those at the end."""
    x, y = dataset(8 * steps, bad=()).tensors
    before = None
    try:
        for step in range(1, steps + 1):
            if step == bad_step:
                before = ([p.detach().clone() for p in model.parameters()],
                          copy.deepcopy(optimizer.state_dict()))
            loss = F.cross_entropy(model(x[8 * step - 8:8 * step]), y[8 * step - 8:8 * step])
            if step == bad_step and rank_poisoned in (None, run.rank):
                loss = loss * float("nan")
            run.backward(loss)
            run.step(optimizer)
    except NonFiniteError as exc:
        after = ([p.detach().clone() for p in model.parameters()], optimizer.state_dict())
        return str(exc), before, after, run.global_step
    return None, before, None, run.global_step


def same_state(a, b):
    (params_a, opt_a), (params_b, opt_b) = a, b
    assert all(torch.equal(p, q) for p, q in zip(params_a, params_b, strict=True))
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for key, state in opt_a["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(opt_b["state"][key][name]))
                   for name, v in state.items())
    return True


def test_stop_leaves_parameters_and_optimizer_state_as_before_the_bad_step():
    with make_run(seed=1) as run:
        model = nn.Linear(4, 3)
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1))
        message, before, after, step = poisoned_steps(run, model, optimizer, bad_step=3)
    assert message.startswith("non-finite loss at step 3 on ranks [0] (batch: unknown")
    assert "stopped before that step's update" in message and "\n" not in message
    assert step == 2 and same_state(before, after)  # bitwise: Adam's moments and step too


def stop_worker(rank, world_size):
    with paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, seed=2) as run:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1))
        message, before, after, step = poisoned_steps(run, model, optimizer, bad_step=3,
                                                      rank_poisoned=1)
        return message, step, same_state(before, after), [p.detach() for p in before[0]]


@pytest.mark.slow
def test_ranks_stop_before_the_update_with_parameters_untouched():
    # Only rank 1's loss is NaN; DDP would average its NaN gradients into rank 0's update.
    (message0, step0, same0, params0), (message1, step1, same1, params1) = spawn(stop_worker, 2)
    assert message0 == message1
    assert message0.startswith("non-finite loss at step 3 on ranks [1] (batch: unknown")
    assert step0 == step1 == 2 and same0 and same1
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
