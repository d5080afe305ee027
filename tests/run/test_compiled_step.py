"""``compile['optimizer']``: the optimizer step compiled (paratrain/compiled_step.py).

On the CPU with fast backends: the step is one graph that runs every step with no
recompile while a scheduler changes the learning rate, training matches the eager run
within the rounding of the traced arithmetic (and the learning rates bit for bit), a
step that cannot be compiled is said in one line and is the eager step bit for bit,
and checkpoints resume bit for bit. CUDA graphs of the step need a GPU (unmeasured here).
"""

import gc
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.compile import CompileOptions, resolve
from paratrain.compiled_step import NOTICE, strategy_blocker
from paratrain.distributed import _compat
from paratrain.parallel.options import TensorParallel
from paratrain.strategies.layout.strategy import LayoutStrategy
from paratrain.strategies.single import SingleDevice
from paratrain.testing.numerics import TrainingBound, assert_losses_within, assert_params_within
from paratrain.testing.pool import spawn

STEPS = 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Dynamo's caches of torch's own optimizer frames fill up with every optimizer of the
    # process (recompile_limit): each test starts from empty ones.
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def dataset(n=8 * STEPS):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def make_optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    if kind == "adam-foreach":
        return torch.optim.Adam(params, lr=0.01, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=0.01, fused=True)
    return torch.optim.Adafactor(params, lr=0.01)


def train(compile=False, *, optimizer="adamw", schedule="cosine", bound=False, **config):
    """Losses, final parameters, lrs after each step, the run's printed lines, ..."""
    lines = []
    run = paratrain.Run(accelerator="cpu", progress=False, seed=5, compile=compile, **config)
    run.print = lambda *args, **kwargs: lines.append(" ".join(map(str, args)))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = make_optimizer(optimizer, model.parameters())
    scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
                 if schedule == "cosine" else torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    model, opt = run.prepare(model, opt, scheduler)
    reference = TrainingBound(model, opt) if bound else None
    losses, lrs = [], []
    for _ in run.epochs(1):
        for x, y in run.loader(dataset(), batch_size=8):
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(opt)
            losses.append(loss.item())
            lrs.append(float(opt.param_groups[0]["lr"]))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    result = SimpleNamespace(losses=losses, params=params, lrs=lrs, lines=lines,
                             compiled=run._compiled_step, bound=reference,
                             skipped=run.precision.skipped_steps, stats=run.epoch_stats[-1])
    run.close()
    return result


def recording_backend(graphs, *, slow_step_s=0.0):
    """A backend that keeps each graph's operators and counts its calls; it takes
    ``slow_step_s`` to compile a graph that is not the model's."""
    def backend(gm, example_inputs):
        entry = {"ops": {str(n.target) for n in gm.graph.nodes
                         if n.op in ("call_function", "call_method")}, "calls": 0}
        graphs.append(entry)
        if "<built-in function linear>" not in entry["ops"]:
            time.sleep(slow_step_s)

        def run(*args):
            entry["calls"] += 1
            return gm.forward(*args)
        return run
    return backend


# -- options ---------------------------------------------------------------------------
def test_optimizer_option_defaults_to_cuda_graphs_and_is_validated():
    graphs = CompileOptions(mode="reduce-overhead")
    on_cuda, notice = resolve(graphs, device=torch.device("cuda"), precision="32",
                              strategy_reason=None)
    assert notice is None and on_cuda.optimizer is None and on_cuda.compiles_optimizer
    on_cpu, notice = resolve(graphs, device=torch.device("cpu"), precision="32",
                             strategy_reason=None)
    assert notice and not on_cpu.cuda_graphs and not on_cpu.compiles_optimizer
    kept, _ = resolve(CompileOptions(mode="reduce-overhead", optimizer=True),
                      device=torch.device("cpu"), precision="32", strategy_reason=None)
    assert not kept.cuda_graphs and kept.optimizer is True and kept.compiles_optimizer
    assert not CompileOptions(mode="reduce-overhead", optimizer=False).compiles_optimizer
    assert not CompileOptions().compiles_optimizer
    with pytest.raises(ValueError, match=r"^compile\['optimizer'\] must be None, True or "
                                         r"False, got 'yes'$"):
        CompileOptions.from_config({"optimizer": "yes"})
    with pytest.raises(ValueError, match=r"must be None, True or False, got 1$"):
        CompileOptions(optimizer=1)


def test_reduce_overhead_on_the_cpu_leaves_the_optimizer_eager():
    eager = train(optimizer="sgd")
    result = train({"backend": "eager", "mode": "reduce-overhead"}, optimizer="sgd")
    assert result.compiled is None
    assert result.lines == ["paratrain: compiling without CUDA graphs: they need a CUDA "
                            "device (this run is on cpu)"]
    assert_eager(result, eager)


