"""Tensor digests for ``paratrain verify --replay``, and the two checks made with them.

A digest stands for a tensor's exact bits: two tensors with equal digests are, for the
purpose of the check, bitwise equal. Each rank records, per optimizer step, digests of
its losses, its gradients (its local piece where sharded), its buffers and its
parameters. Two checks compare them:

* **replay**: the same rank's digests in the first run and in the replay, step by step;
  the first that differs is named (step, then loss -> gradient -> buffer -> parameter,
  then rank: a cause is named before its effects).
* **replicas**: digests of the tensors the layout replicates (a data-parallel peer's
  gradients after reduction, its parameters; a DTensor's pieces with the same shard
  coordinates) must be equal on every rank that holds a copy; a majority vote names the
  odd rank out.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from paratrain.distributed._compat import hash_tensor
from paratrain.distributed.dtensor import local_piece

CATEGORIES = ("loss", "gradient", "buffer", "parameter")
"""What a rank records per step, in the order the checks compare it."""

_CHUNK = 1 << 22
"""Elements hashed at once: bounds the int64 copy a digest makes of a large tensor."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# splitmix64's constants as int64 (int64 products wrap, as uint64 ones would).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX = 0xBF58476D1CE4E5B9 - 2**64
_LOW_33 = (1 << 33) - 1

ReplicaKey = tuple[tuple[int, int], ...]
"""Shard coordinates ``(mesh dim, index)`` of a DTensor piece; ``()`` for a whole copy."""


@dataclass(frozen=True)
class TensorDigest:
    """One tensor of one rank at one step, as a digest."""

    category: str
    """One of :data:`CATEGORIES`."""
    name: str
    """The parameter or buffer name, or ``micro-batch i`` for a loss."""
    digest: str
    """``dtype[shape]:hex`` of the exact bits; ``none`` for a missing gradient."""
    replicas: ReplicaKey | None = None
    """Ranks whose digest of this category and name has the same key hold copies that
    must be bitwise equal; None: this rank's alone (not compared across ranks)."""

    @property
    def label(self) -> str:
        return f"{self.category} {self.name}"


RankDigests = dict[int, list[TensorDigest]]
"""One rank's run: optimizer step -> that step's digests, in :data:`CATEGORIES` order."""


def digest(tensor: torch.Tensor | None) -> str:
    """``dtype[shape]:hex`` of a tensor's exact bits (a DTensor's local piece).

    With ``torch.hash_tensor`` the hash is computed where the tensor lives (no copy to
    the host); each element's bit pattern is mixed with its position first (splitmix64
    steps), because hash_tensor's xor alone lets equal elements cancel (``zeros(2)`` and
    ``ones(2)`` hash alike) and is blind to a permutation. Elsewhere (no hash_tensor,
    float8, complex): sha256 of the bytes."""
    if tensor is None:
        return "none"
    local = local_piece(tensor).detach()
    head = f"{str(local.dtype).removeprefix('torch.')}[{','.join(map(str, local.shape))}]"
    flat = local.reshape(-1)
    value = _position_xor(flat)
    if value is None:
        data = flat.cpu().contiguous().view(torch.uint8).numpy()
        return f"{head}:{hashlib.sha256(data.tobytes()).hexdigest()[:16]}"
    return f"{head}:{value:016x}"


def _position_xor(flat: torch.Tensor) -> int | None:
    if flat.numel() == 0 or flat.element_size() not in _INT_OF_SIZE:
        return None if flat.numel() else 0
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    total = 0
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start:start + _CHUNK].to(torch.int64)
        # Each step is a bijection of the element's bits for a fixed position, so a
        # change to one element always changes the xor; the position term makes equal
        # elements at two places differ (a plain xor lets them cancel).
        part = part + torch.arange(start, start + part.numel(), device=part.device) * _GOLDEN
        part = part ^ ((part >> 31) & _LOW_33)  # a logical shift, from an arithmetic one
        value = hash_tensor(part * _MIX)
        if value is None:
            return None
        total ^= value
    return total


def replica_key(tensor: torch.Tensor | None, *, plain_replicated: bool) -> ReplicaKey | None:
    """Which copy of a tensor this rank holds, for the cross-rank check.

    A DTensor's piece is identified by its coordinates on the mesh dimensions it is
    sharded on (pieces along replicated dimensions are copies); a Partial one holds an
    unreduced part and has no copies. A plain tensor is a whole copy where the strategy
    replicates the model (``plain_replicated``), else unknown (None).
    """
    if tensor is None:
        return None
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return () if plain_replicated else None
    if any(p.is_partial() for p in placements):
        return None
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the tensor's mesh
        return None
    return tuple((dim, index) for dim, (index, placement)
                 in enumerate(zip(coordinate, placements)) if placement.is_shard())


