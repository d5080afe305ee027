"""The strategy contract, checked for every registered strategy on CPU ranks.

One run per strategy (spawned over gloo ranks when it is multi-process) trains
two optimizer steps of two micro-steps each and checks, against a
single-process reference with the same global batch:

(a) the parameters equal the reference where the strategy promises it;
(c) ``no_sync``: the first micro-step of each group reduces no gradients, the
    last one does (where there is more than one replica), and the update after
    leaving ``no_sync`` is the reference's;
(b) save -> load restores this rank's parameters after they were overwritten;
(d) teardown: the process group is destroyed and nothing keeps the wrapped
    model alive once the user drops it.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import paratrain
from paratrain.strategies import available_strategies
from paratrain.strategies.capabilities import ShardedState, local_module
from paratrain.testing.numerics import TrainingBound, assert_params_within
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

GLOBAL_BATCH = 8
ACCUMULATE = 2
STEPS = 2
# Profiler event names of collectives that reduce gradients (gloo and the c10d ops).
GRADIENT_REDUCTIONS = ("allreduce", "all_reduce", "reduce_scatter", "reducescatter")


@dataclass(frozen=True)
class Promise:
    """What a strategy promises in this configuration, and why."""

    processes: int
    reason: str
    options: dict[str, Any] = field(default_factory=dict)
    servers: int = 0
    """Ranks that serve instead of training (the parameter server's last ranks)."""
    activation_reductions: int = 0
    """Profiler events of activation all-reduces in each micro-step (tensor parallel's
    rowwise layers): they carry no gradients, so ``no_sync`` keeps them."""
    reduces_gradients: bool = False
    """Gradients are reduced over several data-parallel ranks at the group boundary
    (which is what ``no_sync`` defers)."""


MLP_PLAN = {"0": "colwise", "2": "rowwise"}
"""Tensor parallel over :func:`mlp`: its first two linears split, the last replicated."""
TP_EVENTS = 3
"""The rowwise layer's one all-reduce, as nested profiler events (functional op, c10d op,
gloo); the colwise layer's input needs no gradient, so backward adds none."""

PROMISES = {
    "single": Promise(1, "it is the reference"),
    "dp": Promise(1, "on CPU there is one device: it runs as single"),
    "mp": Promise(1, "without two GPUs it runs as single"),
    "ddp": Promise(2, "gradients averaged over replicas = the global batch's gradient",
                    reduces_gradients=True),
    "zero1": Promise(2, "ddp's averaged gradient; each rank updates its share and broadcasts it",
                      reduces_gradients=True),
    "zero2": Promise(2, "fsdp's reduce-scattered shards, parameters whole from forward to backward",
                      reduces_gradients=True),
    "fsdp": Promise(2, "reduce-scattered gradient shards = the averaged gradient, sharded",
                     reduces_gradients=True),
    "hybrid": Promise(2, "HSDP over one node of 2 processes: FSDP with a 2-D mesh",
                       reduces_gradients=True),
    "pipeline": Promise(2, "micro-batch gradients summed over the schedule = the batch's",
                        options={"num_microbatches": 2}),
    "tp": Promise(2, "the split layers compute the same products; all ranks read the batch",
                  options={"plan": MLP_PLAN}, activation_reductions=TP_EVENTS),
    "fsdp_tp": Promise(4, "tensor parallel inside pairs, FSDP across them (shard 2 x tensor 2)",
                       options={"plan": MLP_PLAN, "tensor_degree": 2}, activation_reductions=TP_EVENTS,
                       reduces_gradients=True),
    "ps": Promise(2, "sync mode with one worker applies exactly the worker's gradient",
                  options={"num_servers": 1, "mode": "sync"}, servers=1),
}


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def plain(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in state.items()}


def whole_model(strategy, model) -> dict[str, torch.Tensor]:
    if isinstance(strategy, ShardedState):
        return plain(strategy.full_state_dict(model))
    return plain(strategy.unwrap(model).state_dict())


def reductions(prof) -> int:
    return sum(1 for e in prof.events() if any(r in e.name.lower() for r in GRADIENT_REDUCTIONS))


def train_and_check(name: str, options: dict[str, Any], directory: str) -> dict[str, Any]:
    run = paratrain.Run(strategy=name, strategy_options=options, progress=False,
                        accelerator="cpu", seed=7, accumulate=ACCUMULATE)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bound = TrainingBound(model, optimizer) if name == "single" else None
    try:
        model, optimizer = run.prepare(model, optimizer)
    except SystemExit:  # a server rank served until the workers closed their runs
        return {"server": True, "group_left": dist.is_initialized()}
    strategy = run.strategy
    batch = GLOBAL_BATCH // strategy.data_parallel_size
    loader = run.loader(synthetic_classification(64), batch_size=batch)
    counts = []
    for _, (x, y) in zip(range(STEPS * ACCUMULATE), loader):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run.backward(F.cross_entropy(model(x), y))
        counts.append(reductions(prof))
        run.step(optimizer)
    params = whole_model(strategy, model)
    # (b) save, overwrite, load.
    path = run.save(directory)
    saved = plain(local_module(strategy, model).state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    run.load(path or _checkpoint_in(directory))
    restored = plain(local_module(strategy, model).state_dict())
    # (d) teardown.
    wrapped = weakref.ref(model)
    run.close()
    group_left = dist.is_initialized()
    del run, model, optimizer, loader, strategy
    gc.collect()
    return {"server": False, "params": params, "bound": bound, "counts": counts, "saved": saved,
            "restored": restored, "group_left": group_left, "model_alive": wrapped() is not None}


def _checkpoint_in(directory: str) -> str:
    from pathlib import Path

    return str(max(Path(directory).glob("step-*.pt")))


def contract_worker(rank: int, world_size: int, name: str, options: dict, directory: str):
    return train_and_check(name, options, directory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_and_check("single", {}, str(tmp_path_factory.mktemp("reference")))


def test_every_registered_strategy_declares_its_promise():
    assert set(PROMISES) == set(available_strategies())


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.slow] if PROMISES[n].processes > 1 else [])
    for n in available_strategies()])
