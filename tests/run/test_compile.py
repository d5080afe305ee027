"""``Run(compile=...)``: compiled strategies match eager, bad input is one line, the
CUDA-graph conditions are checked up front, and the step keeps values on the device.

Inductor works on CPU (with a C++ compiler) but needs tens of seconds of C++ compilation
per graph on two cores, so it is exercised once, in the single-process test; ``ddp`` and
``fsdp`` use a counting backend that runs Dynamo's graphs as they are, to see where the
graphs are split.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.compile import CompileOptions, partial_batch_notice, resolve
from paratrain.testing.numerics import REASSOCIATION
from paratrain.testing.pool import spawn

# Relative: compiled kernels reorder float32 reductions, which changes a sum by at most
# REASSOCIATION (see paratrain.testing.numerics) whatever the CPU's vector width.
LOSS_TOLERANCE = REASSOCIATION


def dataset():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def mlp(hidden=16):
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 2))


def train(*, strategy="single", compile=False, batch_size=8, hidden=16, **config):
    run = paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=5,
                        compile=compile, **config)
    model = mlp(hidden)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.2))
    loader = run.loader(dataset(), batch_size=batch_size)
    losses = []
    for _ in run.epochs(1):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(optimizer)
            losses.append(loss.item())
    keys = sorted(run.strategy.unwrap(model).state_dict())
    stats = run.epoch_stats[-1]
    run.close()
    return losses, keys, stats


def counting_backend(calls):
    def backend(gm, example_inputs):
        calls.append(len(list(gm.graph.nodes)))
        return gm.forward
    return backend


# -- configuration and checks (no compilation) -------------------------------------------
def test_compile_options_are_validated_with_one_line():
    assert CompileOptions.from_config(False) is None
    assert CompileOptions.from_config(True) == CompileOptions()
    with pytest.raises(ValueError, match=r"compile has unknown key\(s\) \['modee'\]"):
        paratrain.Run(accelerator="cpu", progress=False, compile={"modee": "default"})
    with pytest.raises(ValueError, match="compile\\['mode'\\] must be one of"):
        CompileOptions.from_config({"mode": "fast"})
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        CompileOptions.from_config("yes")


def test_cuda_graphs_fall_back_with_the_reasons():
    graphs = CompileOptions(mode="reduce-overhead", dynamic=True)
    options, notice = resolve(graphs, device=torch.device("cpu"), precision="16-mixed",
                              strategy_reason="FSDP's all-gathers run between the graphs")
    assert options.mode is None and not options.cuda_graphs and options.dynamic
    assert "\n" not in notice
    for reason in ("CUDA device", "dynamic", "16-mixed", "FSDP"):
        assert reason in notice
    ok, none = resolve(CompileOptions(mode="reduce-overhead"), device=torch.device("cuda", 0),
                       precision="bf16-mixed", strategy_reason=None)
    assert ok.cuda_graphs and none is None
    autotune = CompileOptions(mode="max-autotune").without_cuda_graphs()
    assert autotune.mode == "max-autotune-no-cudagraphs"


def test_partial_last_batch_is_reported_for_cuda_graphs():
    assert partial_batch_notice(samples_per_rank=32, batch_size=8) is None
    notice = partial_batch_notice(samples_per_rank=30, batch_size=8)
    assert "6 of 8 samples" in notice and "30" in notice


@pytest.mark.parametrize("strategy, options, message", [
    ("mp", {}, "compile is not supported with strategy 'mp'; use "),
    ("ddp", {"bucket_cap_mb": 0.5}, "compile with strategy 'ddp' needs bucket_cap_mb >= 1"),
])
def test_combination_that_cannot_compile_is_one_line(strategy, options, message):
    run = paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, compile=True,
                        strategy_options=options)
    model = mlp()
    with pytest.raises(ValueError, match=message):
        run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    run.close()


def test_last_grad_norm_stays_on_the_device_until_read():
    run = paratrain.Run(accelerator="cpu", progress=False, max_grad_norm=0.01)
    model = mlp()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = dataset().tensors
    run.backward(F.cross_entropy(model(x), y))
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    run.step(optimizer)
    assert isinstance(run._step.last_grad_norm, torch.Tensor)
    assert isinstance(run.last_grad_norm, float)
    assert run.last_grad_norm == pytest.approx(float(expected), rel=1e-6)
    run.close()


# -- compiled training against eager ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_single_with_inductor_matches_eager():
    eager, eager_keys, eager_stats = train()
    compiled, keys, stats = train(compile={"backend": "inductor"})
    assert compiled == pytest.approx(eager, rel=LOSS_TOLERANCE)
    assert keys == eager_keys  # no "_orig_mod." in checkpoints
    assert "compile_s" not in eager_stats
    # The compiling step is timed apart and left out of the epoch's samples.
    assert stats["compile_s"] > stats["seconds"] / 3 and stats["samples"] == 32 - 8


def worker(rank, world_size, strategy, compiled, config):
    # One Run per process: a second Run after a compiled one was seen to hang joining
    # the new process group.
    calls = []
    compile = {"backend": counting_backend(calls)} if compiled else False
    losses, keys, stats = train(strategy=strategy, compile=compile, **config)
    return losses, keys, stats, len(calls)


def spawn_pair(strategy, **config):
    eager = spawn(worker, 2, strategy, False, config, timeout=400)
    compiled = spawn(worker, 2, strategy, True, config, timeout=400)
    return list(zip(eager, compiled))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_ddp_matches_eager_and_splits_at_buckets():
    # 1.45 MB of parameters over 1 MiB buckets: Dynamo's DDP optimiser splits the graph.
    pairs = spawn_pair("ddp", hidden=600, strategy_options={"bucket_cap_mb": 1})
    for (eager, _, _, _), (compiled, _, stats, graphs) in pairs:
        assert compiled == pytest.approx(eager, rel=LOSS_TOLERANCE)
        assert graphs > 1  # one graph per bucket, not one for the whole model
        assert stats["compile_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_fsdp_matches_eager_per_block():
    for (eager, _, _, _), (compiled, keys, _, graphs) in spawn_pair("fsdp"):
        assert compiled == pytest.approx(eager, rel=LOSS_TOLERANCE)
        assert graphs == 3  # each Linear is an FSDP unit, compiled on its own
        assert not any("_orig_mod" in k for k in keys)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_tensor_parallel_matches_eager():
    # tp had no compile before the layout runtime; the one order compiles the split model.
    plan = {"plan": {"0": "colwise", "2": "rowwise"}}
    for (eager, _, _, _), (compiled, _, _, graphs) in spawn_pair("tp", strategy_options=plan):
        assert compiled == pytest.approx(eager, rel=LOSS_TOLERANCE)
        assert graphs >= 1