def tensor_digests(category: str, named: Iterable[tuple[str, torch.Tensor | None]], *,
                   plain_replicated: bool, local_only: Iterable[str] = ()) -> list[TensorDigest]:
    """Digests of ``(name, tensor)`` pairs; names in ``local_only`` are never replicated
    (e.g. BatchNorm statistics, which each rank updates from its own batch)."""
    alone = set(local_only)
    return [TensorDigest(category, f"'{name}'", digest(tensor),
                         None if name in alone else
                         replica_key(tensor, plain_replicated=plain_replicated))
            for name, tensor in named]


@dataclass(frozen=True)
class Mismatch:
    """The first digest that differs: where, on which rank(s), and how."""

    step: int
    label: str
    ranks: tuple[int, ...]
    """The rank (replay) or the odd ranks out (replicas; all of them without a majority)."""
    detail: str

    def format(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        where = f"rank {ranks}" if len(self.ranks) == 1 else f"ranks {ranks}"
        return f"differs at step {self.step}: {self.label} on {where} ({self.detail})"


@dataclass(frozen=True)
class CheckResult:
    """One check over every rank: how many digests it compared, and the first mismatch."""

    compared: int
    mismatch: Mismatch | None = None

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def _short(text: str) -> str:
    head, _, value = text.rpartition(":")
    return f"{head}:{value[:8]}" if head else text


def compare_replay(first: Sequence[RankDigests], replay: Sequence[RankDigests]) -> CheckResult:
    """Each rank's replay against its first run: every digest must be equal."""
    compared = 0
    steps = sorted({s for run in (*first, *replay) for s in run})
    for step in steps:
        for category in CATEGORIES:
            for rank, (mine, again) in enumerate(zip(first, replay)):
                want = {d.name: d.digest for d in mine.get(step, []) if d.category == category}
                have = {d.name: d.digest for d in again.get(step, []) if d.category == category}
                for name in [*want, *(n for n in have if n not in want)]:
                    compared += 1
                    a, b = want.get(name, "missing"), have.get(name, "missing")
                    if a != b:
                        return CheckResult(compared, Mismatch(
                            step, f"{category} {name}", (rank,),
                            f"first run {_short(a)}, replay {_short(b)}"))
    return CheckResult(compared)


def compare_replicas(ranks: Sequence[RankDigests]) -> CheckResult:
    """Copies of one tensor on several ranks must have one digest; ``compared`` counts the
    replicated tensors (groups of two or more copies) over all steps."""
    compared = 0
    for step in sorted({s for run in ranks for s in run}):
        groups: dict[tuple[str, str, ReplicaKey], dict[int, str]] = defaultdict(dict)
        for rank, run in enumerate(ranks):
            for d in run.get(step, []):
                if d.replicas is not None:
                    groups[(d.category, d.name, d.replicas)][rank] = d.digest
        ordered = sorted(groups.items(), key=lambda item: CATEGORIES.index(item[0][0]))
        for (category, name, _), by_rank in ordered:
            if len(by_rank) < 2:
                continue
            compared += 1
            found = _odd_ones_out(by_rank)
            if found is not None:
                return CheckResult(compared, Mismatch(step, f"{category} {name}", *found))
    return CheckResult(compared)


def _odd_ones_out(by_rank: dict[int, str]) -> tuple[tuple[int, ...], str] | None:
    """None when all agree; else the ranks outside a strict majority and how they differ
    (every rank, when no digest has a majority: two ranks cannot outvote each other)."""
    counts = Counter(by_rank.values())
    if len(counts) == 1:
        return None
    common, votes = counts.most_common(1)[0]
    if votes * 2 > len(by_rank):
        odd = tuple(r for r, d in sorted(by_rank.items()) if d != common)
        agree = ", ".join(str(r) for r, d in sorted(by_rank.items()) if d == common)
        return odd, f"ranks {agree} agree on {_short(common)}, " + ", ".join(
            f"rank {r} has {_short(by_rank[r])}" for r in odd)
    return tuple(sorted(by_rank)), "no majority: " + ", ".join(
        f"rank {r} has {_short(d)}" for r, d in sorted(by_rank.items()))
