"""The contract over a grid of degree combinations: ``Run(parallel=...)`` on 2, 4 and 8
gloo ranks trains paratrain's GPT (AdamW, global-norm clipping, evaluation) as one
process does, within the bounds of float32 and Adam arithmetic.

Each spawn runs its layouts one after another in the same processes (a later ``Run``
forms its own groups), so the grid costs three process starts, not one per layout.
"""

import dataclasses

import pytest
import torch

import paratrain
from paratrain.models import GPT
from paratrain.testing.language import (
    evaluate_tokens,
    layout_meshes,
    token_dataset,
    train_steps,
    whole_state,
)
from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_losses_within,
    assert_params_within,
)
from paratrain.testing.pool import spawn

VOCAB, BLOCK, STEPS, GLOBAL_BATCH = 16, 8, 3, 8

SHARD, TENSOR, HSDP = ("shard",), ("tensor",), ("replicate", "shard")

#: (world size, name) -> layouts (degrees not given are 1): the strategy each must run
#: and the mesh axes its parameters are DTensors over (None: not checked). Pipeline x
#: tensor parallel is a group of its own: test_portable_numerics reruns it under other
#: CPU kernels (it once failed on an AMD CPU with a tolerance tuned to an Intel one).
GRID = {
    # cp: each sequence of 8 tokens cut over cp ranks (head-tail order), FSDP over
    # dp_shard x cp, losses averaged over data x cp. ep: the MoE GPT (dropless), its
    # experts split over ep of the data ranks.
    (2, "2"): [("dp_replicate=2", "ddp", set()), ("dp_shard=2", "fsdp", {SHARD}),
        ("tp=2", "tp", None), ("pp=2", "pipeline", set()), ("cp=2", "fsdp", None),
        ("ep=2", "fsdp", None)],
    (4, "4"): [("dp_replicate=2,dp_shard=2", "hybrid", {HSDP}),
        ("dp_shard=2,tp=2", "fsdp_tp", {("shard", "tensor"), SHARD}),
        ("pp=2,dp_replicate=2", "hybrid", {HSDP}), ("pp=2,dp_shard=2", "hybrid", {SHARD}),
        ("dp_replicate=2,tp=2", "fsdp_tp", None)],
    (4, "4-pp_x_tp"): [("pp=2,tp=2", "hybrid", {TENSOR})],
    (4, "4-cp_ep"): [("cp=4", "fsdp", None), ("dp_shard=2,cp=2", "fsdp", None),
                     ("cp=2,tp=2", "fsdp_tp", None), ("ep=4", "fsdp", None),
                     ("dp_shard=4,ep=2", "fsdp", None),
                     ("dp_replicate=2,dp_shard=2,ep=2", "hybrid", None),
                     ("dp_shard=2,tp=2,ep=2", "fsdp_tp", None)],
    (8, "8"): [("dp_replicate=2,dp_shard=2,tp=2", "fsdp_tp",
         {("replicate", "shard", "tensor"), HSDP}),
        ("pp=2,dp_shard=2,tp=2", "hybrid", {("shard", "tensor"), SHARD}),
        ("pp=2,dp_replicate=2,dp_shard=2", "hybrid", {HSDP})],
}


def tokens(n=48):
    return token_dataset(n, VOCAB, BLOCK)


