"""Semi-synchronous training over the replicate axis (LocalSGD, DiLoCo) on gloo ranks.

The exact reductions (issue 33): local SGD with H = 1 against DDP, DiLoCo with
``outer_lr=1, outer_momentum=0`` against local SGD; the replicate axis silent between
outer steps; a save in the middle of H resumed bit for bit; with FSDP inside each
group (``dp_shard=2 x dp_replicate=2``) the groups equal right after each outer step;
and the one-line refusals.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain import DiLoCo, LocalSGD, Parallel
from paratrain.strategies.capabilities import local_module
from paratrain.strategies.semisync import due, unit_names
from paratrain.strategies.semisync.fragments import split_units
from paratrain.strategies.semisync.outer import local_piece
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

# -- units, fragments and the schedule (no processes) ------------------------------------

def test_fragments_follow_the_units_and_sync_once_per_h():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    assert unit_names(model, None) == [["0.weight", "0.bias"], ["2.weight", "2.bias"],
                                       ["3.weight", "3.bias"]]
    assert split_units([40, 72, 18], 2) == [[0], [1, 2]]
    assert split_units([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]
    every, fragments = 6, 3
    syncs = {j: [n for n in range(1, 4 * every + 1)
                 if due(n, fragment=j, every=every, fragments=fragments)]
             for j in range(fragments)}
    assert syncs == {0: [6, 12, 18, 24], 1: [4, 10, 16, 22], 2: [2, 8, 14, 20]}


# -- gloo ranks -----------------------------------------------------------------------------

def _init_group(world_size: int) -> None:
    # Owned here, so the runs of a job share it.
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))


def mlp(dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).to(dtype)


def dyadic_data(n: int = 32) -> TensorDataset:
    """Inputs and targets with few bits: every product and sum below is exact in float64."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (n, 4), generator=g).double()
    return TensorDataset(x, torch.randint(-2, 3, (n, 1), generator=g).double())


def dyadic_linear() -> nn.Linear:
    layer = nn.Linear(4, 1).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, -0.25, 0.75, 0.125]]))
        layer.bias.fill_(0.25)
    return layer


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: local_piece(p).detach().clone() for n, p in model.named_parameters()}


def train(parallel=None, *, strategy="auto", make=mlp, data=None, optimizer="sgd", lr=0.125,
          loss_fn=F.cross_entropy, batch_size=4, epochs=1, stop_at=None, checkpoint_dir=None,
          checkpoint_every=None, every_step=None):
    """Train on this rank; the local parameters after each step (``every_step``) or the end."""
    with paratrain.Run(strategy=strategy, parallel=parallel, accelerator="cpu", progress=False,
                       seed=3, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=checkpoint_every) as run:
        model = make()
        opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1))
        model, opt = run.prepare(model, opt)
        loader = run.loader(data or synthetic_classification(64), batch_size=batch_size)
        for _ in run.epochs(epochs):
            for x, y in loader:
                loss = loss_fn(model(x), y)
                run.backward(loss)
                run.step(opt)
                if every_step is not None:
                    every_step(run, model, float(loss.detach()))
                if run.global_step == stop_at:
                    return None
            if run.global_step == stop_at:
                return None
        return local_params(local_module(run.strategy, model))


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the ulp of the tensor's largest magnitude."""
    ulp = torch.finfo(a.dtype).eps * max(a.abs().max(), b.abs().max()).item()
    return ((a - b).abs().max() / ulp).item()


