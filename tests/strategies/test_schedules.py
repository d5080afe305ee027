"""Pipeline schedules (gpipe .. dualpipev): options, placement, torch's constraints, and
each schedule on 2 gloo ranks against one process, in float64."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed._compat import schedule_actions
from paratrain.distributed.mesh import ParallelDegrees
from paratrain.models import GPT
from paratrain.parallel.options import SCHEDULES, Pipeline
from paratrain.strategies.capabilities import local_module
from paratrain.strategies.pipeline.bubble import bubble_fraction
from paratrain.strategies.pipeline.layout import stage_layers
from paratrain.strategies.pipeline.module import microbatches_for
from paratrain.strategies.pipeline.schedules import (
    SCHEDULE_CLASSES,
    microbatch_refusal,
    stage_indices,
    stage_rank,
)
from paratrain.strategies.pipeline.stages import check_stage_options
from paratrain.testing.pool import spawn

MULTI = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")


def test_options_name_the_schedules_and_their_stages_per_rank():
    assert tuple(SCHEDULE_CLASSES) == SCHEDULES
    assert Pipeline().schedule == "1f1b" and Pipeline().num_local_stages == 1
    assert Pipeline(schedule="interleaved-zero-bubble").schedule == "interleaved_zero_bubble"
    assert Pipeline(schedule="zbv").num_local_stages == 2
    assert Pipeline(schedule="interleaved_zero_bubble", stages_per_rank=3).num_local_stages == 3
    refusals = [({"schedule": "zb"}, "schedule must be one of gpipe, 1f1b, .* got 'zb'"),
                ({"schedule": "zbv", "stages_per_rank": 3}, "'zbv' runs exactly 2 stages"),
                ({"schedule": "interleaved_zero_bubble", "stages_per_rank": 1},
                 "'interleaved_zero_bubble' needs stages_per_rank >= 2"),
                ({"schedule": "gpipe", "stages_per_rank": 2}, "stages_per_rank=2 needs")]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message) as error:
            Pipeline(**kwargs)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_stages_are_placed_in_a_v_or_round_robin(p):
    for schedule, per_rank in (("zbv", 2), ("dualpipev", 2), ("interleaved_1f1b", 3)):
        placed = [stage_indices(schedule, r, p, per_rank) for r in range(p)]
        assert sorted(s for stages in placed for s in stages) == list(range(p * per_rank))
        for rank, stages in enumerate(placed):
            assert all(stage_rank(schedule, s, p) == rank for s in stages)
    assert stage_indices("zbv", 0, p, 2) == [0, 2 * p - 1]  # the first and the last stage
    assert stage_indices("interleaved_1f1b", 1, p, 3) == [1, 1 + p, 1 + 2 * p]
    assert stage_rank("1f1b", p - 1, p) == p - 1


@pytest.mark.parametrize("schedule", ["gpipe", *MULTI])
def test_refusals_are_torchs_constraints(schedule):
    # Where paratrain accepts (p, m), torch builds the plan and it runs without deadlock;
    # where paratrain refuses, torch's constructor refuses too.
    for p in (2, 3, 4):
        local = stage_indices(schedule, 0, p, 1 if schedule == "gpipe" else 2)
        for m in range(1, 3 * p + 1):
            cls = SCHEDULE_CLASSES[schedule]
            if microbatch_refusal(schedule, m, p) is None:
                schedule_actions(cls, p, m, local)
                assert 0 <= bubble_fraction(schedule, p, m) < 1
            else:
                with pytest.raises(ValueError):
                    schedule_actions(cls, p, m, local)


def test_microbatches_fit_the_batch_and_the_schedule():
    assert microbatches_for(7, 4) == 1  # the default (1f1b) as before
    assert microbatches_for(12, 8, schedule="dualpipev", num_ranks=2) == 6
    assert microbatches_for(10, 5, schedule="dualpipev", num_ranks=2) == 5
    assert microbatches_for(10, 5, schedule="interleaved_1f1b", num_ranks=2) == 2
    with pytest.raises(ValueError, match="a batch of 10 has no number of micro-batches up to 4"):
        microbatches_for(10, 4, schedule="dualpipev", num_ranks=2)


def test_stage_options_refuse_in_one_line():
    def mesh(**degrees):
        return SimpleNamespace(degrees=ParallelDegrees(pipeline_degree=2, **degrees))

    with pytest.raises(ValueError, match="'dualpipev' needs at least 2 x pp = 4 micro-batches"):
        check_stage_options(mesh(), Pipeline(schedule="dualpipev", microbatches=3),
                            sharding=None, tensor=None)
    with pytest.raises(ValueError, match="schedule 'zbv' with replicated, sharded"):
        check_stage_options(mesh(shard_degree=2), Pipeline(schedule="zbv"), sharding=None,
                            tensor=None)
    # Rounds the runtime can shrink to (4 of a batch of 8) are not refused up front.
    check_stage_options(mesh(), Pipeline(schedule="interleaved_1f1b", microbatches=5),
                        sharding=None, tensor=None)


def test_v_split_gives_rank_0_the_first_and_the_last_stage():
    model = mlp()
    whole, chunks, _ = stage_layers(model, num_stages=4, stage_indices=stage_indices(
        "zbv", 0, 2, 2), split_points=(2, 4, 6))
    assert [[n for n, _ in c.named_children()] for c in chunks] == [["0", "1"], ["6"]]
    assert [n for n, _ in whole.named_children()] == ["0", "1", "6"]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        stage_layers(nn.Sequential(*(nn.Linear(4, 4) for _ in range(3))), num_stages=4,
                     stage_indices=[0, 3], split_points=None)


# -- each schedule against one process ---------------------------------------------------
# float64, batch 8, 3 SGD steps. Micro-batches change only the order of sums: a weight
# gradient adds its 8 per-sample terms in m partial sums instead of one, and the matmuls
# may block their dot products (<= 32 terms) differently for 8 / m rows. A reordered sum
# of n terms moves by at most n u times the terms' magnitudes (u = 2**-53); the terms
# one gradient element depends on through the 4 layers number at most 8 x 32 x 4 = 1024,
# their magnitude taken as the step's largest gradient element (as
# paratrain.testing.numerics does in float32): 1024 u ~ 1.1e-13 relative to it. We
# measure ~5 u; a lost, repeated or misplaced micro-batch is off by ~1e-1 of it.
BOUND = 1024 * 2.0 ** -53
STEPS, LR = 3, 0.1


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))


def tied():
    """Five 10-wide layers, the fourth's weight tied to the first's (one tensor)."""
    model = nn.Sequential(*(nn.Linear(10, 10) for _ in range(4)), nn.Linear(10, 3))
    model[3].weight = model[0].weight
    return model


def batch(step: int, size: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(size, 10, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (size,), generator=g))


def train(strategy, make_model, options=None):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=7,
                        strategy_options=options or {})
    model = make_model().double()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    losses, grads = [], []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        run.backward(loss)
        grads.append({n: p.grad.clone() for n, p in
                      local_module(run.strategy, model).named_parameters()})
        run.step(optimizer)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        output = model(batch(STEPS, 6)[0])  # every stage returns the last stage's output
    run.close()
    return losses, grads, output


def schedule_worker(rank, world_size, make_model, options):
    return train("pipeline", make_model, options)


def check_against_one_process(make_model, schedule, microbatches, aliases=None):
    ref_losses, ref_grads, ref_output = train("single", make_model)
    results = spawn(schedule_worker, 2, make_model,
                    {"schedule": schedule, "num_microbatches": microbatches})
    seen = []
    for losses, grads, output in results:
        # The pipeline reports the loss as float32 (one rounding of the float64 mean).
        assert losses == pytest.approx(ref_losses, rel=2.0 ** -23)
        for step, (got, ref) in enumerate(zip(grads, ref_grads)):
            # Later steps also start from parameters already apart by lr x the bound.
            scale = (1 + step) * BOUND * max(g.abs().max().item() for g in ref.values())
            for name, grad in got.items():
                diff = (grad - ref[(aliases or {}).get(name, name)]).abs().max().item()
                assert diff <= scale, (schedule, step, name, diff, scale)
        assert (output - ref_output).abs().max().item() <= BOUND * ref_output.abs().max().item()
        seen.append(set(grads[0]))
    # The stages are disjoint and together hold the whole model.
    assert not seen[0] & seen[1] and seen[0] | seen[1] >= set(ref_grads[0]) - set(aliases or ())


@pytest.mark.parametrize("schedule", [
    "zbv",  # the new paths: V placement, split backward, forward-only evaluation
    *(pytest.param(s, marks=pytest.mark.slow) for s in ("gpipe", "1f1b", "interleaved_1f1b",
                                                        "interleaved_zero_bubble", "dualpipev"))])
def test_schedule_matches_one_process(schedule):
    check_against_one_process(mlp, schedule, 4)


def compiled_worker(rank, world_size, schedule):
    run = paratrain.Run(strategy="pipeline", progress=False, accelerator="cpu", seed=0,
                        compile=True, strategy_options={"schedule": schedule})
    model = GPT(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)  # blocks compiled
    model, _ = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, 32, (8, 8))
    try:  # refused before any compiled call: no compile time
        run.backward(F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
    except ValueError as error:
        return str(error)
    finally:
        run.close()


@pytest.mark.slow
def test_split_backward_schedules_refuse_compiled_blocks_on_every_rank():
    for message in spawn(compiled_worker, 2, "zbv"):
        assert message.startswith("schedule 'zbv' splits each backward") and "\n" not in message


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zero_bubble"])
def test_tied_layers_under_a_v_and_a_loop_match_one_process(schedule):
    # Stages [0], [1], [2], [3, 4]: the tie joins stages 0 and 3, one rank in a V (one
    # tensor there), ranks 0 and 1 looped (two copies whose gradients are summed).
    check_against_one_process(tied, schedule, 4, aliases={"3.weight": "0.weight"})