def train(spec, experts=0):
    parallel = None
    if spec is not None:
        parallel = dataclasses.replace(paratrain.Parallel.parse(spec),
                                       pipeline=paratrain.Pipeline(microbatches=2)
                                       if "pp" in spec else None)
    run = paratrain.Run(parallel=parallel, strategy="auto" if spec else "single",
                        progress=False, accelerator="cpu", seed=5, max_grad_norm=0.5)
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=4, n_head=4, n_embd=16,
                **({"experts": experts, "top_k": 2} if experts else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bound = TrainingBound(model, optimizer) if spec is None else None
    model, optimizer = run.prepare(model, optimizer)
    strategy = run.strategy
    loader = run.loader(tokens(), batch_size=GLOBAL_BATCH // strategy.data_parallel_size)
    losses = train_steps(run, model, optimizer, loader, STEPS)
    experts_here = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                       for name, p in model.named_parameters() if ".experts." in name)
    result = {"strategy": strategy.name, "meshes": layout_meshes(model), "losses": losses,
              "expert_numel": experts_here,
              "evaluation": evaluate_tokens(run, model, tokens(13)),
              "params": whole_state(run, model), "bound": bound,
              "data_parallel": (strategy.data_parallel_size, strategy.data_parallel_rank)}
    run.close()
    return result


def experts_of(spec):
    """The MoE GPT (4 experts) for a layout with ep, the dense one otherwise."""
    return 4 if spec is not None and "ep=" in spec else 0


def grid_worker(rank, world_size, layouts):
    return {spec: train(spec, experts_of(spec)) for spec, _, _ in layouts}


@pytest.fixture(scope="module")
def references():
    return {0: train(None), 4: train(None, experts=4)}


@pytest.mark.slow
@pytest.mark.parametrize("world_size, layouts", [(n, GRID[n, name]) for n, name in GRID],
                         ids=[name for _, name in GRID])
def test_degree_grid_matches_one_process(references, world_size, layouts):
    results = spawn(grid_worker, world_size, layouts, timeout=600)
    for spec, strategy, axes in layouts:
        reference = references[experts_of(spec)]
        replicas = set()
        for rank_results in results:
            result = rank_results[spec]
            assert result["strategy"] == strategy, spec
            assert axes is None or result["meshes"] == axes, (spec, result["meshes"])
            assert_losses_within(result["losses"], reference["losses"])
            assert result["evaluation"]["count"] == reference["evaluation"]["count"], spec
            assert result["evaluation"]["loss"] == pytest.approx(
                reference["evaluation"]["loss"], rel=REASSOCIATION), spec
            assert result["params"].keys() == reference["params"].keys(), spec
            assert_params_within(result["params"], reference["params"], reference["bound"])
            replicas.add(result["data_parallel"])
            if "ep=" in spec:
                # Each rank holds 1/ep of the experts, FSDP-sharded over the ranks holding
                # the same ones: 1/(dp_shard x cp) of the expert weights in all.
                degrees = paratrain.Parallel.parse(spec).resolve(world_size=world_size)
                share = degrees.shard_degree * degrees.context_degree
                assert result["expert_numel"] * share == reference["expert_numel"], spec
        # Every data-parallel rank is read by someone: the ranks cover the whole batch.
        sizes = {size for size, _ in replicas}
        assert len(sizes) == 1 and {r for _, r in replicas} == set(range(sizes.pop())), spec


@pytest.mark.parametrize("spec, message", [
    ("pp=2,cp=2", r"a pipeline with cp or ep is not supported yet; drop pp, or cp/ep"),
    ("pp=2,dp_shard=2,ep=2", r"a pipeline with cp or ep is not supported yet"),
])
def test_what_a_layout_cannot_run_yet_is_one_line(spec, message):
    from paratrain.distributed.topology import Topology
    from paratrain.strategies.layout.presets import build_layout

    topology = Topology(rank=0, world_size=4, local_world_size=4, local_rank=0)
    with pytest.raises(ValueError, match=message) as info:
        build_layout(topology, paratrain.Parallel.parse(spec), name="hybrid")
    assert "\n" not in str(info.value)


def dense_under_ep_worker(rank, world_size):
    with paratrain.Run(parallel="ep=2", progress=False, accelerator="cpu") as run:
        try:
            run.prepare(GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=8))
        except ValueError as exc:
            return str(exc)
    return "prepared"


@pytest.mark.slow
def test_ep_with_a_model_without_experts_is_one_line():
    assert spawn(dense_under_ep_worker, 2, timeout=120) == [
        "ep=2 but the model has no mixture-of-experts layer paratrain can split "
        "(paratrain.models MoE, or the stacked experts of Mixtral, Qwen2-MoE, Qwen3-MoE, "
        "OLMoE); drop ep"] * 2
