"""Sequence parallel and loss parallel: the two options that extend a tensor-parallel plan.

**Sequence parallel** (``sequence_parallel=True``): between the split layers, the residual
stream ``(batch, sequence, hidden)`` is split over the tensor ranks along the sequence
(dim 1) instead of being held whole by every rank. Each block's norms (every module of a
block that has parameters and is neither a planned linear nor the attention/MLP module
around one) run on ``1/t`` of the tokens; the input of the attention/MLP module is
all-gathered once, and each rowwise layer reduce-scatters its output (instead of
all-reducing it) back onto the sequence shards: the same bytes on the wire, ``1/t`` of the
norm and residual activations per rank. The stream is split when it enters the first
block and gathered when it leaves the last one, so embeddings, the final norm and the
output layer are unchanged (and the block container must hold only planned blocks).
The norms' parameters become replicated DTensors whose gradients are summed over the
tensor ranks, since each rank saw different tokens.

Assumptions, checked where they can be: hidden states are ``(batch, sequence, hidden)``;
a block's norms act on each token alone; a block and an attention/MLP module receive the
hidden state as their first positional argument or by keyword (``hidden_states=``, as
Hugging Face's decoder layers pass it); the sequence length is divisible by the degree.
Planned layers outside the blocks (an embedding split over its rows, an output layer
whose output is gathered) see the whole sequence, as without sequence parallel.

**Loss parallel** (``loss_parallel=True``): the output layer is split colwise over the
vocabulary and its logits stay a DTensor sharded over it, so no rank ever holds the
whole ``(batch, sequence, vocab)`` logits. ``F.cross_entropy`` on them works as written
because the strategy holds torch's ``loss_parallel()`` for the run's lifetime (the
backward needs it too); other uses of the logits call ``.full_tensor()``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from paratrain.strategies.tensor.plan import parallel_style

__all__ = ["OUTPUT_NAMES", "apply_loss_parallel", "apply_sequence_parallel", "block_container",
           "find_output_layer", "loss_parallel_context", "sequence_parallel_styles"]

HIDDEN_KEYWORDS = ("hidden_states", "hidden", "x")
"""Keywords a block or attention/MLP module may receive the hidden state by."""

OUTSIDE_STYLES = frozenset({"embedding_rowwise", "colwise_gather_output"})
"""Styles whose layers may sit outside the blocks: their output is whole."""

OUTPUT_NAMES = ("head", "lm_head", "output")
"""Top-level names loss parallel takes for the output layer unless ``output_layer`` is given."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def block_container(model: nn.Module, plan: dict[str, str]) -> tuple[str, list[str]]:
    """``(container name, [block names])``: the one ``ModuleList``/``ModuleDict`` whose
    children hold the planned layers. ValueError when the planned layers lie outside such
    blocks, in two containers, or when a block holds no planned layer (its norms would see
    sequence shards with unsplit parameters)."""
    containers = {name: module for name, module in model.named_modules()
                  if isinstance(module, _CONTAINERS)}

    def child_holding(container: str, layer: str) -> str | None:
        # The container's child that holds ``layer`` deeper down (a block), or None when
        # the layer is outside it or is itself the child (a ModuleDict of linears).
        prefix = f"{container}." if container else ""
        child, _, rest = layer[len(prefix):].partition(".")
        return f"{prefix}{child}" if layer.startswith(prefix) and rest else None

    # nanoGPT nests its ModuleList of blocks in a ModuleDict, and blocks may keep linears in
    # a ModuleDict: the block container is the one with the most children holding layers.
    blocks_held = {name: {child_holding(name, layer) for layer in plan} - {None}
                   for name in containers}
    owners = set()
    for layer, style in plan.items():
        candidates = [name for name in containers if child_holding(name, layer)]
        if not candidates and style in OUTSIDE_STYLES and len(plan) > 1:
            continue  # the embedding or the output layer: whole outputs, outside the stream
        if not candidates:
            raise ValueError(f"sequence_parallel needs the planned layers inside a ModuleList "
                             f"of blocks; {layer!r} is not in one")
        owners.add(max(candidates, key=lambda name: (len(blocks_held[name]), len(name))))
    if len(owners) != 1:
        raise ValueError(f"sequence_parallel needs the planned layers in one ModuleList of "
                         f"blocks, found them in {sorted(owners)}")
    (owner,) = owners
    prefix = f"{owner}." if owner else ""
    blocks = [f"{prefix}{child}" for child, _ in containers[owner].named_children()]
    for block in blocks:
        if not any(layer.startswith(f"{block}.") for layer in plan):
            raise ValueError(f"sequence_parallel needs every block of {owner!r} in the plan; "
                             f"{block!r} has no planned layer")
    return owner, blocks