def reductions(rank):
    out = {}
    # (a) local SGD with H = 1 and plain SGD against DDP. Bitwise where the arithmetic is
    # exact (few-bit inputs, float64, lr a power of two: both are exact)...
    linear = {"make": dyadic_linear, "data": dyadic_data(), "loss_fn": F.mse_loss,
              "lr": 2.0 ** -4, "epochs": 2}
    out["exact_ddp"] = train(strategy="ddp", **linear)
    out["exact_local"] = train(Parallel(dp_replicate=2, semi_sync=LocalSGD(every=1)), **linear)
    # ... and in general within one ulp per step. DDP steps p - lr (g1 + g2) / 2 (lr g_i
    # exact, one rounding at p's grid u after a rounding far below it); local SGD averages
    # x_i = fl(p - lr g_i) = p - lr g_i + e_i, |e_i| <= u/2, then fl(x1 + x2) / 2 rounds
    # once more: |difference| <= (|e1| + |e2|) / 2 + u/2 + u/2 < 2u, and both lie on the
    # grid, so at most 1 ulp (of the tensor's largest magnitude, which bounds every
    # element's) per step; the next steps' gradients move by far less with lr L << 1.
    out["ddp"] = train(strategy="ddp")
    out["local"] = train(Parallel(dp_replicate=2, semi_sync=LocalSGD(every=1)))
    # (b) DiLoCo with outer_lr=1, momentum 0 against local SGD (H = 4, AdamW inside;
    # 16 steps, so the last one is an outer step).
    adamw = {"optimizer": "adamw", "lr": 0.01, "epochs": 2}
    out["local4"] = train(Parallel(dp_replicate=2, semi_sync=LocalSGD(every=4)), **adamw)
    out["diloco4"] = train(Parallel(dp_replicate=2, semi_sync=DiLoCo(
        every=4, outer_lr=1.0, outer_momentum=0.0)), **adamw)
    out["diloco4_nesterov"] = train(Parallel(dp_replicate=2, semi_sync=DiLoCo(every=4)), **adamw)
    return out


