"""Tensor-parallel plans: which linear layer is split how, validated before anything moves.

A plan maps glob patterns over module names (``fnmatch``, e.g. ``"blocks.*.attn.q"``)
to a style:

* ``"colwise"``: the layer's output features are split over the tensor ranks; its
  input is replicated, its output stays sharded (the next layer must consume shards).
* ``"rowwise"``: the input features are split; each rank's partial output is summed
  with one all-reduce, so the output is whole again on every rank.
* ``"colwise_gather_output"`` / ``"rowwise_split_input"``: the same splits with the whole
  output gathered (e.g. an output layer) / the whole input split on each rank.
* ``"embedding_rowwise"``: an ``nn.Embedding`` split over its vocabulary rows (each rank
  looks up its rows, one all-reduce makes the output whole).

A colwise layer followed by a rowwise one costs one all-reduce forward and one
backward (Megatron-style): per transformer block, attention q/k/v colwise + output
projection rowwise, MLP up colwise + down rowwise.

Without a user plan, the model is recognised in this order: an adapter the user
registered, the plan transformers ships with it
(:mod:`paratrain.adapters.transformers_plans`), a built-in adapter's, then
:func:`~paratrain.strategies.tensor.automatic.automatic_plan`, which finds the linear
layers of standard transformer blocks by name and splits a block completely or refuses
in one line; embeddings, norms and the output layer stay replicated there. Sequence
parallel (norms sharded over the sequence) and loss parallel (a sharded output layer)
are strategy options on top of a plan, see :mod:`paratrain.strategies.tensor.sequence`.

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

from paratrain.adapters import adapter_for, user_adapter_for
from paratrain.adapters.transformers_plans import transformers_plan
from paratrain.distributed._compat import transposed_linear_style
from paratrain.parallel.options import STYLES, validate_plan
from paratrain.strategies.tensor.automatic import (
    COLWISE_NAMES,
    FUSED_QKV_NAMES,
    HEAD_DIM_ATTRIBUTES,
    ROWWISE_NAMES,
    check_heads_found,
)
from paratrain.strategies.tensor.automatic import automatic_plan as _automatic_plan

__all__ = ["COLWISE_NAMES", "FUSED_QKV_NAMES", "HEAD_ATTRIBUTES", "ROWWISE_NAMES", "STYLES",
           "automatic_plan", "check_divisible", "parallel_style", "resolve_plan",
           "shard_heads", "split_attributes", "validate_plan"]


HEAD_ATTRIBUTES = ("n_head", "num_heads", "n_heads", "num_attention_heads",
                   "num_key_value_heads", "num_kv_heads", "n_kv_heads")
"""Attributes of an attention module that count its heads; divided by the tensor degree."""

CONFIG_HEAD_ATTRIBUTES = ("num_attention_heads", "num_key_value_heads")
"""Head counts of a Hugging Face config, which the degree must divide (the attention
infers its share from the split width; the config itself is left as it is)."""


def resolve_plan(model: nn.Module, plan: dict[str, str] | None) -> dict[str, str]:
    """``{module name: style}`` for ``model``: the user's patterns expanded, else an
    adapter the user registered, else the plan transformers ships with the model, else a
    built-in adapter's, else the automatic plan. ValueError for a pattern that matches
    nothing (the user's or an adapter's), a module matched by two patterns, or a match
    its style cannot split."""
    if plan is None:
        user = user_adapter_for(model)
        has_plan = user is not None and (user.tensor_plan or user.tensor_refusal)
        shipped = None if has_plan else transformers_plan(model)
        if shipped is not None:
            # transformers' plans name what some configs or pipeline stages lack.
            resolved = _untied(model, _expand(model, shipped, strict=False))
            if any(style in ("colwise", "rowwise") for style in resolved.values()):
                check_heads_found(model, resolved, split_attributes(model))
                return resolved
        adapter = adapter_for(model)
        if adapter is not None and adapter.tensor_refusal is not None:
            raise ValueError(adapter.tensor_refusal)
        if adapter is None or adapter.tensor_plan is None:
            return automatic_plan(model)
        plan = adapter.tensor_plan(model)
    validate_plan(plan)
    return _expand(model, plan, strict=True)


def _expand(model: nn.Module, plan: dict[str, str], *, strict: bool) -> dict[str, str]:
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        names = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not names and strict:
            raise ValueError(f"plan pattern {pattern!r} matches no module of the model; "
                             "patterns are globs over names from model.named_modules()")
        for name in names:
            if name in resolved and resolved[name] != style:
                raise ValueError(f"module {name!r} is matched by plan patterns with styles "
                                 f"{resolved[name]!r} and {style!r}; make the patterns disjoint")
            if not is_splittable(modules[name], style):
                kind = "nn.Embedding" if style == "embedding_rowwise" else (
                    "nn.Linear layers (and Hugging Face's Conv1D)")
                raise ValueError(f"plan pattern {pattern!r} matches {name!r}, a "
                                 f"{type(modules[name]).__name__}; only {kind} can be split "
                                 f"{style}")
            resolved[name] = style
    return resolved


def automatic_plan(model: nn.Module) -> dict[str, str]:
    """The automatic plan (:mod:`paratrain.strategies.tensor.automatic`), dividing this
    model's :func:`split_attributes`."""
    return _automatic_plan(model, split_attributes(model))