def sequence_parallel_styles(model: nn.Module, plan: dict[str, str],
                             blocks: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``({module name: ParallelStyle}, [names of modules whose first input is gathered])``
    for the planned layers, the blocks' norms and the attention/MLP modules."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    modules = dict(model.named_modules())
    styles: dict[str, Any] = {}
    gathered: list[str] = []
    for name, style in plan.items():
        parent = name.rpartition(".")[0]
        if not any(name.startswith(f"{block}.") for block in blocks):
            styles[name] = parallel_style(modules[name], style)  # sees the whole sequence
            continue
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"sequence parallel splits a block's layers colwise or rowwise; "
                             f"{name!r} has style {style!r}: train without sequence_parallel "
                             "or give a plan with colwise/rowwise layers in the blocks")
        if style == "rowwise":
            styles[name] = parallel_style(modules[name], style, output_layouts=Shard(1))
        elif parent in blocks or isinstance(modules[parent], _CONTAINERS):
            # Called straight from the block (no module around it to gather once for
            # all its siblings): this layer gathers its own input.
            styles[name] = parallel_style(modules[name], style, input_layouts=Shard(1))
        else:
            styles[name] = parallel_style(modules[name], style)
            if parent not in gathered:
                gathered.append(parent)
    for block in blocks:
        for name, module in modules[block].named_modules(prefix=block):
            inside = any(name == g or name.startswith(f"{g}.") for g in gathered)
            planned_or_above = any(p == name or p.startswith(f"{name}.") for p in plan)
            if not inside and not planned_or_above and _owns_parameters(module):
                _check_per_token(name, module)
                # Local output: a block may add the norm's output to its (local) residual.
                styles[name] = SequenceParallel(use_local_output=True)
    return styles, gathered


def apply_sequence_parallel(model: nn.Module, tp_mesh: Any, plan: dict[str, str]) -> None:
    """Split ``plan``'s linears with the residual stream sharded over the sequence."""
    from torch.distributed.tensor.parallel import parallelize_module

    _, blocks = block_container(model, plan)
    styles, gathered = sequence_parallel_styles(model, plan, blocks)
    parallelize_module(model, tp_mesh, styles)
    modules = dict(model.named_modules())
    for name in gathered:
        modules[name].register_forward_pre_hook(_GatherFirstInput(tp_mesh), with_kwargs=True)
    modules[blocks[0]].register_forward_pre_hook(_ShardFirstInput(tp_mesh), with_kwargs=True)
    modules[blocks[-1]].register_forward_hook(_GatherOutput(tp_mesh))


def find_output_layer(model: nn.Module, name: str | None) -> str:
    """The output linear's name: ``name`` if given, else the first of :data:`OUTPUT_NAMES`
    the model has. ValueError naming the fix when there is none or it is not a Linear."""
    modules = dict(model.named_modules())
    if name is None:
        name = next((n for n in OUTPUT_NAMES if n in modules), None)
        if name is None:
            raise ValueError("loss_parallel found no output layer named "
                             f"{', '.join(OUTPUT_NAMES)}; give strategy_options="
                             "{'output_layer': '<name>'}")
    if not isinstance(modules.get(name), nn.Linear):
        kind = type(modules[name]).__name__ if name in modules else "no module"
        raise ValueError(f"output_layer {name!r} is {kind}; loss_parallel splits an nn.Linear")
    weight = modules[name].weight
    tied = [n for n, p in model.named_parameters(remove_duplicate=False)
            if p is weight and not n.startswith(f"{name}.")]
    if tied:
        # Splitting one holder would untie it: the embedding would train a separate copy.
        raise ValueError(f"loss_parallel would split {name}.weight, which is tied to "
                         f"{tied[0]}; untie them (e.g. tie_word_embeddings=False) or turn "
                         "loss_parallel off")
    return name


