"""Tensor-parallel plans: which linear layer is split how, validated before anything moves.

A plan maps glob patterns over module names (``fnmatch``, e.g. ``"blocks.*.attn.q"``)
to a style:

* ``"colwise"``: the layer's output features are split over the tensor ranks; its
  input is replicated, its output stays sharded (the next layer must consume shards).
* ``"rowwise"``: the input features are split; each rank's partial output is summed
  with one all-reduce, so the output is whole again on every rank.

A colwise layer followed by a rowwise one costs one all-reduce forward and one
backward (Megatron-style): per transformer block, attention q/k/v colwise + output
projection rowwise, MLP up colwise + down rowwise.

Without a user plan, :func:`automatic_plan` finds the linear layers of standard
transformer blocks by their names (:data:`COLWISE_NAMES`, :data:`ROWWISE_NAMES`) inside
a ``ModuleList``/``ModuleDict`` of blocks; embeddings, norms and the output layer stay
replicated. Sequence parallel (norms sharded over the sequence) and loss parallel (a
sharded output layer) are strategy options on top of a plan, see
:mod:`paratrain.strategies.tensor.sequence`.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> resolve_plan(model, {"0": "colwise", "2": "rowwise"})
    {'0': 'colwise', '2': 'rowwise'}
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from paratrain.adapters import adapter_for
from paratrain.distributed._compat import transposed_linear_style

STYLES = ("colwise", "rowwise")
"""Styles a plan may name."""

HEAD_ATTRIBUTES = ("n_head", "num_heads", "n_heads")
"""Attributes of an attention module that count its heads; divided by the tensor degree."""

COLWISE_NAMES = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj",
                           "v_proj", "wq", "wk", "wv", "fc", "fc1", "c_fc", "up", "up_proj",
                           "gate_proj", "w1", "w3"})
"""Last name components the automatic plan splits colwise."""

ROWWISE_NAMES = frozenset({"proj", "o_proj", "out_proj", "c_proj", "wo", "fc2", "down",
                           "down_proj", "w2"})
"""Last name components the automatic plan splits rowwise."""

FUSED_QKV_NAMES = frozenset({"qkv", "c_attn", "qkv_proj", "Wqkv"})
"""Fused q/k/v projections: a plain colwise split would hand a rank all of q and part of
k, so the automatic plan refuses them."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def validate_plan(plan: Any) -> None:
    """ValueError naming the bad entry unless ``plan`` maps pattern strings to styles."""
    if plan is None:
        return
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"plan must be a non-empty dict {{pattern: style}} or None, got {plan!r}")
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"plan pattern must be a non-empty string, got {pattern!r}")
        if style not in STYLES:
            hint = ("; norms are sharded by strategy_options={'sequence_parallel': True}, "
                    "leave them out of the plan" if style == "sequence" else "")
            raise ValueError(f"plan[{pattern!r}] has style {style!r}; choose one of "
                             f"{', '.join(STYLES)}{hint}")


def resolve_plan(model: nn.Module, plan: dict[str, str] | None) -> dict[str, str]:
    """``{module name: style}`` for ``model``: the user's patterns expanded, or the
    automatic plan. ValueError for a pattern that matches nothing, a module matched by
    two patterns, or a match that is not an ``nn.Linear``."""
    if plan is None:
        adapter = adapter_for(model)
        if adapter is not None and adapter.tensor_refusal is not None:
            raise ValueError(adapter.tensor_refusal)
        if adapter is None or adapter.tensor_plan is None:
            return automatic_plan(model)
        plan = adapter.tensor_plan(model)
    validate_plan(plan)
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        names = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not names:
            raise ValueError(f"plan pattern {pattern!r} matches no module of the model; "
                             "patterns are globs over names from model.named_modules()")
        for name in names:
            if name in resolved and resolved[name] != style:
                raise ValueError(f"module {name!r} is matched by plan patterns with styles "
                                 f"{resolved[name]!r} and {style!r}; make the patterns disjoint")
            if not is_splittable(modules[name]):
                raise ValueError(f"plan pattern {pattern!r} matches {name!r}, a "
                                 f"{type(modules[name]).__name__}; only nn.Linear layers "
                                 "(and Hugging Face's Conv1D) can be split")
            resolved[name] = style
    return resolved


