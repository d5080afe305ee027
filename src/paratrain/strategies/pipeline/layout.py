"""Cutting a model that is not ``nn.Sequential`` into pipeline stages.

Transformers are written as an embedding, a ``ModuleList`` of blocks and a head, with
glue (positions, residual streams) in ``forward``. Rather than rewriting them as
``nn.Sequential``, such a model describes itself with :class:`PipelineLayout` (a
``pipeline_layout()`` method) and keeps one rule in its ``forward``: a part that is
``None`` is skipped, and the blocks are iterated, not indexed. Each stage is then the
model itself with the other stages' parts removed, as torchtitan does: stage 0 keeps the
``before`` parts, the last stage the ``after`` parts, and every stage its contiguous run
of blocks, registered under their original indices so parameter names (and so
checkpoints) are those of the full model. Parts may be dotted paths
(``"model.layers"``): a model adapter describes Hugging Face models that way
(:mod:`.adapted`).

Stages are balanced by measured compute: each part's forward + backward is timed once
on the layout's sample input (:func:`measure_costs`), and :func:`block_ranges` picks the
contiguous split that minimises the slowest stage.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from paratrain.distributed.gpu_stats import synchronize
from paratrain.distributed.partition import balanced_split


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """The parts of a model that the ``pipeline`` strategy cuts between."""

    before: tuple[str, ...]
    """Names (attributes or dotted paths) of the modules before the blocks; only the first
    stage keeps them."""
    blocks: str
    """Attribute name of the ``nn.ModuleList`` of blocks, split contiguously over stages."""
    after: tuple[str, ...]
    """Attribute names of the modules after the blocks; only the last stage keeps them."""
    sample_input: torch.Tensor | None = None
    """A small batch for :func:`measure_costs`; None balances by parameter count."""

    def __post_init__(self) -> None:
        overlap = set(self.before) & set(self.after) | {self.blocks} & {*self.before, *self.after}
        if overlap:
            raise ValueError(f"PipelineLayout names {sorted(overlap)} in two places; "
                             "each part belongs to before, blocks or after")


def submodule_at(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule at ``name`` (an attribute or a dotted path); None if there is none."""
    module: Any = model
    for attribute in name.split("."):
        module = getattr(module, attribute, None)
    return module if isinstance(module, nn.Module) else None


def _set_part(model: nn.Module, name: str, value: nn.Module | None) -> None:
    # A dotted part's parents are copied first: the cut must not reach the full model
    # (or another chunk) through a parent they share.
    *parents, leaf = name.split(".")
    module = model
    for attribute in parents:
        copied = _shallow_copy(getattr(module, attribute))
        setattr(module, attribute, copied)
        module = copied
    setattr(module, leaf, value)


def layout_of(model: nn.Module) -> PipelineLayout | None:
    """The model's :class:`PipelineLayout`, or None if it does not describe one."""
    describe = getattr(type(model), "pipeline_layout", None)
    if describe is None:
        return None
    layout = describe(model)
    if not isinstance(layout, PipelineLayout):
        raise TypeError(f"{type(model).__name__}.pipeline_layout() must return a "
                        f"PipelineLayout, got {type(layout).__name__}")
    return check_layout(model, layout)


def check_layout(model: nn.Module, layout: PipelineLayout) -> PipelineLayout:
    """``layout``, once its parts are found in ``model`` (ValueError naming one that is not)."""
    if not isinstance(submodule_at(model, layout.blocks), nn.ModuleList):
        raise ValueError(f"{type(model).__name__}.{layout.blocks} must be an nn.ModuleList "
                         "of blocks for the pipeline to split it")
    for name in (*layout.before, *layout.after):
        if submodule_at(model, name) is None:
            raise ValueError(f"{type(model).__name__}.{name} named in its PipelineLayout "
                             "is not a submodule")
    return layout


