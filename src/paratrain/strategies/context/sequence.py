"""How a sequence is cut across the context-parallel ranks, and how it is put back.

With causal attention the last positions attend to the most keys, so a plain cut (rank
``r`` holds chunk ``r``) gives the last rank ``2 cp - 1`` times the work of the first.
The load-balanced order cuts the sequence into ``2 cp`` chunks and gives rank ``r`` the
chunks ``r`` and ``2 cp - 1 - r`` (head and tail): every rank then attends over the same
number of (query, key) pairs. A length that ``2 cp`` does not divide is refused in one
line: balancing is never turned off silently.

Every sequence-shaped tensor of a batch (token ids, targets, position ids, a loss mask)
is cut the same way, so a rank's targets stay beside its inputs and positions follow the
slices (rotary and learned position embeddings see the true positions).

Example:
    >>> order = SequenceOrder(cp=2, length=8)
    >>> order.positions(0).tolist(), order.positions(1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceOrder:
    """The cut of one sequence length over ``cp`` ranks.

    Args:
        cp: context-parallel degree.
        length: the whole sequence length.
        load_balanced: head-tail chunks (the default; for causal attention) or one
            contiguous chunk per rank (bidirectional attention does not need balancing).
    """

    cp: int
    length: int
    load_balanced: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"SequenceOrder.cp must be an integer >= 1, got {self.cp!r}")
        pieces = self.chunks
        if self.length % pieces:
            kind = "2 x cp" if self.load_balanced else "cp"
            raise ValueError(
                f"context parallel cp={self.cp} needs a sequence length divisible by {kind} = "
                f"{pieces}, got {self.length}; pad or cut sequences to a multiple of {pieces}")

    @property
    def chunks(self) -> int:
        """Chunks the sequence is cut into (``2 cp`` balanced, ``cp`` plain)."""
        return 2 * self.cp if self.load_balanced else self.cp

    def chunk_ranges(self, rank: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of the positions ``rank`` holds, in its local order."""
        size = self.length // self.chunks
        if not self.load_balanced:
            return [(rank * size, (rank + 1) * size)]
        head, tail = rank, self.chunks - 1 - rank
        return [(head * size, (head + 1) * size), (tail * size, (tail + 1) * size)]

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of ``rank``'s local sequence, in its local order."""
        return torch.cat([torch.arange(start, stop, device=device)
                          for start, stop in self.chunk_ranges(rank)])

    def slice(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s part of ``tensor`` along ``dim`` (the sequence dimension)."""
        if tensor.shape[dim] != self.length:
            raise ValueError(f"context parallel: a sequence-shaped tensor has length "
                             f"{tensor.shape[dim]} along dim {dim}, expected {self.length}")
        return torch.cat([tensor.narrow(dim, start, stop - start)
                          for start, stop in self.chunk_ranges(rank)], dim=dim)

    def natural_order(self) -> torch.Tensor:
        """Index that puts the ranks' local sequences, concatenated rank by rank, back in
        position order: ``whole = gathered.index_select(dim, natural_order())``."""
        gathered = torch.cat([self.positions(rank) for rank in range(self.cp)])
        return torch.argsort(gathered)
