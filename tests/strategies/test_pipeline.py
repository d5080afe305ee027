"""Pipeline (GPipe and 1F1B) on gloo ranks against a single-process reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed.partition import balanced_split
from paratrain.parallel.options import Pipeline as PipelineOptions
from paratrain.strategies.capabilities import local_module
from paratrain.strategies.pipeline.deferred import Deferred, Node
from paratrain.strategies.pipeline.layout import stage_layers
from paratrain.strategies.pipeline.module import microbatches_for
from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_gradients_within,
    assert_losses_within,
    assert_params_within,
)
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification


def dataset(n=96):
    return synthetic_classification(n)


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([10, 0, 10, 0, 10, 10], 2) == [3]
    assert balanced_split([1, 1, 1, 1], 4) == [1, 2, 3]
    assert balanced_split([100, 1, 1, 1], 2) == [1]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balanced_split([1, 1], 3)


def test_stage_layers_keep_full_names_and_validate_split_points():
    stage = stage_layers(mlp(), num_stages=2, stage_indices=[1], split_points=(4,)).whole
    assert [name for name, _ in stage.named_children()] == ["4", "5", "6"]
    assert "4.weight" in stage.state_dict()
    with pytest.raises(ValueError, match="split_points=\\(9,\\) must give 1 start"):
        stage_layers(mlp(), num_stages=2, stage_indices=[0], split_points=(9,))
    # Two stages per rank (interleaved): stages 0 and 2 of 4, sharing their layers.
    whole, chunks, _ = stage_layers(mlp(), num_stages=4, stage_indices=[0, 2],
                                    split_points=(2, 4, 5))
    assert [[n for n, _ in c.named_children()] for c in chunks] == [["0", "1"], ["4"]]
    assert [n for n, _ in whole.named_children()] == ["0", "1", "4"]
    assert chunks[1][0] is whole[2]
    with pytest.raises(ValueError, match="stages_per_rank=2 needs schedule 'interleaved_1f1b'"):
        PipelineOptions(stages_per_rank=2)
    with pytest.raises(ValueError, match="'interleaved_1f1b' needs stages_per_rank >= 2"):
        PipelineOptions(schedule="interleaved_1f1b", stages_per_rank=1)
    assert PipelineOptions(schedule="interleaved_1f1b").num_local_stages == 2
    with pytest.raises(ValueError, match="split_points must be increasing"):
        PipelineOptions(split_points=(3, 2))
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineOptions(schedule="zb")


def test_microbatches_divide_the_batch():
    assert microbatches_for(8, 4) == 4
    assert microbatches_for(6, 4) == 3
    assert microbatches_for(7, 4) == 1
    assert microbatches_for(2, 4) == 2


def test_deferred_records_the_loss_and_refuses_early_reads():
    out = Deferred(Node(None))
    loss = F.cross_entropy(out, torch.tensor([0, 1])) / 2
    assert isinstance(loss, torch.Tensor) and len(loss._node.chain()) == 2
    with pytest.raises(RuntimeError, match="known only after run.backward"):
        loss.item()
    loss._node.value = torch.tensor(1.5)
    assert (loss * 2).item() == 3.0 and f"{loss:.1f}" == "1.5"


def train(strategy, num_steps, *, options=None, accumulate=1, max_grad_norm=None):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=7,
                        strategy_options=options or {}, accumulate=accumulate,
                        max_grad_norm=max_grad_norm)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(dataset(), batch_size=8)
    losses, first_grads = [], None
    for _ in run.epochs(1):
        for step, (x, y) in enumerate(loader):
            if step == num_steps:
                break
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            if first_grads is None:
                first_grads = {n: p.grad.clone() for n, p in
                               local_module(run.strategy, model).named_parameters()}
            run.step(optimizer)
            losses.append(run.mean(loss))
    evaluation = run.evaluate(model, run.eval_loader(dataset(37), batch_size=10))
    params = {k: v.detach().clone()
              for k, v in local_module(run.strategy, model).state_dict().items()}
    run.close()
    return params, first_grads, losses, evaluation, bound


def pipeline_worker(rank, world_size, options, accumulate, max_grad_norm):
    return train("pipeline", 5, options=options, accumulate=accumulate,
                 max_grad_norm=max_grad_norm)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, accumulate, max_grad_norm",
                         [("gpipe", 1, None), ("1f1b", 2, 0.3)])
def test_pipeline_matches_single_process(schedule, accumulate, max_grad_norm):
    ref_params, ref_grads, ref_losses, ref_eval, bound = train(
        "single", 5, accumulate=accumulate, max_grad_norm=max_grad_norm)
    options = {"schedule": schedule, "num_microbatches": 4}
    results = spawn(pipeline_worker, 2, options, accumulate, max_grad_norm)
    seen = set()
    for params, grads, losses, evaluation, _ in results:
        assert params.keys() == grads.keys()
        # Micro-batches sum the batch's gradient in another order: bounds from float32
        # arithmetic and SGD's (paratrain.testing.numerics).
        assert_gradients_within(grads, ref_grads)
        assert_params_within(params, ref_params, bound)
        seen.update(params)
        # Every stage reports the loss computed on the last one.
        assert_losses_within(losses, ref_losses)
        assert evaluation["count"] == 37
        assert evaluation["accuracy"] == ref_eval["accuracy"]
        assert evaluation["loss"] == pytest.approx(ref_eval["loss"], rel=REASSOCIATION)
    # The stages are disjoint and together hold the whole model.
    assert seen == set(ref_params)
    assert not set(results[0][0]) & set(results[1][0])


# -- tied parameters -------------------------------------------------------------------
def tied(first: int, second: int) -> nn.Sequential:
    """Five same-shaped layers with ``second``'s weight tied to ``first``'s (one tensor)."""
    model = nn.Sequential(*(nn.Linear(10, 10) for _ in range(4)), nn.Linear(10, 3))
    model[second].weight = model[first].weight
    return model


def test_ties_across_stages_are_reported_naming_both_parameters():
    for indices in ([0], [1]):  # every rank knows every tie, whichever stage it holds
        parts = stage_layers(tied(0, 3), num_stages=2, stage_indices=indices, split_points=(2,))
        assert parts.ties == ((("0.weight", 0), ("3.weight", 1)),)
    parts = stage_layers(tied(0, 3), num_stages=4, stage_indices=[0, 2], split_points=(1, 2, 4))
    assert parts.ties == ((("0.weight", 0), ("3.weight", 2)),)
    # Within one stage a tie stays one tensor.
    parts = stage_layers(tied(0, 3), num_stages=2, stage_indices=[0], split_points=(4,))
    assert parts.whole[3].weight is parts.whole[0].weight and parts.ties == ()


def tied_train(strategy, options=None):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=7,
                        strategy_options=options or {})
    model = tied(0, 1)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = run.loader(dataset(), batch_size=8)
    for _ in run.epochs(1):
        for step, (x, y) in enumerate(loader):
            if step == 3:
                break
            run.backward(F.cross_entropy(model(x), y))
            run.step(optimizer)
    module = local_module(run.strategy, model)
    params = {k: v.detach().clone() for k, v in module.named_parameters(remove_duplicate=False)}
    still_tied = getattr(module, "0", None) is None or module[0].weight is module[1].weight
    run.close()
    return params, still_tied


def tied_train_worker(rank, world_size):
    return tied_train("pipeline", {"split_points": (3,)})


@pytest.mark.slow
def test_a_tie_within_one_stage_trains_as_one_tensor():
    reference, _ = tied_train("single")
    for params, still_tied in spawn(tied_train_worker, 2):
        assert still_tied
        for name, value in params.items():
            # As in test_pipeline_matches_single_process: micro-batch sums change rounding.
            torch.testing.assert_close(value, reference[name], atol=1e-6, rtol=1e-5)
