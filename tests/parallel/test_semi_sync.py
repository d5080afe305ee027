"""Semi-synchronous options (``Parallel(semi_sync=LocalSGD | DiLoCo)``): one-line refusals
and how a layout with them resolves (the gloo runs: tests/strategies/test_semisync.py)."""

import pytest

from paratrain import DiLoCo, LocalSGD, Parallel
from paratrain.parallel.presets import resolve_strategy
from paratrain.strategies.semisync.fragments import split_units

REFUSALS = [
    (lambda: LocalSGD(every=0), "LocalSGD.every must be an integer >= 1"),
    (lambda: DiLoCo(every=4, outer_lr=0), "DiLoCo.outer_lr must be a number > 0"),
    (lambda: DiLoCo(every=4, outer_momentum=1.0), r"DiLoCo.outer_momentum must be in \[0, 1\)"),
    (lambda: DiLoCo(every=4, outer_momentum=-0.1), "outer_momentum must be in"),
    (lambda: DiLoCo(every=4, fragments=0), "DiLoCo.fragments must be an integer >= 1"),
    (lambda: DiLoCo(every=6, fragments=4), "DiLoCo.fragments=4 must divide every=6"),
    (lambda: DiLoCo(every=4, comm_dtype="int4"),
     "DiLoCo.comm_dtype must be None, 'bf16' or 'int8', got 'int4'"),
    (lambda: DiLoCo(every=4, comm_dtype="fp8"), "must be None, 'bf16' or 'int8'"),
    (lambda: DiLoCo(every=1, overlap=True), "DiLoCo.overlap needs every >= 2"),
    (lambda: Parallel(dp_shard=2, semi_sync=LocalSGD(every=2)).resolve(world_size=2),
     "semi_sync=LocalSGD needs dp_replicate > 1"),
    (lambda: Parallel(dp_replicate=2, semi_sync=DiLoCo(every=2)).resolve(
        world_size=2, replica_groups=3),
     r"DiLoCo under --fault-tolerant syncs the 3 replica groups, so dp_replicate=2 inside"),
    (lambda: Parallel(dp_replicate=-1, dp_shard=2, semi_sync=DiLoCo(every=2)).resolve(
        world_size=2), "semi_sync=DiLoCo needs dp_replicate > 1"),
    (lambda: Parallel(pp=2, dp_replicate=2, semi_sync=DiLoCo(every=2)),
     r"with a pipeline \(pp=2\) is not supported"),
    (lambda: Parallel(dp_replicate=2, dp_shard=2, ep=2, semi_sync=DiLoCo(every=2)),
     r"with expert parallel \(ep=2\) is not supported"),
    (lambda: Parallel(dp_replicate=2, semi_sync="diloco"),
     "semi_sync must be a paratrain.LocalSGD, a paratrain.DiLoCo or None"),
    (lambda: resolve_strategy("ddp", {}, Parallel(dp_replicate=2, semi_sync=LocalSGD(every=2)),
                              world_size=2, local_world_size=2),
     "strategy 'ddp' averages gradients at every step"),
    (lambda: split_units([10, 10], 3), r"fragments=3 but the model has 2 block\(s\)"),
]


@pytest.mark.parametrize("make, message", REFUSALS)
def test_refusals_are_one_line(make, message):
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_under_fault_tolerance_the_replica_groups_are_the_replicas():
    layout = Parallel(dp_shard=-1, semi_sync=DiLoCo(every=2))
    degrees = layout.resolve(world_size=2, replica_groups=2)
    assert (degrees.replicate_degree, degrees.shard_degree) == (1, 2)
    with pytest.raises(ValueError, match="needs dp_replicate > 1"):
        layout.resolve(world_size=2)  # the same layout, no groups: nothing to sync


def test_a_pure_replicate_layout_with_semi_sync_runs_in_the_layout_strategy():
    layout = Parallel(dp_replicate=2, semi_sync=DiLoCo(every=2))
    resolved = resolve_strategy("auto", {}, layout, world_size=2, local_world_size=2)
    assert (resolved.name, resolved.layout) == ("hybrid", layout)
    assert resolve_strategy("auto", {}, "dp_replicate=2", world_size=2,
                            local_world_size=2).name == "ddp"  # unchanged without it
