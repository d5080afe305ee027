"""Tied parameters on different pipeline stages: one copy per rank, gradients summed."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.strategies.pipeline.ties import TiedCopies
from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_losses_within,
    assert_params_within,
)
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification


def tied():
    """Layers 0 and 3 are one tensor; split at 2 they land on different stages."""
    model = nn.Sequential(*(nn.Linear(10, 10) for _ in range(4)), nn.Linear(10, 3))
    model[3].weight = model[0].weight
    return model


def train(strategy, options=None):
    # max_grad_norm well below the norm: clipping scales every step, so a tie counted
    # twice in the norm (once per stage) would change the steps.
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=7,
                        strategy_options=options or {}, max_grad_norm=0.05)
    model = tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(synthetic_classification(48), batch_size=8)
    losses, norms = [], []
    for _ in run.epochs(1):
        for step, (x, y) in enumerate(loader):
            if step == 3:
                break
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(optimizer)
            losses.append(float(run.mean(loss)))
            norms.append(run.last_grad_norm)
    state = (run.strategy.full_state_dict(model) if strategy == "pipeline"
             else {k: v.detach().clone() for k, v in model.state_dict().items()})
    run.close()
    return losses, norms, state, bound.tolerances() if bound else None


def tied_worker(rank, world_size, schedule):
    return train("pipeline", {"split_points": (2,), "schedule": schedule,
                              "num_microbatches": 2})


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_tie_across_stages_trains_as_one_tensor(schedule):
    ref_losses, ref_norms, ref_state, tolerances = train("single")
    for losses, norms, state, _ in spawn(tied_worker, 2, schedule):
        # The two copies ('0.weight' on stage 0, '3.weight' on stage 1) got the same
        # summed gradient and the same clipping: still equal, bit for bit.
        assert torch.equal(state["0.weight"], state["3.weight"])
        assert_params_within(state, ref_state, {**tolerances, "3.weight": tolerances["0.weight"]})
        assert_losses_within(losses, ref_losses)
        for got, want in zip(norms, ref_norms):  # the tied tensor counted once
            assert abs(got - want) <= REASSOCIATION * want


def test_a_tie_tensor_parallel_would_split_differently_is_refused_in_one_line():
    # The head in the stage's tensor-parallel plan, the embedding whole: not one slice.
    mesh = SimpleNamespace(degrees=SimpleNamespace(tensor_degree=2, pipeline_degree=2))
    tie = (("transformer.wte.weight", 0), ("lm_head.weight", 1))
    with pytest.raises(ValueError) as refused:
        TiedCopies((tie,), mesh, split=frozenset({"lm_head", "transformer.h.0.mlp.c_fc"}))
    assert str(refused.value) == (
        "parameters 'transformer.wte.weight' (stage 0) and 'lm_head.weight' (stage 1) are "
        "tied (one tensor) but the pipeline puts them on different stages, which tensor "
        "parallel splits differently; put them on one stage (split_points, or the parts of "
        "the PipelineLayout) or untie them")