def block_ranges(costs: list[float], num_stages: int) -> list[range]:
    """Contiguous block indices per stage minimising the costliest stage.

    ``costs[i]`` is block ``i``'s cost; the ``before`` parts' cost belongs in
    ``costs[0]`` and the ``after`` parts' in ``costs[-1]``, as they share those stages.
    """
    bounds = [0, *balanced_split(list(costs), num_stages), len(costs)]
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def ranges_from_points(num_blocks: int, num_stages: int, points: tuple[int, ...], *,
                       kind: str = "block") -> list[range]:
    """Stages starting at the given ``kind`` indices (``Pipeline.split_points``)."""
    if len(points) != num_stages - 1 or points[-1] >= num_blocks:
        raise ValueError(f"split_points={tuple(points)} must give {num_stages - 1} {kind} "
                         f"indices below {num_blocks} for {num_stages} stages")
    bounds = [0, *points, num_blocks]
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def parameter_costs(model: nn.Module, layout: PipelineLayout) -> list[float]:
    """Per-block parameter counts, with the before/after parts added to the end blocks."""
    def count(module: nn.Module) -> float:
        return float(sum(p.numel() for p in module.parameters()))

    costs = [count(block) for block in submodule_at(model, layout.blocks)]
    costs[0] += sum(count(submodule_at(model, name)) for name in layout.before)
    costs[-1] += sum(count(submodule_at(model, name)) for name in layout.after)
    return costs


