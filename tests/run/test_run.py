"""The Run loop in one process: epochs, evaluation, checkpoints, accumulation bookkeeping."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.checkpoint.files import CheckpointError


def dataset(n=50):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def make_run(**kwargs):
    kwargs.setdefault("progress", False)
    return paratrain.Run(accelerator="cpu", **kwargs)


def fit(run, num_epochs, *, dropout=0.0, batch_size=8):
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(dropout), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(dataset(), batch_size=batch_size)
    seen = []
    for _ in run.epochs(num_epochs):
        for x, y in loader:
            seen.append(x[:, 0].clone())
            run.backward(F.cross_entropy(model(x), y))
            run.step(optimizer)
    return model, seen


def test_steps_and_epochs_are_counted():
    with make_run() as run:
        fit(run, 2)
        assert run.global_step == 2 * 7  # ceil(50 / 8) steps per epoch
        assert [s["samples"] for s in run.epoch_stats] == [50, 50]


def test_evaluation_can_repeat_every_epoch():
    with make_run() as run:
        model, _ = fit(run, 1)
        loader = run.eval_loader(dataset(), batch_size=16)
        first, second = run.evaluate(model, loader), run.evaluate(model, loader)
        assert first == second and first["count"] == 50


def test_resume_in_process_is_bitwise_identical(tmp_path):
    with make_run(seed=3) as run:
        full, _ = fit(run, 3, dropout=0.3)
        expected = [p.detach().clone() for p in full.parameters()]
    # Interrupt after 10 steps (mid-epoch 1) by running a loop that stops early.
    with make_run(seed=3, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=5) as run:
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = run.prepare(model, optimizer)
        loader = run.loader(dataset(), batch_size=8)
        for _ in run.epochs(3):
            for x, y in loader:
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
                if run.global_step == 12:
                    break
            if run.global_step == 12:
                break
    with make_run(seed=3, checkpoint_dir=str(tmp_path / "b")) as run:
        resumed, _ = fit(run, 3, dropout=0.3)
        assert run.global_step == 21
        for got, ref in zip(resumed.parameters(), expected):
            assert torch.equal(got, ref)


def test_checkpoint_for_another_model_is_refused(tmp_path):
    with make_run() as run:
        fit(run, 1)
        path = run.save(tmp_path)
    with make_run() as run:
        run.prepare(nn.Linear(4, 3))
        with pytest.raises(CheckpointError, match="does not match the model"):
            run.load(path)


def test_save_mid_accumulation_is_refused(tmp_path):
    with make_run(accumulate=2) as run:
        model = nn.Linear(4, 3)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = dataset().tensors
        run.backward(F.cross_entropy(model(x[:4]), y[:4]))
        assert run.step(optimizer) is False
        with pytest.raises(ValueError, match="middle of a gradient-accumulation group"):
            run.save(tmp_path)


def test_metrics_log_csv_and_jsonl(tmp_path):
    for suffix in ("csv", "jsonl"):
        path = tmp_path / f"m.{suffix}"
        with make_run(metrics_path=str(path)) as run:
            fit(run, 2)
            run.log({"custom": 1.5})
        text = path.read_text()
        assert "samples_per_s" in text and "custom" in text


def test_resuming_a_finished_run_says_it_is_complete(tmp_path, capsys):
    """A second start in the same folder (e.g. `paratrain launch` after `python train.py`)
    used to end in seconds with only "resumed from ...": it must say nothing is left."""
    with make_run(checkpoint_dir=tmp_path) as run:
        fit(run, 2)
        path = run.save()
    capsys.readouterr()
    with make_run(checkpoint_dir=tmp_path) as run:
        _, seen = fit(run, 2)
    assert seen == []  # nothing trained
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"resumed from {path}; training was already complete (2 epochs); to train "
                     "again, ask for more epochs or use another checkpoint_dir"]
    with make_run(checkpoint_dir=tmp_path) as run:
        _, seen = fit(run, 3)  # one more epoch: the usual line, and it trains
    assert seen and capsys.readouterr().out.startswith(f"resumed from {path} (epoch 2, step 14)")


@pytest.mark.parametrize("num_epochs", ["3", 2.0, True, -1])
def test_epochs_wants_an_integer(num_epochs):
    with make_run() as run:
        with pytest.raises(ValueError) as info:
            next(iter(run.epochs(num_epochs)))
    assert str(info.value) == (f"run.epochs(num_epochs) needs an integer >= 0, got {num_epochs!r} "
                               f"({type(num_epochs).__name__}); e.g. run.epochs(int(args.epochs))")


def test_metrics_path_may_be_a_path(tmp_path):
    """As checkpoint_dir: a pathlib.Path works (it raised AttributeError on .endswith)."""
    with make_run(metrics_path=tmp_path / "m.jsonl") as run:
        assert run.config.metrics_path == str(tmp_path / "m.jsonl")
        fit(run, 1)
    assert "samples_per_s" in (tmp_path / "m.jsonl").read_text()