def two_rank_worker(rank, world_size, directory):
    # One job for the two-rank cases: process start-up dominates these tiny runs.
    _init_group(world_size)
    return {"reductions": reductions(rank), "counts": counting(rank),
            "outer": outer_math(rank), "resume": resume(rank, directory)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("semisync")
    return spawn(two_rank_worker, 2, str(directory), timeout=420)


def test_exact_reductions(two_ranks):
    results = [result["reductions"] for result in two_ranks]
    for out in results:
        for name in out["exact_ddp"]:
            assert torch.equal(out["exact_local"][name], out["exact_ddp"][name]), name
        for name in out["ddp"]:
            # 8 steps, at most 1 ulp each (the derivation in reductions_worker).
            assert ulps_apart(out["local"][name], out["ddp"][name]) <= 8, name
        for name in out["local4"]:
            # s - (d1 + d2) / 2 with exact d_i = s - x_i rounds once, as (x1 + x2) / 2 does.
            assert torch.equal(out["diloco4"][name], out["local4"][name]), name
        # Momentum and an outer lr of 0.7 change the result: the comparison can fail.
        assert any(not torch.equal(out["diloco4_nesterov"][n], out["local4"][n])
                   for n in out["local4"])
    for name in results[0]["diloco4"]:  # the last step was an outer step: groups agree
        assert torch.equal(results[0]["diloco4"][name], results[1]["diloco4"][name]), name


# -- (c) the replicate axis is silent between outer steps ------------------------------------

COLLECTIVES = tuple(name for name in (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "broadcast", "reduce_scatter_tensor", "all_to_all_single", "barrier")
    if hasattr(dist, name))


class Spy:
    """Counts the Python collectives called, by group (patched on ``torch.distributed``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def __enter__(self) -> Spy:
        for name, original in self.originals.items():
            setattr(dist, name, self._spy(name, original))
        return self

    def _spy(self, name, original):
        def call(*args, **kwargs):
            self.calls.append((name, kwargs.get("group")))
            return original(*args, **kwargs)
        return call

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)


def counting(rank):
    counts = {}
    for overlap in (False, True):
        with Spy() as spy:
            after = []
            mode = DiLoCo(every=4, fragments=2, overlap=overlap)
            # 64 samples, 4 per rank: 8 steps; fragment 1 syncs after steps 2 and 6,
            # fragment 0 after 4 and 8.
            train(Parallel(dp_replicate=2, semi_sync=mode), optimizer="adamw", lr=0.01,
                  every_step=lambda run, model, loss, after=after, spy=spy: after.append(
                      len(spy.calls)))
        counts[overlap] = [b - a for a, b in zip(after, after[1:])]
    return counts


def test_the_replicate_axis_carries_one_sync_per_h_steps_per_fragment(two_ranks):
    # Every collective of the job counts (2 ranks: every group holds the replicas); steps
    # 2..8: one all-reduce where a fragment is due, nothing in between.
    for counts in (result["counts"] for result in two_ranks):
        assert counts == {False: [1, 0, 1, 0, 1, 0, 1], True: [1, 0, 1, 0, 1, 0, 1]}


def outer_math(rank):
    """The outer step against torch's SGD(momentum, nesterov) on the snapshot."""
    from paratrain.strategies.semisync.outer import OuterSync

    torch.manual_seed(0)
    start = torch.randn(50)
    param = nn.Parameter(start.clone())
    mode = DiLoCo(every=2, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    outer = OuterSync(mode, [[param]], group=None, replicas=2, device=torch.device("cpu"))
    reference = nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    worst = 0.0
    for step in range(6):
        outer.before_step()
        with torch.no_grad():  # an inner "step": each rank moves its own way
            param.add_(torch.randn(50, generator=torch.Generator().manual_seed(
                step * 2 + rank)) * 0.01)
        if step % 2 == 1:
            mean = param.detach().clone()
            dist.all_reduce(mean)
            mean /= 2
            reference.grad = reference.detach() - mean
            sgd.step()
        outer.after_step()
        if step % 2 == 1:
            worst = max(worst, ulps_apart(param.detach(), reference.detach()))
            with torch.no_grad():
                param.copy_(reference)  # both continue from the same point
                outer.fragments[0][0].snapshot.copy_(reference.detach())
    return worst, outer.outer_steps


def test_the_outer_step_is_nesterov_sgd_on_the_snapshot(two_ranks):
    # lerp(s, mean, lr) - lr mu m rounds differently from SGD's s - lr (d + mu m): a few
    # ulps of the largest magnitude, per outer step.
    for worst, outer_steps in (result["outer"] for result in two_ranks):
        assert outer_steps == 3 and worst <= 4, worst


# -- a checkpoint in the middle of H resumes bit for bit -------------------------------------

RESUMED = {
    # Fragment 1 is sent after step 2 (overlapped, bf16) and applied after step 3.
    "diloco-streaming": DiLoCo(every=4, fragments=2, overlap=True, comm_dtype="bf16"),
    "diloco": DiLoCo(every=3),
    "localsgd": LocalSGD(every=3),
}


def loaded_params(parallel, directory):
    """The parameters a run of ``parallel`` holds after loading the last checkpoint."""
    from pathlib import Path

    with paratrain.Run(parallel=parallel, accelerator="cpu", progress=False, seed=3) as run:
        model = mlp()
        model, _ = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        run.load(sorted(Path(directory).glob("step-*.pt"))[-1])
        return local_params(local_module(run.strategy, model))


def resume(rank, directory):
    mismatches, saved_at_2 = [], {}
    for name, mode in RESUMED.items():
        layout = Parallel(dp_replicate=2, semi_sync=mode)
        where = f"{directory}/{name}"
        kwargs = {"optimizer": "adamw", "lr": 0.01, "epochs": 2}
        full = train(layout, **kwargs)
        train(layout, checkpoint_dir=where, checkpoint_every=2, stop_at=2, **kwargs,
              every_step=lambda run, model, loss, name=name: saved_at_2.setdefault(
                  name, local_params(model)) if run.global_step == 2 else None)
        resumed = train(layout, checkpoint_dir=where, **kwargs)
        mismatches += [f"{name}: {n}" for n in full if not torch.equal(full[n], resumed[n])]
    # Without semi_sync (ddp here) the checkpoint loads replica group 0's parameters.
    group0 = loaded_params(Parallel(dp_replicate=2), f"{directory}/diloco")
    return mismatches, group0, saved_at_2["diloco"]


def test_a_save_in_the_middle_of_h_resumes_bitwise(two_ranks):
    results = [result["resume"] for result in two_ranks]
    assert [mismatches for mismatches, _, _ in results] == [[], []]
    group0 = results[0][2]
    assert any(not torch.equal(group0[n], results[1][2][n]) for n in group0)  # mid-H
    for _, loaded, _ in results:
        assert all(torch.equal(loaded[n], group0[n]) for n in group0)


# -- (d) FSDP inside each group: dp_shard=2 x dp_replicate=2 ---------------------------------

def hsdp_worker(rank, world_size, directory):
    _init_group(world_size)
    history, losses, replicate = [], [], []

    def record(run, model, loss):
        history.append(local_params(model))
        losses.append(loss)
        replicate.append(run.strategy.mesh.group("replicate"))

    with Spy() as spy:
        train(Parallel(dp_replicate=2, dp_shard=2, semi_sync=DiLoCo(every=2)),
              optimizer="adamw", lr=0.02, epochs=4, every_step=record,
              checkpoint_dir=directory, checkpoint_every=6)
    outer_calls = sum(1 for _, group in spy.calls if group is replicate[0])
    try:  # another number of replica groups on resume: one line
        train(Parallel(dp_replicate=4, semi_sync=DiLoCo(every=2)), checkpoint_dir=directory,
              optimizer="adamw", lr=0.02, epochs=5)
        refusal = None
    except paratrain.CheckpointError as exc:
        refusal = str(exc)
    return history, losses, outer_calls, refusal


@pytest.mark.slow
def test_diloco_with_fsdp_inside_each_group(tmp_path):
    results = spawn(hsdp_worker, 4, str(tmp_path), timeout=420)
    steps = len(results[0][0])
    assert steps == 16  # 64 samples, 4 per rank, 4 ranks, 4 epochs
    for rank in (0, 1):  # its replicate peer is rank + 2 (same shard of the other group)
        mine, peer = results[rank][0], results[rank + 2][0]
        for step in range(steps):
            same = all(torch.equal(mine[step][n], peer[step][n]) for n in mine[step])
            assert same == ((step + 1) % 2 == 0), step + 1
    for _, losses, outer_calls, refusal in results:
        assert outer_calls == steps // 2  # one all-reduce per outer step, nothing else
        assert sum(losses[-4:]) < sum(losses[:4])  # it trains
        assert refusal is not None and "over 2 replica group(s)" in refusal
        assert "\n" not in refusal


def inside_worker(rank, world_size, inside):
    """paratrain's GPT with ``inside`` (tp=2 or cp=2) in each of 2 groups; the local
    parameters after each step."""
    from paratrain.models import GPT

    _init_group(world_size)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (64, 9), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    history = []

    def make():
        torch.manual_seed(0)
        return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)

    def gpt_loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))

    train(Parallel(dp_replicate=2, semi_sync=DiLoCo(every=2), **inside), make=make,
          data=data, loss_fn=gpt_loss, optimizer="adamw", lr=0.01,
          every_step=lambda run, model, loss: history.append(local_params(model)))
    return history


@pytest.mark.slow
@pytest.mark.parametrize("inside", [{"tp": 2}, {"cp": 2}], ids=["tp", "cp"])
def test_diloco_with_tensor_or_context_parallel_inside_each_group(inside):
    results = spawn(inside_worker, 4, inside, timeout=300)
    for rank in (0, 1):  # the tp / cp peers of a group; rank + 2 is the other group's
        for step, (mine, peer) in enumerate(zip(results[rank], results[rank + 2]), 1):
            same = all(torch.equal(mine[n], peer[n]) for n in mine)
            assert same == (step % 2 == 0), step