def test_contract(name, reference, tmp_path):
    promise = PROMISES[name]
    if promise.processes == 1:
        results = [train_and_check(name, promise.options, str(tmp_path))]
    else:
        results = spawn(contract_worker, promise.processes, name, promise.options,
                        str(tmp_path), timeout=240)
    workers = [r for r in results if not r["server"]]
    assert len(workers) == promise.processes - promise.servers
    for result in results:
        assert not result["group_left"], "the process group outlived run.close()"
    for result in workers:
        # (a) the reference.
        # Within what reordering float32 sums can change, carried through SGD's
        # arithmetic (paratrain.testing.numerics).
        assert set(result["params"]) == set(reference["params"])
        assert_params_within(result["params"], reference["params"], reference["bound"])
        # (c) no gradient reduction inside no_sync; one at the boundary with replicas.
        inside, boundary = result["counts"][0::ACCUMULATE], result["counts"][ACCUMULATE - 1::ACCUMULATE]
        activations = promise.activation_reductions
        assert inside == [activations] * STEPS, f"gradients reduced inside no_sync: {result['counts']}"
        if promise.reduces_gradients:
            assert all(count > activations for count in boundary), result["counts"]
        # (b) the round trip.
        assert result["restored"].keys() == result["saved"].keys()
        for key, value in result["saved"].items():
            assert torch.equal(result["restored"][key], value), key
        # (d) nothing keeps the wrapped model alive.
        assert not result["model_alive"]


def test_hybrid_is_the_strategy_that_runs_its_degrees_named_hybrid():
    # No composite forwarding members: every preset returns the one layout strategy,
    # named after the preset, so no contract member can silently fall back to a
    # single-process default.
    from paratrain.distributed.topology import Topology
    from paratrain.strategies import create_strategy
    from paratrain.strategies.layout import LayoutStrategy

    for name in ("hybrid", "fsdp", "zero2", "tp", "fsdp_tp", "pipeline"):
        strategy = create_strategy(name, Topology(), timeout_s=12.0)
        assert type(strategy) is LayoutStrategy and strategy.name == name
        assert strategy.timeout_s == 12.0 and strategy.mesh.degrees.shape == (1, 1, 1, 1, 1)
        assert "running as 'single'" in strategy.notice()  # one process: the fallback line
