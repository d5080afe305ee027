"""Training-loop mistakes that used to run on silently now fail with one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.reliability.health import HealthError, describe_model_difference, model_fingerprint
from paratrain.testing.pool import spawn


def dataset(n=16):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def make_run(**kwargs):
    kwargs.setdefault("progress", False)
    return paratrain.Run(accelerator="cpu", **kwargs)


def prepared(run):
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    return (*run.prepare(model, optimizer, scheduler), scheduler)


def test_step_without_backward_is_refused_and_nothing_advances():
    with make_run() as run:
        model, optimizer, scheduler = prepared(run)
        x, y = dataset().tensors
        model(x)  # a forward, but the loss is never backpropagated
        with pytest.raises(RuntimeError, match=r"run.step\(optimizer\) found no gradients.*"
                                               r"call run.backward\(loss\) before"):
            run.step(optimizer)
        assert run.global_step == 0 and scheduler.last_epoch == 0


def test_step_without_backward_stays_legal_within_an_accumulation_group():
    with make_run(accumulate=3) as run:
        model, optimizer, _ = prepared(run)
        before = model.weight.detach().clone()
        x, y = dataset().tensors
        assert run.step(optimizer) is False  # a skipped micro-batch: no backward
        run.backward(F.cross_entropy(model(x), y))
        assert run.step(optimizer) is False
        assert run.step(optimizer) is True  # the group had one backward: it steps
        assert run.global_step == 1 and not torch.equal(before, model.weight)
        # The next group has no backward at all: refused at its boundary only.
        assert run.step(optimizer) is False and run.step(optimizer) is False
        with pytest.raises(RuntimeError, match="found no gradients"):
            run.step(optimizer)


def test_plain_loss_backward_is_still_accepted():
    with make_run() as run:
        model, optimizer, _ = prepared(run)
        x, y = dataset().tensors
        F.cross_entropy(model(x), y).backward()
        assert run.step(optimizer) and run.global_step == 1


def test_optimizer_of_another_model_is_refused():
    with make_run() as run:
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1)
        with pytest.raises(ValueError, match="none of the optimizer's parameters belong to "
                                             "this model.*build the optimizer from this model"):
            run.prepare(model, optimizer)


def test_stepping_an_optimizer_of_a_model_never_prepared_is_refused():
    with make_run() as run:
        model = nn.Linear(4, 3)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        other = nn.Linear(4, 3)
        stray = torch.optim.SGD(other.parameters(), lr=0.1)
        x, y = dataset().tensors
        run.backward(F.cross_entropy(other(x), y) + F.cross_entropy(model(x), y))
        with pytest.raises(ValueError, match=r"run.step got an optimizer none of whose "
                                             r"parameters belong to a model passed to "
                                             r"run.prepare\(\)"):
            run.step(stray)
        assert run.global_step == 0
        # One built after prepare from the prepared model is fine.
        later = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.weight.detach().clone()
        assert run.step(later) and not torch.equal(before, model.weight)


def test_a_scheduler_also_stepped_by_hand_is_refused():
    with make_run() as run:
        model, optimizer, scheduler = prepared(run)
        x, y = dataset().tensors
        run.backward(F.cross_entropy(model(x), y))
        run.step(optimizer)
        run.backward(F.cross_entropy(model(x), y))
        run.step(optimizer)  # run.step stepped the scheduler: fine so far
        assert scheduler.last_epoch == 2
        scheduler.step()  # ... and the loop steps it too
        run.backward(F.cross_entropy(model(x), y))
        with pytest.raises(RuntimeError, match=r"a scheduler passed to run.prepare\(\) was also "
                                               r"stepped outside run.step \(its last_epoch went "
                                               r"from 2 to 3 between two optimizer steps\)"):
            run.step(optimizer)
        assert run.global_step == 2


def stale_optimizer_worker(rank, world_size, strategy, cases):
    # One process group for every case: each Run reuses it instead of creating its own.
    torch.distributed.init_process_group("gloo")
    return [stale_optimizer_case(strategy, case) for case in cases]


def stale_optimizer_case(strategy, case):
    with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False) as run:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        head = torch.optim.SGD(model[2].parameters(), lr=0.1)  # a second one, not prepared
        prepared_model, returned = run.prepare(model, optimizer)
        after = torch.optim.SGD(model[2].parameters(), lr=0.1)  # built after prepare: fine
        x, y = dataset().tensors
        run.backward(F.cross_entropy(prepared_model(x), y))
        try:
            if case == "before":
                run.step(optimizer)
            elif case == "second":
                run.step(head)
            elif case == "second-by-hand":
                head.step()
            else:
                after.step()
                return run.step(returned)
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        return "stepped"


@pytest.mark.slow
def test_optimizers_that_fsdp_replaced_are_refused():
    cases = ("before", "second", "second-by-hand", "after")
    before, second, by_hand, fine = zip(*spawn(stale_optimizer_worker, 2, "fsdp", cases))
    assert list(before) == ["run.step got the optimizer you built before prepare(), which strategy "
                      "'fsdp' replaced, so stepping it would not train the prepared model; use "
                      "the one prepare returned: model, optimizer = run.prepare(model, "
                      "optimizer)"] * 2
    assert all(m.startswith("run.step got an optimizer over the parameters that strategy "
                            "'fsdp' replaced in run.prepare(), so it would train nothing")
               for m in second), second
    assert all(m.startswith("optimizer.step() on an optimizer over the parameters that "
                            "strategy 'fsdp' replaced in run.prepare() trains nothing")
               for m in by_hand), by_hand
    assert fine == (True, True)
    # Under ddp the parameters stay: the optimizer passed to prepare is the one returned.
    assert spawn(stale_optimizer_worker, 2, "ddp", ["before"]) == [["stepped"]] * 2


def test_evaluate_on_an_empty_loader_is_refused():
    with make_run() as run:
        model = run.prepare(nn.Linear(4, 3))
        with pytest.raises(ValueError, match=r"run.evaluate\(\) got an empty loader"):
            run.evaluate(model, run.eval_loader(dataset(0), batch_size=4))
        with pytest.raises(ValueError, match="empty loader"):
            run.evaluate(model, [])


def test_ps_servers_with_another_strategy_is_refused():
    env = {"PARATRAIN_PS_SERVERS": "1"}
    with pytest.raises(ValueError, match=r"--ps-servers 1 \(PARATRAIN_PS_SERVERS\) applies to "
                                         r"strategy 'ps' only, but the strategy is 'single'"):
        make_run(strategy="single", environ=env)


@pytest.mark.parametrize("theirs, expected", [
    ([("fc.weight", (10, 32), "float32")], "at 'fc.weight': shape (10, 64) vs (10, 32)"),
    ([("fc.weight", (10, 64), "bfloat16")], "at 'fc.weight': dtype float32 vs bfloat16"),
    ([("head.weight", (10, 64), "float32")], "rank 0 has 'head.weight' in its place"),
    ([], "parameter count: 1 vs 0 (first unmatched 'fc.weight')"),
])
def test_model_difference_names_the_first_parameter(theirs, expected):
    rows = [theirs, [("fc.weight", (10, 64), "float32")]]
    assert expected in describe_model_difference(rows, 1, 0)


def test_fingerprint_ignores_values():
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    assert not torch.equal(a.weight, b.weight)
    assert model_fingerprint(a) == model_fingerprint(b) == [
        ("weight", (3, 4), "float32"), ("bias", (3,), "float32")]


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Linear(4, hidden)
        self.fc = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.body(x)))


def mismatch_worker(rank, world_size, strategy, same):
    with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False) as run:
        model = Net(64 if rank == 0 or same else 32)
        try:
            model = run.prepare(model)
        except HealthError as exc:
            return str(exc)
        return "prepared"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_mismatched_models_across_ranks_are_named(strategy):
    expected = "rank 1's model differs from rank 0's at 'body.weight': shape (32, 4) vs (64, 4)"
    messages = spawn(mismatch_worker, 2, strategy, False)
    assert all(m.startswith(expected) and "build the same model on every rank" in m
               for m in messages), messages
    assert spawn(mismatch_worker, 2, strategy, True) == ["prepared", "prepared"]


def test_launch_without_a_script_names_only_the_script(capsys):
    from paratrain.launch.launcher import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "paratrain launch: error: the following arguments are required: script"
    args = build_parser().parse_args(["train.py"])
    assert args.script == "train.py" and args.script_args == []
