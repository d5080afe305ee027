"""int8 pseudo-gradients for ``DiLoCo(comm_dtype="int8")``, gathered rather than summed.

int8 values cannot be summed by an all-reduce without overflowing, and every rank has
its own scale. So each rank quantizes its own pseudo-gradient ``p_i = s - x_i`` (one
bucket, flat) with its own scale, ``scale_i = max|p_i| / 127`` (1 when ``p_i`` is 0):
``q_i = clamp(round(p_i / scale_i), -127, 127)``; the ranks all-gather the messages
(:func:`pack`: the float32 scale's 4 bytes, then ``q_i``) over the replicate group, and
every rank computes the same mean in the same order, :func:`mean_of`:
``sum_i q_i scale_i / R``, summed in rank order in float32 from identical bytes, so the
replicas stay bitwise equal.

The error of one element: ``p_i / scale_i`` is rounded once in float32 (at most
``127 * 2**-24 < 2**-17`` off for ``|p_i / scale_i| <= 127``), rounding to the nearest
integer adds ``1/2`` and the float32 product ``q_i scale_i`` at most ``2**-17`` more, so
``|p_i - q_i scale_i| <= scale_i (1/2 + 2**-16)``, about ``max|p_i| / 254``; the mean's
error is at most the mean of the ranks' bounds (plus the float32 rounding of the sum).

Wire bytes of a bucket of ``N`` elements over ``R`` replicas: each rank sends its
``N + 4`` bytes and receives the other ``R - 1`` ranks' (a ring all-gather sends
``(R - 1)(N + 4)``), against ``8 N (R - 1) / R`` for a float32 ring all-reduce and
``4 N (R - 1) / R`` for bfloat16: a quarter of float32 at ``R = 2``, equal to bfloat16
at ``R = 4`` and to float32 at ``R = 8``.
"""

from __future__ import annotations

import torch

__all__ = ["HEADER", "dequantize", "mean_of", "pack", "quantize", "unpack"]

HEADER = 4
"""Bytes before ``q`` in a message: the float32 scale."""

LEVELS = 127
"""The largest ``|q|`` (symmetric: -128 is never used)."""


def quantize(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 ``q`` and a 1-element float32 ``scale`` with ``q * scale``
    within ``scale (1/2 + 2**-16)`` of ``value`` (float32 arithmetic, no host sync)."""
    value = value.detach().reshape(-1).to(torch.float32)
    top = value.abs().amax() if value.numel() else value.new_zeros(())
    scale = (top / LEVELS).reshape(1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # p == 0: q == 0
    q = torch.round(value / scale).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32."""
    return q.to(torch.float32).mul_(scale)


def pack(value: torch.Tensor) -> torch.Tensor:
    """One int8 message: the scale's 4 bytes (as float32), then :func:`quantize`'s ``q``."""
    q, scale = quantize(value)
    return torch.cat([scale.view(torch.int8), q])


def unpack(message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of one :func:`pack` message."""
    return message[HEADER:], message[:HEADER].clone().view(torch.float32)


def mean_of(gathered: torch.Tensor, replicas: int) -> torch.Tensor:
    """``sum_i q_i scale_i / R`` in float32, from the ``R`` messages gathered end to end
    (rank order), summed in that order: the same bytes on every rank."""
    messages = gathered.reshape(replicas, -1)
    total = None
    for message in messages:
        part = dequantize(*unpack(message))
        total = part if total is None else total.add_(part)
    return total.div_(replicas)
