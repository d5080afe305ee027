"""Run(spike=...): a loss far above the recent ones stops, skips the batch or warns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.run.finite import MAX_SKIPS_IN_A_ROW, NonFiniteError
from paratrain.run.spikes import LossSpikeError, Spike
from paratrain.testing.pool import spawn

BATCH = 8


def dataset(steps, *, noise=0.1, seed=0):
    """A noisy linear regression with ``steps`` batches of ``BATCH`` samples."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * BATCH, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + noise * torch.randn(
        steps * BATCH, 1, generator=g)
    return TensorDataset(x, y)


def make_run(**kwargs):
    kwargs.setdefault("progress", False)
    kwargs.setdefault("accelerator", "cpu")
    return paratrain.Run(**kwargs)


def train(run, steps, *, spike_at=(), spike_rank=None, times=1000.0, data=None, stop_after=None):
    """Train a Linear; the loss of the steps in ``spike_at`` (on ``spike_rank`` only, when
    given) is multiplied by ``times``. Returns the model, the scheduler, the parameters
    before each step (by step) and the losses of each step (this rank's, by step)."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    model, optimizer = run.prepare(model, optimizer, scheduler)
    loader = run.loader(data or dataset(steps), batch_size=BATCH, shuffle=False)
    before, losses = {}, {}
    for _ in run.epochs(1):
        for x, y in loader:
            step = run.global_step + 1
            before[step] = [p.detach().clone() for p in model.parameters()]
            loss = F.mse_loss(model(x), y)
            losses[step] = loss.item()
            if step in spike_at and spike_rank in (None, run.rank):
                loss = loss * times
            run.backward(loss)
            run.step(optimizer)
            if run.global_step == stop_after:
                break
    return model, scheduler, before, losses


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


# -- the options ----------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    (None, None), (False, None), (True, Spike()),
    ({"factor": 5, "window": 10, "policy": "stop"}, Spike(factor=5.0, window=10, policy="stop")),
    (Spike(policy="warn"), Spike(policy="warn"))])
def test_spike_takes_true_a_dict_a_spike_or_none(value, expected):
    with make_run(spike=value) as run:
        assert run.config.spike == expected


@pytest.mark.parametrize("value, message", [
    ({"factor": 1}, "spike.factor must be a number > 1, got 1"),
    ({"factor": "3"}, "spike.factor must be a finite number, got '3' (str)"),
    ({"window": 0}, "spike.window must be an integer >= 1, got 0"),
    ({"window": 2.5}, "spike.window must be an integer, got 2.5 (float)"),
    ({"policy": "halt"}, "spike.policy must be one of ('stop', 'skip', 'warn'), got 'halt'"),
    ({"windw": 3}, "spike has unknown field(s) ['windw']; known: factor, window, policy"),
    ("yes", "spike must be True, a dict such as")])
def test_bad_options_are_one_line_naming_the_field(value, message):
    with pytest.raises(ValueError) as caught:
        make_run(spike=value)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


# -- the rule ---------------------------------------------------------------------------------
def test_no_false_alarm_on_a_normal_decreasing_loss():
    with make_run(spike={"factor": 3, "window": 5, "policy": "stop"}) as run:
        _, _, _, losses = train(run, 60, data=dataset(60, noise=0.5))
        assert run.global_step == 60 and run.state.loss_spikes["batches"] == []
        # The check was armed and saw the real losses: the window holds the last 5.
        assert run.state.loss_spikes["window"] == pytest.approx([losses[s] for s in
                                                                 range(56, 61)], rel=1e-6)
    assert losses[60] < losses[1] / 10  # it did train


def test_no_spike_is_flagged_during_the_warm_up():
    with make_run(spike={"factor": 3, "window": 5, "policy": "stop"}) as run:
        train(run, 8, spike_at=(5,), stop_after=5)  # the 5th loss: only 4 kept so far
        assert run.state.loss_spikes["batches"] == []
    with make_run(spike={"factor": 3, "window": 5, "policy": "stop"}) as run, \
            pytest.raises(LossSpikeError, match="at step 6: "):
        train(run, 8, spike_at=(6,))  # 5 kept: armed


def test_the_threshold_is_factor_times_the_largest_loss_of_the_window():
    with make_run(spike={"factor": 3, "window": 5, "policy": "warn"}) as run:
        _, _, _, losses = train(run, 8, spike_at=(7,), times=50.0)
        (record,) = run.state.loss_spikes["batches"]
    assert record["threshold"] == pytest.approx(3 * max(losses[s] for s in range(2, 7)))
    assert record["loss"] == pytest.approx(50 * losses[7], rel=1e-6)


# -- the policies ---------------------------------------------------------------------------
def test_stop_raises_one_line_before_the_update():
    with make_run(spike={"factor": 3, "window": 5, "policy": "stop"}) as run:
        with pytest.raises(LossSpikeError) as caught:
            train(run, 20, spike_at=(12,))
        model = run.state.models[0]
        message = str(caught.value)
        assert message.startswith("loss spike at step 12: loss ")
        assert ("(3x the largest of the last 5 losses; batch: epoch 0, sample offset 88), so "
                "training stopped before that step's update") in message
        assert "\n" not in message and run.global_step == 11
        assert [r["step"] for r in run.state.loss_spikes["batches"]] == [12]
    # The parameters are those before step 12 (stop before the update), bitwise.
    with make_run() as clean:
        _, _, before, _ = train(clean, 20, stop_after=12)
    assert equal(params(model), before[12])


def test_skip_leaves_the_update_out_and_training_goes_on():
    spike = {"factor": 3, "window": 5, "policy": "skip"}
    with make_run(spike=spike) as run:
        model, scheduler, before, _ = train(run, 20, spike_at=(12,))
        assert run.global_step == 20
        assert run.epoch_stats[0]["skipped_steps"] == 1
        assert scheduler.last_epoch == 19  # held on the skipped step
        (record,) = run.state.loss_spikes["batches"]
    assert {k: record[k] for k in ("step", "epoch", "offset", "action")} == {
        "step": 12, "epoch": 0, "offset": 88, "action": "skip"}
    assert record["loss"] > record["threshold"] > 0
    assert equal(before[12], before[13])  # step 12 changed nothing
    assert not equal(before[13], params(model))  # the steps after it trained


def test_skip_equals_training_without_the_spiked_batch():
    data = dataset(20)
    with make_run(spike={"factor": 3, "window": 5}, seed=3) as run:
        skipped, _, _, _ = train(run, 20, spike_at=(12,), data=data)
    keep = [i for i in range(20 * BATCH) if not 88 <= i < 96]
    with make_run(seed=3) as run:
        reference, _, _, _ = train(run, 19, data=TensorDataset(*(t[keep] for t in data.tensors)))
    assert equal(params(skipped), params(reference))


def test_warn_prints_one_line_per_spike_and_trains_on(capsys):
    with make_run(spike={"factor": 3, "window": 5, "policy": "warn"}) as run:
        _, _, before, _ = train(run, 20, spike_at=(12,), times=100.0)
        assert run.global_step == 20 and run.epoch_stats[0]["skipped_steps"] == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "spike" in line]
    assert len(lines) == 1
    assert lines[0].startswith("paratrain: warning: loss spike at step 12: loss ")
    assert lines[0].endswith('; training goes on (spike policy "warn")')
    assert not equal(before[12], before[13])  # the update was applied


def test_a_lasting_jump_stops_after_the_skips_in_a_row():
    with make_run(spike={"factor": 3, "window": 5}) as run, \
            pytest.raises(NonFiniteError) as caught:
        train(run, 30, spike_at=range(10, 31))
    assert str(caught.value).startswith(
        f"{MAX_SKIPS_IN_A_ROW} optimizer steps in a row were skipped (steps 10 to 17, the last "
        "at batch: epoch 0, sample offset 128): loss spikes, so nothing trains")


def test_accumulation_compares_the_mean_loss_of_the_group():
    with make_run(accumulate=2, spike={"factor": 3, "window": 50}) as run:
        train(run, 8)
        assert run.global_step == 4
        window = run.state.loss_spikes["window"]
        assert len(window) == 4
    with make_run(accumulate=2) as run:
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
        model, optimizer = run.prepare(model, optimizer, scheduler)
        x, y = dataset(8).tensors
        means = []
        for group in range(4):
            micro = []
            for half in range(2):
                rows = slice((2 * group + half) * BATCH, (2 * group + half + 1) * BATCH)
                loss = F.mse_loss(model(x[rows]), y[rows])
                micro.append(loss.item())
                run.backward(loss)
                run.step(optimizer)
            means.append(sum(micro) / 2)
    assert window == pytest.approx(means, rel=1e-5)


def test_a_spike_skip_under_16_mixed_with_clipping_keeps_the_scaler_working():
    # The clipping unscaled the gradients: the scaler must still step and update, or the
    # next unscale_ fails ("unscale_() has already been called on this optimizer").
    spike = {"factor": 3, "window": 5}
    with make_run(precision="16-mixed", max_grad_norm=1.0, spike=spike) as run:
        _, _, before, _ = train(run, 16, spike_at=(10,))
        assert run.global_step == 16
        assert [r["step"] for r in run.state.loss_spikes["batches"]] == [10]
    assert equal(before[10], before[11])


# -- resume -------------------------------------------------------------------------------------
def test_resume_keeps_the_record_and_the_window(tmp_path):
    spike = {"factor": 3, "window": 5}
    with make_run(spike=spike, checkpoint_dir=str(tmp_path)) as run:
        train(run, 12, spike_at=(9,))
        run.save()
        saved = {key: list(items) for key, items in run.state.loss_spikes.items()}
    assert [r["step"] for r in saved["batches"]] == [9] and len(saved["window"]) == 5
    with make_run(spike=spike, checkpoint_dir=str(tmp_path)) as run:
        model = nn.Linear(4, 1)
        run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        run.state.maybe_resume()
        assert run.state.loss_spikes == saved
        assert run.global_step == 12


def test_a_resumed_run_is_armed_at_once(tmp_path):
    spike = {"factor": 3, "window": 5, "policy": "stop"}
    with make_run(spike=spike, checkpoint_dir=str(tmp_path), checkpoint_every=6) as run:
        train(run, 12, stop_after=6)
    # The second run resumes at step 6 with its window full: a spike at step 7 is caught.
    with make_run(spike=spike, checkpoint_dir=str(tmp_path)) as run, \
            pytest.raises(LossSpikeError, match="at step 7: "):
        train(run, 12, spike_at=(7,))
        raise AssertionError("not caught")


# -- ranks agree --------------------------------------------------------------------------------
def spike_worker(rank, world_size, policy):
    spike = {"factor": 3, "window": 5, "policy": policy}
    with paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, seed=4,
                       spike=spike) as run:
        try:
            model, _, before, losses = train(run, 12, spike_at=(9,), spike_rank=1,
                                             data=dataset(24))
        except LossSpikeError as exc:
            return str(exc), run.global_step
        return (params(model), before, losses, dict(run.state.loss_spikes),
                run.epoch_stats[0]["skipped_steps"])


@pytest.mark.slow
def test_one_rank_spikes_and_both_skip():
    (params0, before0, losses0, state0, skipped0), (params1, before1, losses1, state1,
                                                   skipped1) = spawn(spike_worker, 2, "skip")
    assert skipped0 == skipped1 == 1
    assert state0 == state1 and [r["step"] for r in state0["batches"]] == [9]
    assert equal(params0, params1)
    assert equal(before0[9], before0[10]) and equal(before1[9], before1[10])
    # The loss compared is the mean over the ranks.
    assert state0["window"] == pytest.approx(
        [(losses0[s] + losses1[s]) / 2 for s in range(7, 13) if s != 9], rel=1e-5)


@pytest.mark.slow
def test_one_rank_spikes_and_both_stop():
    (message0, step0), (message1, step1) = spawn(spike_worker, 2, "stop")
    assert message0 == message1 and message0.startswith("loss spike at step 9: ")
    assert step0 == step1 == 8