def is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear whose weight is ``(in, out)``."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2)


def is_splittable(module: nn.Module) -> bool:
    """Whether tensor parallel can split ``module`` colwise or rowwise."""
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a splittable layer."""
    if is_transposed_linear(module):
        rows, columns = module.weight.shape
        return int(rows), int(columns)
    return module.in_features, module.out_features


def parallel_style(module: nn.Module, style: str, **options: Any) -> Any:
    """torch's ``ColwiseParallel``/``RowwiseParallel`` (with ``options``) for ``module``;
    for a ``Conv1D``, the same split of its transposed weight."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if is_transposed_linear(module):
        return transposed_linear_style(style, **options)
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[style](**options)


def automatic_plan(model: nn.Module) -> dict[str, str]:
    """Colwise/rowwise linears of the transformer blocks, found by name (see module doc)."""
    resolved: dict[str, str] = {}
    for prefix, container in model.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        for block_name, block in container.named_children():
            base = f"{prefix}.{block_name}" if prefix else block_name
            for name, module in block.named_modules():
                if not isinstance(module, nn.Linear):
                    continue
                leaf = name.rpartition(".")[2]
                full = f"{base}.{name}"
                if leaf in FUSED_QKV_NAMES:
                    raise ValueError(
                        f"fused q/k/v projection {full!r} cannot be split colwise as is; use "
                        "separate q/k/v linears or give strategy_options={'plan': {...}} "
                        "that leaves it out")
                if leaf in COLWISE_NAMES:
                    resolved[full] = "colwise"
                elif leaf in ROWWISE_NAMES:
                    resolved[full] = "rowwise"
    if not resolved:
        raise ValueError(f"no adapter knows {type(model).__name__} and the automatic "
                         "tensor-parallel plan found no attention/MLP linears in a ModuleList "
                         "of blocks; pass a plan (TensorParallel(plan={'blocks.*.attn.q': "
                         "'colwise', ...})) or register an adapter "
                         "(paratrain.adapters.register_adapter)")
    return resolved


def check_divisible(model: nn.Module, plan: dict[str, str], degree: int) -> None:
    """ValueError naming the layer whose split dimension (or head count) ``degree``
    does not divide."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        in_features, out_features = features(modules[name])
        size = out_features if style == "colwise" else in_features
        if size % degree:
            side = "out_features" if style == "colwise" else "in_features"
            raise ValueError(f"{name}.{side}={size} is not divisible by the tensor degree "
                             f"{degree}; choose a tensor degree that divides it")
    for parent_name, parent in _head_owners(model, plan):
        for attribute in split_attributes(model):
            heads = getattr(parent, attribute, None)
            if isinstance(heads, int) and heads % degree:
                raise ValueError(f"{parent_name or 'model'}.{attribute}={heads} is not divisible "
                                 f"by the tensor degree {degree}; choose a tensor degree that "
                                 "divides the number of heads")


def shard_heads(model: nn.Module, plan: dict[str, str], degree: int) -> None:
    """Divide the head count of every module that owns a colwise layer by ``degree``:
    after the split each rank computes its share of the heads."""
    for _, parent in _head_owners(model, plan):
        for attribute in split_attributes(model):
            heads = getattr(parent, attribute, None)
            if isinstance(heads, int):
                setattr(parent, attribute, heads // degree)


def split_attributes(model: nn.Module) -> tuple[str, ...]:
    """Attributes divided by the tensor degree: head counts, and the model's adapter's."""
    adapter = adapter_for(model)
    return HEAD_ATTRIBUTES + (adapter.split_attributes if adapter is not None else ())


def _head_owners(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module]]:
    modules = dict(model.named_modules())
    owners = {name.rpartition(".")[0] for name, style in plan.items() if style == "colwise"}
    return [(name, modules[name]) for name in sorted(owners)]
