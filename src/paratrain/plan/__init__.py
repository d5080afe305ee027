"""``paratrain plan``: predict step time, throughput and memory of each strategy at scale.

An analytic model (``docs/plan.md``) that launches no processes: calibration in
:mod:`~paratrain.plan.calibration`, communication formulas in :mod:`~paratrain.plan.comm`,
memory in :mod:`~paratrain.plan.memory`, one cost model per strategy in
:mod:`~paratrain.plan.costs` (named by the strategy table), the planner in :mod:`~paratrain.plan.model`,
the report in :mod:`~paratrain.plan.report`, node-count scaling in
:mod:`~paratrain.plan.scaling`, semi-synchronous rows (LocalSGD, DiLoCo) in
:mod:`~paratrain.plan.semi_sync`; the command line in :mod:`~paratrain.plan.cli`.

Example::

    import torch
    from paratrain.plan import Hardware, calibrate, default_model, plan
    profile = calibrate(default_model(), torch.randn(32, 1, 28, 28))
    hw = Hardware(num_devices_per_node=4, device_memory_bytes=16 * 10**9)
    print(plan(profile, hw, batch_size_per_device=32).format_table())
"""

from paratrain.plan.calibration import calibrate, default_model
from paratrain.plan.comm import (
    DEFAULT_BUCKET_BYTES,
    allgather_time,
    allreduce_time,
    ddp_buckets,
    exposed_comm_time,
    ps_comm_time,
    reduce_scatter_time,
    ring_allgather_time,
    ring_allreduce_time,
    ring_reduce_scatter_time,
)
from paratrain.plan.links import PRESETS, LinkPreset, link_preset
from paratrain.plan.model import STRATEGIES, plan, predict
from paratrain.plan.report import PlanReport
from paratrain.plan.scaling import format_scaling, plan_scaling
from paratrain.plan.semi_sync import plan_semi_sync, semi_sync_row
from paratrain.plan.types import Hardware, ModelProfile, Prediction
from paratrain.units import (
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_duration,
    parse_size,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES", "PRESETS", "STRATEGIES", "Hardware", "LinkPreset", "ModelProfile",
    "PlanReport", "Prediction", "allgather_time", "allreduce_time", "calibrate", "ddp_buckets",
    "default_model", "exposed_comm_time", "format_bytes", "format_scaling", "format_seconds",
    "link_preset", "parse_bandwidth", "parse_duration", "parse_size", "plan", "plan_scaling",
    "plan_semi_sync", "predict", "ps_comm_time", "reduce_scatter_time", "ring_allgather_time",
    "ring_allreduce_time", "ring_reduce_scatter_time", "semi_sync_row",
]
