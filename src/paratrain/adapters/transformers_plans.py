"""The tensor-parallel plans transformers ships with its models, read as paratrain plans.

transformers 5.x gives every family it can split a plan: the config class's
``base_model_tp_plan`` (globs under the base model, e.g. GPT-NeoX's
``{"layers.*.attention.query_key_value": "colwise", "layers.*.attention.dense":
"rowwise", ...}``) and the model class's ``_tp_plan`` (``{"lm_head":
"colwise_gather_output"}``); a model instance holds both merged under full names
(``gpt_neox.layers.*...``). Such a model needs no code here: :func:`transformers_plan`
reads that plan, prefixed with the base model's attribute (``model.``, ``gpt_neox.``)
where only the config's is there, and maps transformers' style names onto the ones
paratrain runs (:data:`HF_STYLES`). A style paratrain does not run (packed or
expert-parallel MoE weights, ``local_params``, ...) is refused in one line.

Example:
    >>> import transformers                                          # doctest: +SKIP
    >>> config = transformers.MistralConfig(hidden_size=32, num_hidden_layers=1,
    ...     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    >>> transformers_plan(transformers.MistralForCausalLM(config))["lm_head"]
    'colwise_gather_output'
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

__all__ = ["HF_STYLES", "LEFT_WHOLE", "transformers_plan"]

HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    "colwise_rep": "colwise_gather_output",
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
    "rowwise_split_input": "rowwise_split_input",
    "embedding_rowwise": "embedding_rowwise",
}
"""transformers' style name -> paratrain's (see ``paratrain.strategies.tensor.plan.STYLES``):
``colwise`` (output sharded) and ``rowwise`` (input sharded, output summed) as in torch;
``*_gather_output``/``*_rep`` with the whole output (or input) on every rank; an
embedding split over its vocabulary rows."""

LEFT_WHOLE = frozenset({"replicate", "sequence_parallel"})
"""Entries paratrain leaves out of the plan: ``replicate`` keeps the module whole, and
norms are sharded over the sequence by ``strategy_options={'sequence_parallel': True}``."""


def transformers_plan(model: nn.Module) -> dict[str, str] | None:
    """``{glob over module names: paratrain style}`` from ``model``'s transformers plan;
    None when the model carries none (BERT, GPT-2, OPT, T5, ...). ValueError naming an
    entry whose style paratrain does not run."""
    plan = _shipped_plan(model)
    if not plan:
        return None
    resolved = {}
    for pattern, style in plan.items():
        if style in LEFT_WHOLE:
            continue
        if style not in HF_STYLES:
            raise ValueError(
                f"transformers' tensor plan of {type(model).__name__} gives {pattern!r} the "
                f"style {style!r}, which paratrain does not run; pass strategy_options="
                "{'plan': {...}} with colwise/rowwise linears (e.g. the attention only), or "
                "use dp_shard (fsdp)")
        resolved[pattern] = HF_STYLES[style]
    return resolved or None


def _shipped_plan(model: nn.Module) -> dict[str, Any]:
    # An instance's _tp_plan is transformers' own merge of the class's plan and the
    # base model's, under full names; built by hand where only the config has one.
    merged = getattr(model, "_tp_plan", None)
    if isinstance(merged, dict) and merged:
        return dict(merged)
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not isinstance(base_plan, dict) or not base_plan:
        return {}
    prefix = _base_prefix(model, base_plan)
    own = getattr(type(model), "_tp_plan", None)
    return {**(own if isinstance(own, dict) else {}),
            **{f"{prefix}{pattern}": style for pattern, style in base_plan.items()}}


def _base_prefix(model: nn.Module, base_plan: dict[str, Any]) -> str:
    # The base model's attribute (``model.``), the model itself, or, for a module that
    # holds a model's children under their names (a pipeline stage), the child under
    # which the config's patterns name modules.
    names = [name for name, _ in model.named_modules()]
    attribute = getattr(model, "base_model_prefix", "")
    candidates = [attribute] if attribute else []
    candidates += ["", *(name for name, _ in model.named_children())]
    for candidate in candidates:
        prefix = f"{candidate}." if candidate else ""
        if any(fnmatch.fnmatchcase(name, prefix + pattern)
               for pattern in base_plan for name in names):
            return prefix
    return ""