def _time_part(module: nn.Module, args: tuple, device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` forward + backward passes of ``module`` on ``args``."""
    inputs = tuple(a.detach().requires_grad_(a.is_floating_point())
                   if isinstance(a, torch.Tensor) else a for a in args)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up allocator and kernels
        synchronize(device)
        start = time.perf_counter()
        out = module(*inputs)
        out.float().sum().backward()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_costs(model: nn.Module, layout: PipelineLayout, device: torch.device,
                  repeats: int = 2) -> list[float]:
    """Seconds of forward + backward per block on ``layout.sample_input``.

    Each part is run alone on the input it receives inside the full model (captured
    with pre-forward hooks). Gradients are discarded and the RNG state and buffers
    (e.g. BatchNorm statistics) restored, so measuring leaves training exactly as if it
    had not happened.
    """
    blocks = list(submodule_at(model, layout.blocks))
    parts = [submodule_at(model, name) for name in layout.before] + blocks + \
        [submodule_at(model, name) for name in layout.after]
    captured: dict[int, tuple] = {}
    hooks = [part.register_forward_pre_hook(
        lambda module, args, i=i: captured.setdefault(i, args)) for i, part in enumerate(parts)]
    devices = [device] if device.type == "cuda" else []
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=devices):
            with torch.no_grad():
                model(layout.sample_input.to(device))
            seconds = [_time_part(part, captured[i], device, repeats)
                       for i, part in enumerate(parts)]
    finally:
        for hook in hooks:
            hook.remove()
        for param in model.parameters():
            param.grad = None
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    before, after = len(layout.before), len(layout.after)
    costs = seconds[before:len(seconds) - after]
    costs[0] += sum(seconds[:before])
    costs[-1] += sum(seconds[len(seconds) - after:])
    return costs


Tie = tuple[tuple[str, int], ...]
"""The ``(full name, stage)`` of each holder of one tied tensor."""


def ties_across_stages(model: nn.Module, stage_of: dict[str, int]) -> list[Tie]:
    """Parameters that are one tensor but land on different stages.

    ``stage_of`` maps each part (a submodule name) to its stage. Each stage lives in
    its own process, so a tied parameter (``model[4].weight = model[0].weight``, a
    language model's embedding and head) becomes one copy per process: the strategy
    keeps the copies equal by summing their gradients (:mod:`.ties`), or refuses
    (:func:`tie_refusal`). Ties within one stage stay one tensor.
    """
    holders: dict[int, list[tuple[str, int]]] = {}
    for name_of_part, stage in stage_of.items():
        module = submodule_at(model, name_of_part)
        for name, param in module.named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), []).append((f"{name_of_part}.{name}", stage))
    return [tuple(names) for names in holders.values() if len({s for _, s in names}) > 1]


def tie_refusal(tie: Tie, why: str) -> str:
    """The one line refusing ``tie``: ``why`` its copies cannot be kept equal."""
    where = " and ".join(f"'{name}' (stage {stage})" for name, stage in tie)
    return (f"parameters {where} are tied (one tensor) but the pipeline puts them on "
            f"different stages, {why}; put them on one stage (split_points, or the parts of "
            "the PipelineLayout) or untie them")


class StageParts(NamedTuple):
    """What one rank of a pipeline holds."""

    whole: nn.Module
    """All of this rank's parts in one module, under the full model's names: what the
    optimizer steps and checkpoints store."""
    chunks: list[nn.Module]
    """One module per stage this rank runs (one, or several for an interleaved
    schedule), in stage order; they share their parts with :attr:`whole`."""
    ties: tuple[Tie, ...] = ()
    """Tied parameters on different stages (every stage's, not only this rank's)."""


def _shallow_copy(module: nn.Module) -> nn.Module:
    """Another module object of the same class over the same parts: cutting it leaves
    ``module`` as it was."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # the parts are shared, the table is not
    return clone


def cut_stage(model: nn.Module, layout: PipelineLayout, stages: list[range],
              stage_indices: Collection[int]) -> nn.Module:
    """``model`` reduced in place to the parts of ``stage_indices`` (full parameter names)."""
    for names, keep in ((layout.before, 0 in stage_indices),
                        (layout.after, len(stages) - 1 in stage_indices)):
        if not keep:
            for name in names:
                _set_part(model, name, None)
    kept_blocks = {i for index in stage_indices for i in stages[index]}
    kept = nn.ModuleList()
    for name, block in submodule_at(model, layout.blocks).named_children():
        if int(name) in kept_blocks:
            # Registered under the original index: "blocks.5.attn..." stays its name.
            kept.add_module(name, block)
    _set_part(model, layout.blocks, kept)
    return model


def split_model(model: nn.Module, layout: PipelineLayout, *, num_stages: int,
                stage_indices: list[int], split_points: tuple[int, ...] | None,
                device: torch.device, agree: Any) -> StageParts:
    """Stages ``stage_indices`` of ``model``: blocks split at ``split_points`` or by
    measured compute.

    ``agree(measure, count) -> costs`` makes every rank use the same ``count`` costs:
    timings differ per process, so one process runs ``measure()`` and shares the result
    (the split must be identical everywhere).
    """
    num_blocks = len(submodule_at(model, layout.blocks))
    if not 1 <= num_stages <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks into {num_stages} stages; "
                         "use fewer processes (or stages per rank) or a model with more blocks")
    if split_points is not None:
        stages = ranges_from_points(num_blocks, num_stages, split_points)
    else:
        if layout.sample_input is not None:
            costs = agree(lambda: measure_costs(model, layout, device), num_blocks)
        else:
            costs = parameter_costs(model, layout)  # the same in every process
        stages = block_ranges(costs, num_stages)
    ties = ties_across_stages(model, {
        **{name: 0 for name in layout.before},
        **{f"{layout.blocks}.{i}": stage for stage, blocks in enumerate(stages) for i in blocks},
        **{name: num_stages - 1 for name in layout.after}})
    whole = cut_stage(model, layout, stages, stage_indices)
    if len(stage_indices) == 1:
        return StageParts(whole, [whole], tuple(ties))
    return StageParts(whole, [cut_stage(_shallow_copy(whole), layout, stages, [index])
                              for index in stage_indices], tuple(ties))


def stage_layers(model: nn.Sequential, *, num_stages: int, stage_indices: list[int],
                 split_points: tuple[int, ...] | None) -> StageParts:
    """Stages ``stage_indices`` of an ``nn.Sequential``, keeping the children's names (so
    checkpoints use full FQNs); balanced by parameter count without ``split_points``."""
    children = list(model.named_children())
    if not 1 <= num_stages <= len(children):
        raise ValueError(f"cannot split {len(children)} layers into {num_stages} stages; "
                         "use fewer processes (or stages per rank) or more layers")
    if split_points is None:
        stages = block_ranges([sum(p.numel() for p in c.parameters()) for _, c in children],
                              num_stages)
    else:
        stages = ranges_from_points(len(children), num_stages, tuple(split_points), kind="start")
    ties = tuple(ties_across_stages(model, {children[i][0]: stage
                                            for stage, layers in enumerate(stages)
                                            for i in layers}))
    chunks = [nn.Sequential(OrderedDict(children[i] for i in stages[index]))
              for index in stage_indices]
    if len(chunks) == 1:
        return StageParts(chunks[0], chunks, ties)
    whole = nn.Sequential(OrderedDict(children[i] for index in stage_indices
                                      for i in stages[index]))
    return StageParts(whole, chunks, ties)