def apply_loss_parallel(model: nn.Module, tp_mesh: Any, output_layer: str) -> None:
    """Split ``output_layer`` colwise over the vocabulary, leaving its logits sharded."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    linear = model.get_submodule(output_layer)
    degree = tp_mesh.size()
    if linear.out_features % degree:
        raise ValueError(f"{output_layer}.out_features={linear.out_features} is not divisible "
                         f"by the tensor degree {degree}; pad the vocabulary to a multiple "
                         "of it or turn loss_parallel off")
    parallelize_module(model, tp_mesh, {
        output_layer: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def loss_parallel_context() -> contextlib.AbstractContextManager:
    """torch's ``loss_parallel()``: cross-entropy over vocabulary-sharded logits."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _check_per_token(name: str, module: nn.Module) -> None:
    # Only a module that works on each token alone (a norm: 1-D weights) may see a slice
    # of the sequence; a matrix outside the plan (attention left whole) would silently
    # attend within the slice.
    if any(p.dim() > 1 for p in module.parameters(recurse=False)):
        raise ValueError(f"sequence parallel cannot shard the sequence around {name!r} "
                         f"({type(module).__name__}): it holds a matrix the tensor plan "
                         "does not split; train without sequence_parallel or give a plan "
                         "that splits it")


def _hidden_state(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    # The first positional argument, or the hidden state passed by keyword.
    if args:
        return args[0]
    for key in HIDDEN_KEYWORDS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    raise ValueError(f"sequence parallel found no hidden state in the call of "
                     f"{type(module).__name__}: it takes it as the first positional argument "
                     f"or by keyword ({', '.join(HIDDEN_KEYWORDS)}); train without "
                     "sequence_parallel")


def _replace_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    key = next(k for k in HIDDEN_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor))
    return args, {**kwargs, key: hidden}


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


class _ShardFirstInput:
    """Forward pre-hook: the whole hidden state becomes this rank's sequence shard.

    Through DTensor, so the backward all-gathers the shards' gradients: the replicated
    layers before the blocks get the gradient of every token.
    """

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        hidden = _hidden_state(module, args, kwargs)
        length, degree = hidden.shape[1], self.mesh.size()
        if length % degree:
            raise ValueError(f"sequence length {length} is not divisible by the tensor degree "
                             f"{degree}; sequence_parallel needs one that it divides")
        whole = DTensor.from_local(hidden, self.mesh, [Replicate()], run_check=False)
        return _replace_hidden(args, kwargs,
                               whole.redistribute(self.mesh, [Shard(1)]).to_local())


class _GatherFirstInput:
    """Forward pre-hook of an attention/MLP module: its input sequence shards, all-gathered
    once (a DTensor, so the backward reduce-scatters the summed input gradient)."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        hidden = _hidden_state(module, args, kwargs)
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, self.mesh, [Shard(1)], run_check=False)
        return _replace_hidden(args, kwargs, hidden.redistribute(self.mesh, [Replicate()]))


class _GatherOutput:
    """Forward hook of the last block: the sequence shards, whole again, as a plain tensor."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(output, DTensor):
            output = DTensor.from_local(output, self.mesh, [Shard(1)], run_check=False)
        gathered = output.redistribute(self.mesh, [Replicate()]).to_local()
        # to_local() is a view; FSDP2 (fsdp_tp) warns on a view output, since an in-place
        # op on it would skip its pre-backward hook. One copy of the stream per step.
        return gathered.clone()
