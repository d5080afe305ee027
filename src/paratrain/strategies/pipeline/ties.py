"""Tied parameters on different pipeline stages: one logical tensor, one copy per rank.

A language model's embedding and head are often one tensor (GPT-2's ``wte`` and
``lm_head``, Llama with ``tie_word_embeddings=True``), but a pipeline puts them on the
first and the last stage, in different processes. As Megatron does, each of those ranks
holds a copy; after backward the copies' gradients are summed over a group of exactly
the ranks that hold them (one group per pipeline replica), so every copy receives the
gradient the one tensor gets in one process, and the same optimizer step keeps them
equal. The global gradient norm counts the tensor once: only the copy on the lowest
holding rank enters it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.dtensor import local_piece
from paratrain.distributed.mesh import ParallelMesh
from paratrain.strategies.pipeline.layout import Tie, tie_refusal


class TiedCopies:
    """The ties of one pipeline split and the groups that keep their copies equal.

    Built on every rank at the same point (it creates process groups: a collective).

    Args:
        ties: every tie across stages of the split (``StageParts.ties``).
        mesh: the layout.
        split: the modules this rank's tensor-parallel plan splits.
        device: where the ranks agree whether a tie is split.
        rank_of: the pipeline rank that runs a stage; None: ``s % pipeline_degree``.
    """

    def __init__(self, ties: tuple[Tie, ...], mesh: ParallelMesh, *,
                 split: frozenset[str] = frozenset(),
                 device: torch.device | None = None,
                 rank_of: Callable[[int], int] | None = None) -> None:
        degrees = mesh.degrees
        if ties and degrees.tensor_degree > 1:
            # A tied tensor the plan splits on one stage (a head) is whole on the other
            # (an embedding): the copies' local pieces would not be the same slice. Each
            # rank sees only its stage's plan, so the ranks agree before refusing.
            mine = any(name.rpartition(".")[0] in split for tie in ties for name, _ in tie)
            flag = torch.tensor([int(mine)], device=device)
            if dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                raise ValueError(tie_refusal(ties[0], "which tensor parallel splits "
                                                      "differently"))
        p = degrees.pipeline_degree
        rank_of = rank_of or (lambda stage: stage % p)
        self._ties: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        for tie in ties:
            ranks = tuple(sorted({rank_of(stage) for _, stage in tie}))
            if len(ranks) > 1:  # stages on one rank (interleaved, a V) share one tensor
                self._ties.append((tuple(name for name, _ in tie), ranks))
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for ranks in sorted({ranks for _, ranks in self._ties}):
            if len(ranks) == p:
                self._groups[ranks] = mesh.group("pipeline")
                continue
            # One group per position in the other axes: the copies there hold the same
            # slice of the tensor (sharded alike, whole over the tensor axis).
            others = itertools.product(range(degrees.replicate_degree),
                                       range(degrees.shard_degree),
                                       range(degrees.tensor_degree))
            groups = [[mesh.global_rank(pipeline=r, replicate=a, shard=b, tensor=t)
                       for r in ranks] for a, b, t in others]
            mine, _ = dist.new_subgroups_by_enumeration(groups)
            self._groups[ranks] = mine if mesh.pipeline_rank in ranks else None
        self._pipeline_rank = mesh.pipeline_rank
        self._held: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        self._copies: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._ties)

    def bind(self, stage: nn.Module) -> None:
        """Find this rank's copies in ``stage`` (after any wrapping: by name)."""
        params = dict(stage.named_parameters(remove_duplicate=False))
        for names, ranks in self._ties:
            if self._pipeline_rank not in ranks:
                continue
            param = next(params[name] for name in names if name in params)
            self._held.append((param, self._groups[ranks]))
            if self._pipeline_rank != ranks[0]:
                self._copies.add(id(param))

    def sum_gradients(self) -> None:
        """Every copy's gradient becomes the sum over the copies (the one tensor's)."""
        for param, group in self._held:
            if param.grad is None:  # unused on this stage this step: contributes zero
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local_piece(param.grad), group=group)

    def counted(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without the copies the gradient norm must not count twice."""
        return [p for p in params if id(p) not in self._copies]

    def copies(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The copies among ``params`` (:meth:`counted` leaves them out)."""
        return [p for p in params if id(p) in self._copies]
