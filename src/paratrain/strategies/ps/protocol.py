"""The parameter server's wire format: flat layout, message kinds, tensor-only messages.

Every message is a tensor sent point-to-point through ``torch.distributed``;
nothing is pickled. A worker opens each exchange with a fixed-size int64
header ``[kind, arg, lr_0, ..., lr_{G-1}]`` (``lr_g`` is the float64 learning
rate of the user's param group ``g``, bit-cast to int64) on tag ``HEADER``;
servers receive headers from whichever worker is ready (``src=None``) and then
the payload, if the kind has one, from that worker on tag ``PAYLOAD``.
See docs/parameter-server.md for the full exchange of each kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Message kinds (header[0]).
PUSH, PULL, PARK, DONE, LOAD, STATS = 1, 2, 3, 4, 5, 6
KIND_NAMES = {PUSH: "push", PULL: "pull", PARK: "park", DONE: "done", LOAD: "load",
              STATS: "stats"}
# Tags keep the streams apart: a header can never be matched by a payload.
HEADER, PAYLOAD, PARAMS, STATE, STATS_TAG, FRESH = 1, 2, 3, 4, 5, 6
# Bits of a park header's ``arg``.
PARK_WANTS_STATE = 1
PARK_IF_CHANGED = 2
"""Reply to the park with a one-element flag on tag ``FRESH`` and send the parameters
only if they changed since the worker last received them (1 = they follow)."""
STALENESS_BINS = 32
"""Histogram bins: staleness 0 .. 30 exactly, the last bin counts 31 and more."""

# dtype codes of the tensor-dict messages (optimizer state).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.bool]
_MAX_DIMS = 4


@dataclass(frozen=True)
class Piece:
    """The part of user parameter ``param`` that lies in one server's shard."""

    param: int
    group: int
    start: int
    """First element, as an index into the parameter's flattened elements."""
    stop: int
    local: int
    """Offset of the piece in the server's shard."""


@dataclass(frozen=True)
class FlatLayout:
    """The optimizer's parameters flattened in param-group order, split into server shards.

    Shards are balanced contiguous ranges (sizes differ by at most one element);
    all parameters share one dtype, so element ranges are byte ranges.
    """

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    groups: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, num_servers: int) -> FlatLayout:
        params = [(g, p) for g, group in enumerate(optimizer.param_groups)
                  for p in group["params"]]
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            raise ValueError(f"strategy 'ps' needs parameters of one dtype, got "
                             f"{sorted(map(str, dtypes))}; cast the model to one dtype first")
        offsets, total = [], 0
        for _, p in params:
            offsets.append(total)
            total += p.numel()
        if total < num_servers:
            raise ValueError(f"num_servers={num_servers} exceeds the {total} parameter elements")
        return cls(shapes=tuple(p.shape for _, p in params), offsets=tuple(offsets),
                   groups=tuple(g for g, _ in params), numel=total, dtype=dtypes.pop(),
                   ranges=shard_ranges(total, num_servers))

    def pieces(self, server: int) -> list[Piece]:
        lo, hi = self.ranges[server]
        out = []
        for index, (offset, shape) in enumerate(zip(self.offsets, self.shapes)):
            start, stop = max(lo, offset), min(hi, offset + shape.numel())
            if start < stop:
                out.append(Piece(param=index, group=self.groups[index], start=start - offset,
                                 stop=stop - offset, local=start - lo))
        return out


def shard_ranges(numel: int, num_shards: int) -> tuple[tuple[int, int], ...]:
    """Balanced contiguous ``[lo, hi)`` ranges covering ``numel`` elements."""
    base, extra = divmod(numel, num_shards)
    ranges, lo = [], 0
    for shard in range(num_shards):
        hi = lo + base + (1 if shard < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return tuple(ranges)


def make_header(kind: int, arg: int, lrs: list[float]) -> torch.Tensor:
    lr_bits = torch.tensor(lrs, dtype=torch.float64).view(torch.int64)
    return torch.cat([torch.tensor([kind, arg], dtype=torch.int64), lr_bits])


def parse_header(header: torch.Tensor) -> tuple[int, int, list[float]]:
    return int(header[0]), int(header[1]), header[2:].clone().view(torch.float64).tolist()


class Outbox:
    """Non-blocking sends whose buffers stay alive until they are waited for.

    Gloo's send ``Work`` reports completion only once it has been waited for, so the
    buffers are released by :meth:`settle` (one destination) or :meth:`wait` (all).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._pending: list[tuple[int, dist.Work, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self._pending.append((dst, dist.isend(tensor, dst, group=self.group, tag=tag), tensor))

    def settle(self, dst: int) -> None:
        """Wait for every send to ``dst`` and release its buffer.

        Call it only when ``dst`` has received them (e.g. it sent a new request after
        reading every reply to the previous one); then it returns at once.
        """
        keep = []
        for peer, work, tensor in self._pending:
            if peer == dst:
                work.wait()
            else:
                keep.append((peer, work, tensor))
        self._pending = keep

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int, tag: int) -> None:
        """Send ``{name: tensor}`` as tensors: a count, then per entry meta, name bytes, data."""
        self.send(torch.tensor([len(tensors)], dtype=torch.int64), dst, tag)
        for name, value in tensors.items():
            if value.dim() > _MAX_DIMS or value.dtype not in _DTYPES:
                raise ValueError(f"optimizer state {name!r} ({value.dtype}, {value.dim()}-d) "
                                 "cannot be sent to/from a parameter server")
            encoded = torch.tensor(list(name.encode()), dtype=torch.uint8)
            shape = list(value.shape) + [0] * (_MAX_DIMS - value.dim())
            meta = [encoded.numel(), _DTYPES.index(value.dtype), value.dim(), *shape]
            self.send(torch.tensor(meta, dtype=torch.int64), dst, tag)
            self.send(encoded, dst, tag)
            if value.numel():
                self.send(value.detach().cpu().clone(), dst, tag)

    def wait(self) -> None:
        for _, work, _ in self._pending:
            work.wait()
        self._pending.clear()


def recv_tensor_dict(src: int, tag: int, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Receive what :meth:`Outbox.send_tensor_dict` sent from ``src``."""
    count = torch.empty(1, dtype=torch.int64)
    dist.recv(count, src, group=group, tag=tag)
    out = {}
    for _ in range(int(count)):
        meta = torch.empty(3 + _MAX_DIMS, dtype=torch.int64)
        dist.recv(meta, src, group=group, tag=tag)
        name_len, dtype_code, ndim, *shape = meta.tolist()
        name = torch.empty(name_len, dtype=torch.uint8)
        dist.recv(name, src, group=group, tag=tag)
        value = torch.zeros(shape[:ndim], dtype=_DTYPES[dtype_code])
        if value.numel():
            dist.recv(value, src, group=group, tag=tag)
        out[bytes(name.tolist()).decode()] = value
    return out
