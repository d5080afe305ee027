"""Which parameters an outer step covers, and when: units, fragments, the schedule.

A *unit* is what FSDP gathers at once: a block the wrap policy names (the same
:func:`~paratrain.strategies.fsdp.wrap_predicate` :func:`~paratrain.strategies.layout.apply.apply_fsdp`
uses), each parameter belonging to the innermost one around it, the rest to the root.
Units are taken from the model *before* it is parallelized (FSDP renames the classes a
policy may name) and kept as parameter names, which every parallelism keeps.

Streaming DiLoCo cuts the units, in model order, into ``k`` consecutive *fragments* of
about equal size; fragment ``j`` is synchronised after optimizer step ``n`` when
``(n + j * H / k) % H == 0``, so each sync sends about ``1 / k`` of the model and the
syncs are spread evenly over the ``H`` steps.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> unit_names(model, None)
    [['0.weight', '0.bias'], ['2.weight', '2.bias']]
    >>> split_units([20, 20, 10, 10], 2)
    [[0], [1, 2, 3]]
    >>> [n for n in range(1, 9) if due(n, fragment=1, every=4, fragments=2)]
    [2, 6]
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.strategies.fsdp import wrap_predicate

__all__ = ["due", "fragment_parameters", "split_units", "unit_names"]


def unit_names(model: nn.Module, wrap_policy: Any) -> list[list[str]]:
    """The model's units as lists of parameter names (``named_parameters`` names), in the
    order their first parameter appears; the root's own parameters form one more unit."""
    wrap = wrap_predicate(wrap_policy, model)
    owner: dict[str, str] = {}
    # Pre-order: an inner unit is visited after the unit around it and takes its parameters.
    for prefix, module in model.named_modules():
        if module is model or wrap(module):
            for name, _ in module.named_parameters(prefix=prefix):
                owner[name] = prefix
    units: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        units.setdefault(owner[name], []).append(name)
    return list(units.values())


def split_units(sizes: list[int], fragments: int) -> list[list[int]]:
    """Unit indices cut into ``fragments`` consecutive, non-empty groups of about equal
    total size (``sizes``: elements per unit); ValueError when there are fewer units."""
    if fragments > len(sizes):
        raise ValueError(f"DiLoCo.fragments={fragments} but the model has {len(sizes)} "
                         f"block(s) (FSDP units) to split; choose fragments <= {len(sizes)}")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts = [0]
    for j in range(1, fragments):
        # The unit boundary nearest to j / k of the elements, leaving each fragment a unit.
        target = j * prefix[-1] / fragments
        cuts.append(min(range(cuts[-1] + 1, len(sizes) - fragments + j + 1),
                        key=lambda cut: (abs(prefix[cut] - target), cut)))
    cuts.append(len(sizes))
    return [list(range(cuts[j], cuts[j + 1])) for j in range(fragments)]


def fragment_parameters(units: list[list[str]], params: dict[str, nn.Parameter],
                        optimizer: Any, fragments: int) -> list[list[nn.Parameter]]:
    """The optimizer's parameters (``params``: name -> parameter after parallelizing) as
    ``fragments`` lists of consecutive units. Sizes are whole-tensor element counts, so
    every rank, whatever its shard, cuts at the same places."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    chosen = [[params[name] for name in unit if name in params and id(params[name]) in stepped]
              for unit in units]
    chosen = [unit for unit in chosen if unit]
    groups = split_units([sum(p.numel() for p in unit) for unit in chosen], fragments)
    return [[p for index in group for p in chosen[index]] for group in groups]


def due(step: int, *, fragment: int, every: int, fragments: int) -> bool:
    """Whether ``fragment`` is synchronised after optimizer step ``step`` (from 1)."""
    return step > 0 and (step + fragment * every // fragments) % every == 0
