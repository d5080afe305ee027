"""Calibration for ``paratrain plan``: a real model measured once on this machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.plan import calibrate, default_model


def test_calibrate_tiny_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    pr = calibrate(model, torch.randn(5, 8), repeats=2)
    assert pr.num_parameters == 8 * 16 + 16 + 16 * 4 + 4
    assert pr.param_bytes == 4
    # Saved for backward: the input (8 floats) and the ReLU output (16 floats, shared by the
    # second Linear); the weights are parameters and do not count.
    assert pr.activation_bytes_per_sample == pytest.approx((8 + 16) * 4)
    assert pr.compute_time_per_sample > 0
    assert 0 <= pr.backward_fraction <= 1
    assert pr.num_layers == 2
    # Per child: its parameters and its output per sample (what a pipeline cut there sends).
    assert pr.chain == ((8 * 16 + 16, 16 * 4.0), (0, 16 * 4.0), (16 * 4 + 4, 4 * 4.0))
    assert len(pr.chain_times) == 3 and all(t > 0 for t in pr.chain_times)
    assert all(p.grad is None for p in model.parameters())


def test_calibrate_handles_in_place_children_and_keeps_the_input():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4),
                          nn.ReLU(inplace=True))
    example = torch.randn(5, 8)
    before = example.clone()
    pr = calibrate(model, example, repeats=2)
    assert len(pr.chain_times) == 4
    assert torch.equal(example, before)


def test_calibrate_times_each_child_so_compute_heavy_stages_show():
    # A wide Linear (256 x 4096) and a narrow one (4096 x 2): the per-child times show
    # where the compute is, which parameter counts alone would not. The narrow one is
    # launch-bound, so the wide one must be far heavier for the ratio to survive a loaded
    # machine (at 256 x 1024 a CI run measured 5.0x, the bar).
    # On the CPU on purpose: on a GPU both are launch-bound at this size (see the gpu test).
    # One thread: on a busy machine, idle OpenMP workers waiting for descheduled ones make
    # tiny ops take as long as big ones.
    model = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pr = calibrate(model, torch.randn(256, 256), repeats=3, device="cpu")
    finally:
        torch.set_num_threads(threads)
    heavy, _, light = pr.chain_times
    assert heavy > 5 * light


def test_calibrate_default_convnet_and_custom_loss():
    model = default_model()
    pr = calibrate(model, torch.randn(2, 1, 28, 28), loss_fn=lambda out: out.pow(2).mean(),
                   repeats=1)
    assert pr.num_parameters == 431_242
    assert pr.num_layers == 4
    assert pr.activation_bytes_per_sample > 28 * 28 * 4


def test_calibrate_rejects_bad_input():
    with pytest.raises(ValueError, match="repeats"):
        calibrate(nn.Linear(2, 2), torch.randn(1, 2), repeats=0)
    with pytest.raises(ValueError, match="no parameters"):
        calibrate(nn.ReLU(), torch.randn(1, 2))


def test_back_to_back_times_the_passes_between_two_clock_reads(monkeypatch):
    # CUDA's default (a loop queues the next pass while the device runs the last one),
    # here on the CPU: the same profile, and the clock read twice more, around the loop.
    from paratrain.plan import calibration

    reads = []
    real = calibration.make_clock

    def counting(device, **kwargs):
        clock = real(device, **kwargs)

        def now():
            reads.append(device.type)
            return clock()
        return now

    monkeypatch.setattr(calibration, "make_clock", counting)
    counts = {}
    for mode in (None, False, True):
        reads.clear()
        profile = calibrate(nn.Linear(8, 8), torch.randn(4, 8), repeats=3, device="cpu",
                            back_to_back=mode)
        counts[mode] = len(reads)
        assert profile.compute_time_per_sample > 0 and 0 < profile.backward_fraction < 1
    assert counts[None] == counts[False] and counts[True] == counts[False] + 2
