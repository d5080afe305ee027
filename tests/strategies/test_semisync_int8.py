"""``DiLoCo(comm_dtype="int8")``: per-rank scales, all-gathered, averaged alike on every rank.

The quantization error is bounded by arithmetic (``paratrain/strategies/semisync/
quantize.py``): per element ``|p - q scale| <= scale (1/2 + 2**-16)`` with ``scale =
max|p| / 127``. On two gloo ranks: before the first outer step an int8 run is the
float32 run bit for bit, so at that step their parameters differ by the outer step of
the mean's error, ``lr (1 + mu) |err|``, and the mean of every outer step is checked
against the exact mean of the pseudo-gradients that were sent; the replicas are
bitwise equal right after each outer step (also overlapped); one collective per sync;
a save with an int8 fragment in flight resumes bit for bit.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain import DiLoCo, Parallel
from paratrain.strategies.capabilities import local_module
from paratrain.strategies.semisync import outer as outer_module
from paratrain.strategies.semisync.outer import local_piece
from paratrain.strategies.semisync.quantize import mean_of, pack, quantize, unpack
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

SLACK = 0.5 + 2.0 ** -16
"""The round trip's bound in units of the scale (the derivation in quantize.py)."""


# -- the quantizer alone -------------------------------------------------------------------

@pytest.mark.parametrize("magnitude", [1e-20, 1e-3, 1.0, 1e20])
def test_round_trip_error_is_at_most_half_a_step(magnitude):
    g = torch.Generator().manual_seed(0)
    value = torch.randn(4097, generator=g) * magnitude
    q, scale = quantize(value)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (1,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127  # the extremum uses the range
    assert scale.item() == pytest.approx(value.abs().max().item() / 127, rel=2 ** -22)
    error = (value.double() - q.double() * scale.double()).abs()
    assert error.max().item() <= scale.item() * SLACK
    # A round trip that dropped half a step (or used another scale) would be caught.
    assert error.max().item() > scale.item() * 0.45


def test_zero_and_empty_tensors_quantize_to_zero():
    q, scale = quantize(torch.zeros(5))
    assert torch.equal(q, torch.zeros(5, dtype=torch.int8)) and scale.item() == 1.0
    assert torch.equal(mean_of(torch.cat([pack(torch.zeros(5))] * 3), 3), torch.zeros(5))
    q, scale = quantize(torch.zeros(0))
    assert q.numel() == 0 and scale.item() == 1.0


def test_messages_carry_the_scale_and_average_in_rank_order():
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(33, generator=g) * s for s in (0.5, 2.0, 8.0)]
    messages = [pack(v) for v in values]
    assert all(m.dtype == torch.int8 and m.numel() == 33 + 4 for m in messages)
    parts = [quantize(v) for v in values]
    for message, (q, scale) in zip(messages, parts):
        got_q, got_scale = unpack(message)
        assert torch.equal(got_q, q) and torch.equal(got_scale, scale)
    expected = (parts[0][0].float() * parts[0][1] + parts[1][0].float() * parts[1][1]
                + parts[2][0].float() * parts[2][1]) / 3
    assert torch.equal(mean_of(torch.cat(messages), 3), expected)
    exact = torch.stack([v.double() for v in values]).mean(0)
    bound = sum(s.item() for _, s in parts) / 3 * SLACK + 2 ** -22 * 8.0 * 3
    assert (mean_of(torch.cat(messages), 3).double() - exact).abs().max().item() <= bound


# -- gloo ranks -------------------------------------------------------------------------------

def mlp() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: local_piece(p).detach().clone() for n, p in model.named_parameters()}


def train(mode, *, every_step=None, stop_at=None, checkpoint_dir=None, checkpoint_every=None):
    """AdamW on 2 groups, 2 epochs of 8 steps; params and loss after each step."""
    history = []
    with paratrain.Run(parallel=Parallel(dp_replicate=2, semi_sync=mode), accelerator="cpu",
                       progress=False, seed=3, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=checkpoint_every) as run:
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        model, opt = run.prepare(model, opt)
        for _ in run.epochs(2):
            for x, y in run.loader(synthetic_classification(64), batch_size=4):
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(opt)
                history.append((params_of(local_module(run.strategy, model)),
                                float(loss.detach())))
                if every_step is not None:
                    every_step(run)
                if run.global_step == stop_at:
                    return history
    return history