# -- one graph, every step, no recompile --------------------------------------------------
@pytest.mark.parametrize("optimizer, schedule, update_ops", [
    ("adamw", "cosine", {"lerp_", "addcdiv_", "mul_"}),
    ("sgd", "step", {"prims.fma.default", "copy_"}),  # p.copy_(fma(g, -lr, p))
])
def test_step_is_one_graph_run_every_step_while_the_lr_changes(optimizer, schedule, update_ops):
    graphs = []
    result = train({"backend": recording_backend(graphs, slow_step_s=0.5), "optimizer": True},
                   optimizer=optimizer, schedule=schedule)
    assert result.lines == []
    step_graphs = [g for g in graphs if update_ops <= g["ops"]]
    model_graphs = [g for g in graphs if "<built-in function linear>" in g["ops"]]
    assert len(model_graphs) == 1 and len(graphs) == len(model_graphs) + len(step_graphs)
    # SGD creates its momentum buffers in its first step: that step is a graph of its own.
    first = 1 if optimizer == "sgd" else 0
    assert len(step_graphs) == 1 + first == result.compiled.graphs
    assert [g["calls"] for g in step_graphs] == [1] * first + [STEPS - first]
    assert len(set(result.lrs)) == STEPS  # the scheduler changed the lr at every step
    # The first step, optimizer step included, is compile_s, not in the epoch's samples/s
    # (SGD's second graph, at the second step, is).
    assert result.stats["compile_s"] >= 0.5 and result.stats["samples"] == 8 * (STEPS - 1)


def test_scheduler_values_are_the_eager_ones_bit_for_bit():
    # float64 tensor lrs: the scheduler's arithmetic is the same as on Python floats.
    assert train({"backend": "eager", "optimizer": True}).lrs == train().lrs


# -- numerics ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_training_matches_eager_within_the_rounding_of_the_traced_update(backend, optimizer):
    # Not bitwise: traced with a tensor lr, p - lr * g is one fused multiply-add (one
    # rounding, not two) and Adam's bias corrections are float32 tensor arithmetic, not
    # Python floats. TrainingBound replays the optimizer on the eager run: two roundings
    # of the update per step, the gradients' rounding carried through Adam.
    eager = train(optimizer=optimizer, bound=True)
    result = train({"backend": backend, "optimizer": True}, optimizer=optimizer)
    assert result.compiled.graphs >= 1 and result.lines == []
    assert_losses_within(result.losses, eager.losses)
    assert_params_within(result.params, eager.params, eager.bound)
    # It did run the traced update: the parameters differ by rounding.
    assert any(not torch.equal(result.params[k], eager.params[k]) for k in result.params)


# -- one-line fallbacks: the eager step, bit for bit --------------------------------------
def assert_eager(result, eager):
    assert result.losses == eager.losses
    assert all(torch.equal(result.params[k], eager.params[k]) for k in result.params)


@pytest.mark.parametrize("optimizer, line", [
    ("adam-foreach", "Dynamo could not trace Adam.step (InternalTorchDynamoError: "
                     "RuntimeError: lr as a Tensor is not supported for capturable=False and "
                     "foreach=True)"),
    ("adamw-fused", "AdamW(fused=True) runs torch's fused kernel, which Dynamo leaves eager "
                    "(fused=False compiles the update)"),
    ("adafactor", "Dynamo compiled no graph of Adafactor.step and ran it eagerly (a frame it "
                  "skips, such as a host read in a loop, or past "
                  "torch._dynamo.config.recompile_limit optimizers in one process: "
                  "torch.compiler.reset() between runs)"),
])
def test_optimizer_that_cannot_be_compiled_is_one_line_and_steps_eagerly(optimizer, line):
    eager = train(optimizer=optimizer)
    result = train({"backend": "eager", "optimizer": True}, optimizer=optimizer)
    assert result.lines == [NOTICE + line]
    assert_eager(result, eager)
    assert result.lrs == eager.lrs


