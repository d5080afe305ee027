"""Gradient accumulation against one big batch; no all-reduce on micro-steps; global counts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import TensorDataset

import paratrain
from paratrain.testing.numerics import TrainingBound, assert_params_within
from paratrain.testing.pool import spawn


def dataset(n=32, masked=False):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    if masked:
        # Unevenly spread ignored labels: micro-batches hold different numbers of valid ones.
        y[torch.rand(n, generator=g) < 0.4] = -100
    return TensorDataset(x, y)


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def loss_mean(model, x, y):
    return F.cross_entropy(model(x), y), None


def loss_global(model, x, y):
    return paratrain.losses.token_cross_entropy(model(x), y)


def train(*, strategy="single", batch_size, accumulate=1, num_samples=32, num_epochs=1,
          masked=False, loss_fn=loss_mean, scheduler=False, **config):
    run = paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=11,
                        accumulate=accumulate, **config)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9) if scheduler else None
    model, optimizer = run.prepare(model, optimizer, sched)
    num_updates = []
    optimizer.register_step_post_hook(lambda *_: num_updates.append(1))
    loader = run.loader(dataset(num_samples, masked), batch_size=batch_size, shuffle=True)
    for _ in run.epochs(num_epochs):
        for x, y in loader:
            loss, count = loss_fn(model, x, y)
            run.backward(loss, count=count)
            run.step(optimizer)
    params = [p.detach().clone() for p in run.strategy.unwrap(model).parameters()]
    info = {"updates": len(num_updates), "global_step": run.global_step,
            "lr": optimizer.param_groups[0]["lr"]}
    run.close()
    return params, info, bound


def assert_params_close(got, expected, bound):
    # The batch's sums in another order (micro-batches, ranks), carried through SGD's
    # arithmetic: bounds from paratrain.testing.numerics, replayed on the reference.
    names = [name for name, _ in mlp().named_parameters()]
    assert_params_within(dict(zip(names, got)), dict(zip(names, expected)), bound)


def test_accumulate_4_equals_one_batch_of_4x():
    reference, ref_info, bound = train(batch_size=8, num_epochs=2, scheduler=True)
    params, info, _ = train(batch_size=2, accumulate=4, num_epochs=2, scheduler=True)
    assert_params_close(params, reference, bound)
    # Optimizer, scheduler and step counter advance once per group of 4.
    assert info == ref_info == {"updates": 8, "global_step": 8, "lr": pytest.approx(0.2 * 0.9**8)}


def test_partial_group_at_epoch_end_is_the_mean_of_its_micro_batches():
    # 20 samples, micro-batch 2, accumulate 4: groups of 4, 4 and 2 micro-batches, which
    # is the same update as batches of 8, 8 and 4.
    reference, ref_info, bound = train(batch_size=8, num_samples=20, num_epochs=2)
    params, info, _ = train(batch_size=2, accumulate=4, num_samples=20, num_epochs=2)
    assert info["updates"] == ref_info["updates"] == 6
    assert_params_close(params, reference, bound)


def test_global_count_makes_accumulation_exact_for_uneven_valid_counts():
    reference, _, bound = train(batch_size=8, masked=True, loss_fn=loss_global)
    # A mean over all valid labels of the batch is the globally normalised reference.
    mean_reference, _, _ = train(batch_size=8, masked=True, loss_fn=loss_mean)
    assert_params_close(mean_reference, reference, bound)
    params, _, _ = train(batch_size=2, accumulate=4, masked=True, loss_fn=loss_global)
    assert_params_close(params, reference, bound)
    # Averaging per micro-batch weights micro-batches, not labels: a different update.
    # (A micro-batch whose labels are all ignored has a NaN mean, with zero gradients:
    # nan="warn" trains on where the default would stop.)
    wrong, _, _ = train(batch_size=2, accumulate=4, masked=True, loss_fn=loss_mean, nan="warn")
    assert max((a - b).abs().max().item() for a, b in zip(wrong, reference)) > 1e-3


def test_mixing_count_and_no_count_in_one_group_is_refused():
    with paratrain.Run(strategy="single", accelerator="cpu", progress=False,
                       accumulate=2) as run:
        model = run.prepare(mlp())
        x, y = dataset().tensors
        run.backward(F.cross_entropy(model(x), y, reduction="sum"), count=len(y))
        with pytest.raises(ValueError, match="pass count= on every micro-step"):
            run.backward(F.cross_entropy(model(x), y))


def counting_hook(state, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def ddp_worker(rank, world_size):
    torch.distributed.init_process_group("gloo")
    out = {}
    # 1) Count all-reduces on each micro-step of an accumulate=4 run.
    run = paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, seed=11, accumulate=4)
    model = mlp()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.2))
    counter = {"calls": 0}
    model.register_comm_hook(counter, counting_hook)
    calls = []
    loader = run.loader(dataset(), batch_size=2, shuffle=True)
    for _ in run.epochs(1):
        for x, y in loader:
            run.backward(F.cross_entropy(model(x), y))
            calls.append(counter["calls"])
            run.step(optimizer)
    out["calls"] = calls
    run.close()
    # 2) 2 ranks x micro-batch 2 x accumulate 2 against the single-process batch of 8.
    out["mean"] = train(strategy="ddp", batch_size=2, accumulate=2, num_epochs=2)[0]
    out["global"] = train(strategy="ddp", batch_size=2, accumulate=2, masked=True,
                          loss_fn=loss_global)[0]
    return out


@pytest.mark.slow
def test_ddp_accumulation_syncs_only_on_the_last_micro_step_and_matches_reference():
    reference, _, bound = train(batch_size=8, num_epochs=2)
    global_reference, _, global_bound = train(batch_size=8, masked=True, loss_fn=loss_global)
    for out in spawn(ddp_worker, 2):
        # 32 samples / 2 ranks / micro-batch 2 = 8 micro-steps: two groups of 4. The
        # cumulative count only rises on micro-steps 4 and 8 (one bucket each).
        assert out["calls"] == [0, 0, 0, 1, 1, 1, 1, 2]
        assert_params_close(out["mean"], reference, bound)
        assert_params_close(out["global"], global_reference, global_bound)


def test_sum_and_count_helpers():
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0])
    total, count = paratrain.losses.sum_and_count(losses, mask=torch.tensor([1, 0, 1, 1]).bool())
    assert (total.item(), count.item()) == (8.0, 3.0)
    total, count = paratrain.losses.sum_and_count(losses, weight=torch.tensor([0.5, 1, 0, 2]))
    assert (total.item(), count.item()) == (10.5, 3.5)
    logits, targets = torch.randn(2, 3, 5), torch.tensor([[0, -100, 4], [1, 1, -100]])
    total, count = paratrain.losses.token_cross_entropy(logits, targets)
    assert count.item() == 4
    expected = F.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(total / count, expected)
