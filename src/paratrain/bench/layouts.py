"""Layout rows of ``paratrain bench``: a row named by degrees (``cp=2``, ``dp_shard=2,cp=2``,
``ep=2``) instead of a strategy, launched as ``Run(parallel=...)``, and the small GPT
workloads such rows need.

A layout row's label is its canonical degree string (``str(paratrain.Parallel)``, e.g.
``"cp=2,dp_shard=2"`` is shown as ``dp_shard=2,cp=2``); strategy names never contain
``=``, so a label with one is a layout. Context parallel (``cp``) needs token inputs
and a model calling ``F.scaled_dot_product_attention`` whose sequence ``2 cp`` divides;
expert parallel (``ep``) needs a mixture-of-experts model whose expert count ``ep``
divides. :func:`layout_refusal` says in one line why a row cannot run.

Example::

    >>> layout_label("cp=2,dp_shard=2")
    'dp_shard=2,cp=2'
    >>> split_rows("single,ddp,cp=2;ep=2,dp_shard=2,cp=2")
    ['single', 'ddp', 'cp=2', 'ep=2,dp_shard=2,cp=2']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The bench's token workloads: ``module:callable`` -> (input_shape, vocab_size).
GPT_WORKLOAD = "paratrain.bench.layouts:gpt"
GPT_MOE_WORKLOAD = "paratrain.bench.layouts:gpt_moe"
TOKEN_WORKLOADS: dict[str, tuple[tuple[int, ...], int]] = {
    GPT_WORKLOAD: ((64,), 256),
    GPT_MOE_WORKLOAD: ((64,), 256),
    "paratrain.models:gpt_bench": ((64,), 512),
}


def gpt() -> Any:
    """The bench's dense GPT for layout rows: 2 blocks, width 128, 4 heads, 64 positions
    (``2 cp`` divides them for cp up to 32), vocabulary 256 (0.5M parameters)."""
    from paratrain.models import GPT

    return GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)


def gpt_moe() -> Any:
    """:func:`gpt` with a mixture of 4 experts per block, 2 per token (for ``ep`` 1, 2, 4)."""
    from paratrain.models import GPT

    return GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, experts=4,
               top_k=2)


def is_layout(name: str) -> bool:
    """Whether a row name is a layout of degrees (``cp=2``) rather than a strategy name."""
    return "=" in name


def layout_label(text: str) -> str:
    """The canonical degree string of a layout (ValueError in one line for a bad one)."""
    from paratrain.parallel import Parallel

    return str(Parallel.parse(text))


def split_rows(text: str) -> list[str]:
    """The ``--strategies`` items: comma- or ``;``-separated; consecutive degrees joined by
    commas are one layout (``dp_shard=2,cp=2``), so two layout rows in a row are
    separated by ``;`` (``cp=2;ep=2``)."""
    items: list[str] = []
    for group in text.split(";"):
        joined = False  # whether the last item of this group is a layout still open
        for part in (p.strip() for p in group.split(",")):
            if not part:
                continue
            # A precision (``+bf16-mixed``) closes a layout: it names the row's end.
            if is_layout(part) and joined and "+" not in items[-1]:
                items[-1] += f",{part}"
            else:
                items.append(part)
            joined = is_layout(part)
    return items


@dataclass(frozen=True)
class ModelFacts:
    """What layout rows need to know about the bench's model (from one forward pass)."""

    name: str
    tokens: bool = False  # int64 token inputs (a vocab_size is set)
    sequence: int = 0  # input_shape[0] of token inputs
    sdpa: bool = False  # its forward calls F.scaled_dot_product_attention
    experts: tuple[int, ...] = ()  # expert counts of its mixture-of-experts layers


def model_facts(model: Any, sample: Any, name: str, *, vocab_size: int | None) -> ModelFacts:
    """Run ``model(sample)`` once without gradients, watching for attention calls."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from paratrain.strategies.experts.moe import MoE

    seen: list[bool] = []

    class _Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is F.scaled_dot_product_attention:
                seen.append(True)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _Watch():
        model(sample)
    experts = tuple(m.num_experts for m in model.modules() if isinstance(m, MoE))
    return ModelFacts(name=name, tokens=vocab_size is not None,
                      sequence=sample.shape[1] if sample.dim() > 1 else 0, sdpa=bool(seen),
                      experts=experts)


def pick_model(rows: Sequence[str] | None) -> str:
    """The bench's model when none is named: the MoE GPT when a row has ``ep``, the dense
    GPT when one has ``cp``, else the demo ConvNet."""
    from paratrain.bench.worker import DEMO_MODEL
    from paratrain.parallel import Parallel

    layouts = []
    for item in rows or ():
        name = item.partition("+")[0]
        if is_layout(name):
            try:
                layouts.append(Parallel.parse(name))
            except ValueError:
                continue  # resolve_rows reports it
    if any(p.ep > 1 for p in layouts):
        return GPT_MOE_WORKLOAD
    if any(p.cp != 1 for p in layouts):
        return GPT_WORKLOAD
    return DEMO_MODEL


def layout_refusal(label: str, world_size: int, facts: ModelFacts | None) -> str:
    """Why layout ``label`` cannot run on ``world_size`` processes with this model, or ""."""
    from paratrain.parallel import Parallel

    try:
        degrees = Parallel.parse(label).resolve(world_size=world_size)
    except ValueError as exc:
        return str(exc).strip().splitlines()[0]
    if facts is None:
        return ""
    cp, ep = degrees.context_degree, degrees.expert_degree
    hint = f"e.g. the bench's {GPT_MOE_WORKLOAD if ep > 1 else GPT_WORKLOAD}"
    if cp > 1:
        if not facts.tokens:
            return (f"cp={cp} needs a token model (int64 sequences, --vocab-size); "
                    f"{facts.name} takes float inputs ({hint})")
        if not facts.sdpa:
            return (f"cp={cp} needs a model calling F.scaled_dot_product_attention; "
                    f"{facts.name} makes no such call ({hint})")
        if facts.sequence % (2 * cp):
            return (f"cp={cp} needs a sequence length divisible by 2 x cp = {2 * cp}; "
                    f"the input has {facts.sequence} tokens")
    if ep > 1:
        if not facts.experts:
            return f"ep={ep} needs a model with mixture-of-experts layers; {facts.name} has none ({hint})"
        odd = sorted({e for e in facts.experts if e % ep})
        if odd:
            return f"ep={ep} must divide the expert count; {facts.name} has {odd[0]} experts per layer"
    return ""
