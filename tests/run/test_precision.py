"""Precision: autocast, true-bf16, the fp16 GradScaler (skips, checkpoints) and DDP comm dtypes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.precision import Precision
from paratrain.testing.numerics import REASSOCIATION, assert_gradients_within
from paratrain.testing.pool import spawn


def dataset(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def make_run(**kwargs):
    return paratrain.Run(strategy="single", accelerator="cpu", progress=False, seed=1, **kwargs)


def test_unknown_precision_is_named():
    with pytest.raises(ValueError, match="precision must be one of"):
        Precision("fp8", "cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        paratrain.Run(precision="16", accelerator="cpu", progress=False)


def test_bf16_mixed_autocasts_forward_but_keeps_float32_weights_and_grads():
    with make_run(precision="bf16-mixed") as run:
        model = mlp()
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = dataset().tensors
        out = model(x)
        assert out.dtype == torch.bfloat16
        run.backward(F.cross_entropy(out, y))
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                   for p in model.parameters())


def test_bf16_true_casts_module_and_inputs_and_trains():
    with make_run(precision="bf16-true") as run:
        model = mlp()
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        loader = run.loader(dataset(), batch_size=8)
        before = run.evaluate(model, run.eval_loader(dataset(), batch_size=16))
        for _ in run.epochs(3):
            for x, y in loader:
                out = model(x)  # float32 input cast to bfloat16 on the way in
                assert out.dtype == torch.float32  # and the output back to float32
                run.backward(F.cross_entropy(out, y))
                run.step(optimizer)
        after = run.evaluate(model, run.eval_loader(dataset(), batch_size=16))
        assert after["loss"] < before["loss"]


def test_fp16_scaler_skips_a_step_with_injected_inf_and_resumes():
    with make_run(precision="16-mixed") as run:
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer = run.prepare(model, optimizer, scheduler)
        x, y = dataset().tensors
        scale = run.precision.scaler.get_scale()
        before = [p.detach().clone() for p in model.parameters()]
        run.backward(F.cross_entropy(model(x), y))
        next(model.parameters()).grad[0, 0] = float("inf")  # an overflow in the backward
        assert run.step(optimizer)  # the group ended ...
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # ... no update
        assert run.precision.skipped_steps == 1
        assert run.precision.scaler.get_scale() == scale / 2
        assert scheduler.last_epoch == 0  # a skipped step does not advance the schedule
        run.backward(F.cross_entropy(model(x), y))
        run.step(optimizer)
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert run.precision.skipped_steps == 1 and scheduler.last_epoch == 1


def test_fp16_scaler_state_is_checkpointed(tmp_path):
    with make_run(precision="16-mixed", checkpoint_dir=str(tmp_path)) as run:
        model = mlp()
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = dataset().tensors
        for _ in range(2):  # two overflows: the scale drops twice
            run.backward(F.cross_entropy(model(x), y))
            next(model.parameters()).grad.fill_(float("nan"))
            run.step(optimizer)
        saved_scale = run.precision.scaler.get_scale()
        run.save()
    assert saved_scale == 2.0**14
    with make_run(precision="16-mixed", checkpoint_dir=str(tmp_path)) as run:
        model = mlp()
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert run.precision.scaler.get_scale() == 2.0**16
        list(run.epochs(0))  # resumes from the newest checkpoint
        assert run.precision.scaler.get_scale() == saved_scale
        assert run.global_step == 2


def fp16_epoch(nan_every_batch, **config):
    """One epoch of 16-mixed over 8 batches; a NaN sample in the first (or every) batch."""
    x, y = dataset(64).tensors
    x[0::8 if nan_every_batch else 64, 0] = float("nan")
    run = paratrain.Run(strategy="single", accelerator="cpu", seed=1, precision="16-mixed",
                        **config)
    model = mlp()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = run.loader(TensorDataset(x, y), batch_size=8, shuffle=False)
    for _ in run.epochs(1):
        for xb, yb in run.progress(loader):
            run.backward(F.cross_entropy(model(xb), yb))
            run.step(optimizer)
    return run


def test_fp16_scaler_skips_are_counted_in_epoch_stats_and_the_bar(capsys):
    with fp16_epoch(nan_every_batch=False) as run:
        assert run.precision.skipped_steps >= 1
        assert run.epoch_stats[0]["skipped_steps"] == run.precision.skipped_steps
    assert f"skipped={run.precision.skipped_steps}" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_fp16_scaler_skipping_every_step_stops_the_run(policy):
    from paratrain.run.finite import NonFiniteError

    with pytest.raises(NonFiniteError) as caught:
        fp16_epoch(nan_every_batch=True, nan=policy)
    assert str(caught.value).startswith(
        "8 optimizer steps in a row were skipped (steps 1 to 8, the last at batch: epoch 0, "
        "sample offset 56): the loss scaler found inf/nan gradients (float16 overflow or a "
        "non-finite loss), so nothing trains; ")


@pytest.mark.slow
def test_bf16_mixed_trains_demo_within_one_point_of_fp32(request):
    pytest.importorskip("paratrain.datasets.images").find_fashion_mnist()
    from paratrain.datasets.images import fashion_mnist
    from paratrain.models import convnet

    train_set = fashion_mnist("train", limit=3000)
    test_set = fashion_mnist("test", limit=2000)
    accuracy = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spinning intra-op threads cost most on a busy machine
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    for precision in ("32", "bf16-mixed"):
        with make_run(precision=precision) as run:
            model = convnet()
            model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=2e-3))
            loader = run.loader(train_set, batch_size=100)
            for _ in run.epochs(2):
                for x, y in loader:
                    run.backward(F.cross_entropy(model(x), y))
                    run.step(optimizer)
            accuracy[precision] = run.evaluate(
                model, run.eval_loader(test_set, batch_size=500))["accuracy"]
    assert accuracy["32"] > 0.7  # it learned something: the comparison means something
    assert abs(accuracy["bf16-mixed"] - accuracy["32"]) <= 0.01, accuracy


def comm_dtype_worker(rank, world_size):
    # One process group for the three runs: each Run reuses it instead of creating its own.
    torch.distributed.init_process_group("gloo")
    grads = {}
    for comm_dtype in ("32", "bf16", "fp16"):
        run = paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, seed=3,
                            strategy_options={"comm_dtype": comm_dtype})
        model = run.prepare(mlp())
        x, y = dataset().tensors
        shard = slice(rank * 16, (rank + 1) * 16)
        run.backward(F.cross_entropy(model(x[shard]), y[shard]))
        grads[comm_dtype] = [p.grad.clone() for p in model.parameters()]
        run.close()
    return grads


def test_ddp_communicates_gradients_in_bf16_and_fp16():
    torch.manual_seed(3)
    model = mlp()
    x, y = dataset().tensors
    halves = []  # the largest gradient element each rank sends
    for shard in (slice(0, 16), slice(16, 32)):
        model.zero_grad()
        F.cross_entropy(model(x[shard]), y[shard]).backward()
        halves.append(max(float(p.grad.abs().max()) for p in model.parameters()))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    reference = [p.grad for p in model.parameters()]
    for grads in spawn(comm_dtype_worker, 2):
        # float32: the batch's sums in another order (paratrain.testing.numerics).
        assert_gradients_within(dict(enumerate(grads["32"])), dict(enumerate(reference)))
        # Each rank's half rounded to the wire dtype, their sum rounded again: at most
        # 2 u times the halves' largest element (u = 2**-8 for bf16, 2**-11 for fp16).
        for comm_dtype, u in (("bf16", 2.0 ** -8), ("fp16", 2.0 ** -11)):
            for got, ref in zip(grads[comm_dtype], reference):
                torch.testing.assert_close(got, ref, rtol=0,
                                           atol=(2 * u + REASSOCIATION) * max(halves))
            # The compressed all-reduce rounds: the result differs from full precision.
            assert any(not torch.equal(g, r) for g, r in zip(grads[comm_dtype], grads["32"]))


def test_unknown_comm_dtype_is_named():
    from paratrain.strategies.ddp import DDPOptions

    with pytest.raises(ValueError, match="comm_dtype must be one of"):
        DDPOptions(comm_dtype="int8")