class Recorder:
    """What each sync quantized (this rank's pseudo-gradients) and the means it applied;
    the collectives called (name, dtype of the first tensor)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
             "broadcast", "reduce_scatter_tensor", "all_to_all_single", "barrier")

    def __init__(self) -> None:
        self.sent, self.means, self.calls = [], [], []
        self.saved = {"pack": outer_module.pack, "mean_of": outer_module.mean_of}
        self.collectives = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self) -> Recorder:
        def pack_(value):
            self.sent.append(value.detach().float().clone())
            return self.saved["pack"](value)

        def mean_of_(gathered, replicas):
            self.means.append(self.saved["mean_of"](gathered, replicas))
            return self.means[-1]

        def spy(name, original):
            def call(*args, **kwargs):
                first = args[0] if args else None
                self.calls.append((name, getattr(first, "dtype", None)))
                return original(*args, **kwargs)
            return call

        outer_module.pack, outer_module.mean_of = pack_, mean_of_
        for name, original in self.collectives.items():
            setattr(dist, name, spy(name, original))
        return self

    def __exit__(self, *exc) -> None:
        outer_module.pack, outer_module.mean_of = self.saved["pack"], self.saved["mean_of"]
        for name, original in self.collectives.items():
            setattr(dist, name, original)


def int8_worker(rank, world_size, directory):
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    out = {"fp32": train(DiLoCo(every=4))}
    with Recorder() as record:
        counts = []
        out["int8"] = train(DiLoCo(every=4, comm_dtype="int8"),
                            every_step=lambda run: counts.append(len(record.calls)))
    # After step 1 (prepare's own collectives before it): steps 2..16.
    out["sent"], out["means"], out["calls"] = record.sent, record.means, record.calls[counts[0]:]
    out["counts"] = [b - a for a, b in zip(counts, counts[1:])]
    out["overlap"] = train(DiLoCo(every=4, overlap=True, comm_dtype="int8"))
    # Streaming, overlapped: fragment 1 is sent after step 2 and applied after step 3, so
    # the checkpoint at step 2 holds it in flight (int8 messages).
    mode = DiLoCo(every=4, fragments=2, overlap=True, comm_dtype="int8")
    sizes = []
    out["full"] = train(mode)[-1][0]
    train(mode, checkpoint_dir=directory, checkpoint_every=2, stop_at=2,
          every_step=lambda run: sizes.append(sum(
              local_piece(p).numel() for b in run.strategy.outer.fragments[1] for p in b.params)))
    out["resumed"] = train(mode, checkpoint_dir=directory)[-1][0]
    out["fragment1"] = sizes[0]
    return out


@pytest.fixture(scope="module")
def int8_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("i8_semisync")
    return spawn(int8_worker, 2, str(directory), timeout=420), directory


def test_int8_equals_fp32_until_the_first_outer_step_then_within_the_bound(int8_ranks):
    results, _ = int8_ranks
    lr, mu = 0.7, 0.9  # DiLoCo's defaults
    for out in results:
        fp32, int8 = out["fp32"], out["int8"]
        for step in range(3):  # inner steps only: no communication, the same bytes
            assert all(torch.equal(int8[step][0][n], fp32[step][0][n]) for n in fp32[step][0])
        # Step 4: the outer step of the mean's error e (Nesterov, momentum from 0):
        # s - lr (d + mu d), so the parameters differ by lr (1 + mu) e, plus the float32
        # roundings of the two outer steps (a few ulps of the largest magnitude).
        e = mean_error_bound([r["sent"][0] for r in results])
        big = max(t.abs().max().item() for step in (2, 3) for run in (fp32, int8)
                  for t in run[step][0].values())
        bound = lr * (1 + mu) * e + 8 * torch.finfo(torch.float32).eps * big
        diff = max((int8[3][0][n] - fp32[3][0][n]).abs().max().item() for n in fp32[3][0])
        assert 0 < diff <= bound, (diff, bound)


def mean_error_bound(sent: list[torch.Tensor]) -> float:
    """``mean_i scale_i (1/2 + 2**-16)`` (``scale_i`` rounded up by an ulp) plus the
    float32 rounding of the sum: the bound on ``|mean_of - mean(p_i)|``."""
    tops = [p.abs().max().item() for p in sent]
    return (sum(t / 127 * (1 + 2 ** -23) for t in tops) / len(tops) * SLACK
            + 2 ** -23 * max(tops))


def test_every_outer_mean_is_within_the_quantization_bound(int8_ranks):
    results, _ = int8_ranks
    assert [len(r["sent"]) for r in results] == [4, 4]  # steps 4, 8, 12, 16
    for sync in range(4):
        sent = [r["sent"][sync] for r in results]
        exact = torch.stack([p.double() for p in sent]).mean(0)
        bound = mean_error_bound(sent)
        for out in results:
            error = (out["means"][sync].double() - exact).abs().max().item()
            assert 0 < error <= bound, (sync, error, bound)
        assert torch.equal(results[0]["means"][sync], results[1]["means"][sync])


def test_int8_replicas_are_bitwise_equal_after_each_outer_step(int8_ranks):
    results, _ = int8_ranks
    for run, synced in (("int8", {4, 8, 12, 16}), ("overlap", {5, 9, 13})):
        mine, peer = results[0][run], results[1][run]
        assert len(mine) == 16
        for step, ((a, _), (b, _)) in enumerate(zip(mine, peer), 1):
            assert all(torch.equal(a[n], b[n]) for n in a) == (step in synced), (run, step)
    for out in results:
        losses = [loss for _, loss in out["int8"]]
        assert sum(losses[-4:]) < sum(losses[:4])  # it trains


def test_int8_syncs_are_one_all_gather_each(int8_ranks):
    results, _ = int8_ranks
    for out in results:
        # Steps 2..16: one int8 all-gather per sync (4, 8, 12, 16), no all-reduce, and
        # nothing else: each replica group (one rank here) agrees on its non-finite
        # flags alone, with no per-step collective across the groups.
        assert out["calls"] == [("all_gather_single", torch.int8)] * 4, out["calls"]
        assert out["counts"] == [0, 0, 1] + [0, 0, 0, 1] * 3


def test_a_save_with_an_int8_fragment_in_flight_resumes_bitwise(int8_ranks):
    results, directory = int8_ranks
    for rank, out in enumerate(results):
        assert all(torch.equal(out["full"][n], out["resumed"][n]) for n in out["full"])
        (file,) = sorted(Path(directory).glob(f"step-000000002*/**/semisync-{rank}of2.pt"))
        pending = torch.load(file, weights_only=True)["outer"]["pending"]
        assert list(pending) == [1]
        (messages,) = pending[1]  # both ranks' scale and q, gathered
        assert messages.dtype == torch.int8
        assert messages.numel() == 2 * (out["fragment1"] + 4)
