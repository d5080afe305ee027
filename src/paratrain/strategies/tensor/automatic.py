"""The automatic tensor-parallel plan: for models with no plan of their own.

Used when the model carries no transformers plan and no adapter gives one. It reads the
linear layers of the blocks in a ``ModuleList``/``ModuleDict`` by their last name
(:data:`COLWISE_NAMES`, :data:`ROWWISE_NAMES`) and then checks each block: a module
whose linears it splits (an attention, an MLP) must have its input linears colwise AND
its output linear rowwise, with none left whole, and an attention must have head counts
paratrain can divide. Otherwise it refuses in one line naming the layer, instead of a
half-split model that fails with a shape error (or trains wrong) later.

Example:
    >>> from torch import nn
    >>> block = nn.ModuleDict({"fc": nn.Linear(4, 8), "proj": nn.Linear(8, 4)})
    >>> automatic_plan(nn.ModuleList([block]))
    {'0.fc': 'colwise', '0.proj': 'rowwise'}
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

__all__ = ["COLWISE_NAMES", "FUSED_QKV_NAMES", "HEAD_DIM_ATTRIBUTES", "ROWWISE_NAMES",
           "automatic_plan", "check_heads_found"]

COLWISE_NAMES = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj",
                           "v_proj", "wq", "wk", "wv", "q_lin", "k_lin", "v_lin", "fc", "fc1",
                           "c_fc", "up", "up_proj", "gate_proj", "w1", "w3", "lin1"})
"""Last name components the automatic plan splits colwise."""

ROWWISE_NAMES = frozenset({"proj", "o_proj", "out_proj", "out_lin", "c_proj", "wo", "fc2",
                           "down", "down_proj", "w2", "lin2"})
"""Last name components the automatic plan splits rowwise."""

FUSED_QKV_NAMES = frozenset({"qkv", "c_attn", "qkv_proj", "Wqkv"})
"""Fused q/k/v projections: a plain colwise split would hand a rank all of q and part of
k, so the automatic plan refuses them."""

ATTENTION_INPUTS = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj",
                              "v_proj", "wq", "wk", "wv", "q_lin", "k_lin", "v_lin"})
"""Colwise names that make their parent an attention (whose heads are split)."""

HEAD_DIM_ATTRIBUTES = ("head_dim", "head_size", "attention_head_size")
"""Attributes giving one head's width: an attention with one infers its head count."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_FIX = ("pass strategy_options={'plan': {...}} that splits it completely, or register an "
        "adapter (paratrain.adapters.register_adapter)")


def automatic_plan(model: nn.Module, head_attributes: tuple[str, ...] = ()) -> dict[str, str]:
    """Colwise/rowwise linears of the transformer blocks, found by name and checked block
    by block (see module doc); ``head_attributes`` are the attributes tensor parallel
    divides (head counts), which an attention must use for every head count it holds."""
    _refuse_per_head_biases(model)
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
    _check_complete(model, resolved)
    check_heads_found(model, resolved, head_attributes)
    return resolved


def check_heads_found(model: nn.Module, plan: dict[str, str],
                      head_attributes: tuple[str, ...]) -> None:
    """ValueError for an attention split colwise whose heads paratrain cannot account for:
    no head count it divides and no head width to infer one from, or an integer
    attribute named like a head count (equal to a split layer's heads) it would not
    divide (StableLM's ``num_key_value_heads`` before it was known)."""
    modules = dict(model.named_modules())
    for parent, children in _split_children(plan).items():
        leaves = {name.rpartition(".")[2] for name in children["colwise"]}
        if not leaves & ATTENTION_INPUTS:
            continue
        owner = modules[parent]
        width = next((getattr(owner, a) for a in HEAD_DIM_ATTRIBUTES
                      if _is_int(getattr(owner, a, None))), None)
        divided = [a for a in head_attributes if _is_int(getattr(owner, a, None))]
        if width is None and not divided:
            raise ValueError(f"attention {parent!r} has no head count paratrain divides "
                             f"({', '.join(head_attributes)}) and no head width "
                             f"({', '.join(HEAD_DIM_ATTRIBUTES)}); register an adapter whose "
                             "split_attributes name its head counts")
        if width is None:
            continue
        heads = {modules[name].out_features // width for name in children["colwise"]}
        for attribute, value in vars(owner).items():
            if ("head" in attribute and _is_int(value) and value in heads
                    and attribute not in head_attributes and attribute not in HEAD_DIM_ATTRIBUTES):
                raise ValueError(f"{parent}.{attribute}={value} counts heads that tensor "
                                 "parallel splits, but paratrain does not know to divide it; "
                                 "register an adapter with split_attributes=("
                                 f"{attribute!r},)")


def _refuse_per_head_biases(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(getattr(module, "relative_attention_bias", None), nn.Embedding):
            raise ValueError(
                f"{name or 'model'}.relative_attention_bias holds one position bias per head "
                "(T5-style), which the automatic tensor-parallel plan cannot split with the "
                "heads; use dp_shard (fsdp) or dp_replicate (ddp), or register an adapter")


def _check_complete(model: nn.Module, plan: dict[str, str]) -> None:
    modules = dict(model.named_modules())
    for parent, children in _split_children(plan).items():
        whole = sorted(name for name, child in modules[parent].named_children()
                       if isinstance(child, nn.Linear) and f"{parent}.{name}" not in plan)
        if children["colwise"] and children["rowwise"] and not whole:
            continue

        def leaves(names: list[str]) -> str:
            return ", ".join(n.rpartition(".")[2] for n in names) or "none"

        raise ValueError(f"the automatic tensor-parallel plan would split {parent!r} only in "
                         f"part (colwise: {leaves(children['colwise'])}; rowwise: "
                         f"{leaves(children['rowwise'])}; left whole: {', '.join(whole) or 'none'}"
                         f"); {_FIX}")


def _split_children(plan: dict[str, str]) -> dict[str, dict[str, list[str]]]:
    # {parent module: {"colwise": [layers], "rowwise": [layers]}}
    parents: dict[str, dict[str, list[str]]] = defaultdict(lambda: {"colwise": [], "rowwise": []})
    for name, style in plan.items():
        if style in ("colwise", "rowwise"):
            parents[name.rpartition(".")[0]][style].append(name)
    return dict(parents)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