def is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear whose weight is ``(in, out)``."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2)


def is_splittable(module: nn.Module, style: str = "colwise") -> bool:
    """Whether tensor parallel can split ``module`` in ``style``."""
    if style == "embedding_rowwise":
        return isinstance(module, nn.Embedding)
    if style in ("colwise", "rowwise") and is_transposed_linear(module):
        return True
    return isinstance(module, nn.Linear)


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a splittable layer (an embedding's rows are its
    inputs)."""
    if is_transposed_linear(module):
        rows, columns = module.weight.shape
        return int(rows), int(columns)
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return module.in_features, module.out_features


def parallel_style(module: nn.Module, style: str, **options: Any) -> Any:
    """torch's ``ColwiseParallel``/``RowwiseParallel`` (with ``options``) for ``module`` in
    ``style``; for a ``Conv1D``, the same split of its transposed weight."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if is_transposed_linear(module):
        return transposed_linear_style(style, **options)
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate(), **options)
    if style in ("rowwise_split_input", "embedding_rowwise"):
        # torch's RowwiseParallel on an nn.Embedding splits its rows; the token ids are
        # whole on every rank (not sharded on the last dimension, RowwiseParallel's default).
        return RowwiseParallel(input_layouts=Replicate(), **options)
    return ColwiseParallel(**options) if style == "colwise" else RowwiseParallel(**options)


def check_divisible(model: nn.Module, plan: dict[str, str], degree: int) -> None:
    """ValueError naming the layer whose split dimension (or head count) ``degree``
    does not divide."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        in_features, out_features = features(modules[name])
        colwise = style.startswith("colwise")
        size = out_features if colwise else in_features
        if size % degree:
            side = ("num_embeddings" if style == "embedding_rowwise"
                    else "out_features" if colwise else "in_features")
            raise ValueError(f"{name}.{side}={size} is not divisible by the tensor degree "
                             f"{degree}; choose a tensor degree that divides it")
    for parent_name, parent in _head_owners(model, plan):
        for attribute, heads in _head_counts(model, parent).items():
            if heads % degree:
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
    extra = adapter.split_attributes if adapter is not None else ()
    return tuple(dict.fromkeys(HEAD_ATTRIBUTES + extra))


def _head_counts(model: nn.Module, parent: nn.Module) -> dict[str, int]:
    # The parent's own head attributes; for an attention (a module with a head width),
    # also its Hugging Face config's head counts, which its split width must agree with.
    counts = {a: getattr(parent, a) for a in split_attributes(model)
              if isinstance(getattr(parent, a, None), int)}
    if not any(isinstance(getattr(parent, a, None), int) for a in HEAD_DIM_ATTRIBUTES):
        return counts
    config = getattr(parent, "config", None) or getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attribute in CONFIG_HEAD_ATTRIBUTES:
        if isinstance(getattr(config, attribute, None), int):
            counts.setdefault(f"config.{attribute}", getattr(config, attribute))
    return counts


def _untied(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    # Splitting one holder of a tied weight (Gemma's head and embedding) would untie it:
    # transformers' entries for tied modules are left out, both stay whole. The ties
    # transformers declares count too: a pipeline stage holds one of the two.
    holders: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), set()).add(name.rpartition(".")[0])
    tied = {m for names in holders.values() if len(names) > 1 for m in names}
    declared = getattr(model, "all_tied_weights_keys", None)
    if isinstance(declared, dict):
        tied |= {str(key).rpartition(".")[0] for pair in declared.items() for key in pair}
    return {name: style for name, style in plan.items() if name not in tied}


def _head_owners(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module]]:
    modules = dict(model.named_modules())
    owners = {name.rpartition(".")[0] for name, style in plan.items() if style == "colwise"}
    return [(name, modules[name]) for name in sorted(owners)]
