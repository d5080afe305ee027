"""Per-device memory of each strategy: model state (sharded or not) plus activations.

Parameters ``P``, gradients ``G`` and optimizer state ``O`` are divided by how many
devices share them, as each strategy's cost model (:mod:`paratrain.plan.costs`) says;
activations are ``b`` samples of what the profile keeps for backward (less with
activation checkpointing). Formulas in ``docs/plan.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.types import ModelProfile


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one device holds during a step."""

    param_memory: float
    grad_memory: float
    optimizer_memory: float
    activation_memory: float

    @property
    def total(self) -> float:
        """Everything above, summed."""
        return self.param_memory + self.grad_memory + self.optimizer_memory + self.activation_memory


def state_divisors(sharding: tuple[str, str, str], num_devices: int) -> tuple[int, int, int]:
    """Divisors of (parameters, gradients, optimizer state) for a cost model's ``sharding``
    ("N": the devices share it, "1": a full copy each, "0": none); 0 means none held."""
    if len(sharding) != 3 or any(s not in ("1", "N", "0") for s in sharding):
        raise ValueError(f"sharding must be three of '1', 'N', '0', got {sharding!r}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    return tuple({"1": 1, "N": num_devices, "0": 0}[s] for s in sharding)  # type: ignore[return-value]


def memory_per_device(sharding: tuple[str, str, str], profile: ModelProfile, *, num_devices: int,
                      batch_size_per_device: int, tensor_held: float = 1.0) -> MemoryEstimate:
    """Memory of one device holding ``sharding`` of the state over ``num_devices``, with
    ``b`` samples of activations. ``tensor_held`` scales the "N" parts first (a tensor
    rank's share of the split and replicated layers).

    Example: 1M fp32 parameters with Adam sharded ``("N", "N", "N")`` (as ``fsdp``) over 4
    devices hold (4 MB + 4 MB + 8 MB) / 4 = 4 MB of state, plus activations.
    """
    sizes = (profile.param_size, profile.grad_size, profile.optimizer_size)
    divisors = state_divisors(sharding, num_devices)
    sizes = tuple(size * tensor_held if part == "N" else size
                  for size, part in zip(sizes, sharding, strict=True))
    pm, gm, om = (0.0 if d == 0 else size / d for size, d in zip(sizes, divisors, strict=True))
    am = batch_size_per_device * profile.stored_activation_bytes_per_sample
    return MemoryEstimate(param_memory=pm, grad_memory=gm, optimizer_memory=om,
                          activation_memory=am)