def test_dynamo_cache_spent_by_earlier_optimizers_is_one_line(request, monkeypatch):
    # Dynamo runs torch's optimizer frames eagerly once recompile_limit (8) optimizers of
    # the process have filled their caches, dead ones included. Pinned at its default:
    # compile_forward raises it for the modules it compiles (earlier tests', this one's).
    limit = torch._dynamo.config.patch(recompile_limit=8)
    limit.__enter__()
    request.addfinalizer(lambda: limit.__exit__(None, None, None))
    monkeypatch.setattr(_compat, "allow_recompiles", lambda count: None)
    x = torch.randn(4, 6)
    for _ in range(8):
        model = nn.Linear(6, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
        model(x).sum().backward()
        torch.compile(lambda o: o.step(), backend="eager")(opt)
        del model, opt
    gc.collect()
    eager = train()
    result = train({"backend": "eager", "optimizer": True})
    assert result.lines == [NOTICE + "Dynamo compiled no graph of AdamW.step and ran it eagerly "
                         "(a frame it skips, such as a host read in a loop, or past "
                         "torch._dynamo.config.recompile_limit optimizers in one process: "
                         "torch.compiler.reset() between runs)"]
    assert_eager(result, eager)


def test_strategy_whose_step_communicates_is_one_line(monkeypatch):
    # A parameter server's step pushes the gradients (ps itself does not compile at all).
    def push(self, optimizer):
        optimizer.step()
    eager = train(optimizer="sgd")
    monkeypatch.setattr(SingleDevice, "optimizer_step", push)
    result = train({"backend": "eager", "optimizer": True}, optimizer="sgd")
    assert result.lines == [NOTICE + "strategy 'single' steps through its own code, not "
                         "optimizer.step() (its step communicates: a parameter server's push, "
                         "a semi-synchronous outer step)"]
    assert result.compiled is None
    assert_eager(result, eager)


def test_layout_step_is_compiled_unless_sequence_parallel_completes_gradients():
    strategy = object.__new__(LayoutStrategy)  # only its class and layout are read
    for tensor in (None, TensorParallel(sequence_parallel=False)):
        strategy.layout = SimpleNamespace(tensor=tensor)
        assert strategy_blocker(strategy) is None
    strategy.layout = SimpleNamespace(tensor=TensorParallel(sequence_parallel=True))
    assert strategy_blocker(strategy) == ("sequence parallel completes the gradients across "
                                          "tensor peers in its optimizer step (communication)")


def test_scaler_and_clipping_keep_the_step_compiled():
    # 16-mixed reads the scaler's inf check on the host before the step, clipping scales
    # the gradients on the device: neither is inside the compiled step.
    for config in ({"precision": "16-mixed"}, {"max_grad_norm": 0.5}):
        graphs = []
        result = train({"backend": recording_backend(graphs), "optimizer": True}, **config)
        assert result.lines == [] and result.compiled.graphs == 1, config
        # The scaler skips the steps that overflowed (the first, at its initial scale).
        calls = [g["calls"] for g in graphs if "lerp_" in g["ops"]]
        assert calls == [STEPS - result.skipped] and calls[0] >= STEPS - 1, config


def zero1_worker(rank, world_size, compiled):
    lines = []
    run = paratrain.Run(strategy="zero1", accelerator="cpu", progress=False, seed=5,
                        compile={"backend": "eager", "optimizer": True} if compiled else False)
    run.print = lambda *args, **kwargs: lines.append(" ".join(map(str, args)))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    model, opt = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    losses = []
    for _ in run.epochs(1):
        for x, y in run.loader(dataset(), batch_size=4):
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(opt)
            losses.append(loss.item())
    run.close()
    return losses, lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero1_sharded_optimizer_is_one_line_and_steps_eagerly():
    eager = spawn(zero1_worker, 2, False, timeout=300)
    compiled = spawn(zero1_worker, 2, True, timeout=300)
    for (eager_losses, _), (losses, lines) in zip(eager, compiled):
        assert losses == eager_losses
        assert lines == [NOTICE + "zero1's ZeroRedundancyOptimizer broadcasts each rank's "
                         "updated shard inside its step (Dynamo would cut the step at every "
                         "collective)"]


# -- checkpoints ----------------------------------------------------------------------------
def resumable(directory, steps):
    run = paratrain.Run(accelerator="cpu", progress=False, seed=5, checkpoint_dir=str(directory),
                        checkpoint_every=1, compile={"backend": "eager", "optimizer": True})
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    model, opt = run.prepare(model, opt, scheduler)
    losses = []
    for _ in run.epochs(1):
        for x, y in run.loader(dataset(), batch_size=8):
            if run.global_step == steps:
                break
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(opt)
            losses.append(loss.item())
    state = ({k: v.detach().clone() for k, v in model.named_parameters()},
             opt.param_groups[0]["lr"].clone(), run._compiled_step.graphs)
    run.close()
    return losses, state


def test_tensor_lrs_save_and_resume_bit_for_bit(tmp_path):
    whole, (params, lr, _) = resumable(tmp_path / "whole", 4)
    first, _ = resumable(tmp_path / "cut", 2)
    rest, (resumed, resumed_lr, graphs) = resumable(tmp_path / "cut", 4)
    assert first + rest == whole and len(rest) == 2
    assert all(torch.equal(resumed[k], params[k]) for k in params)
    assert resumed_lr.dtype == torch.float64 and torch.equal(resumed_lr, lr)
    assert graphs == 1
