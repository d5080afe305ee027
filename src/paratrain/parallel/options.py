"""Typed options of each parallelism, one small dataclass each.

They travel inside :class:`~paratrain.parallel.Parallel` (``tensor=``, ``sharding=``,
``pipeline=``) and are validated by the options of the code that runs them, so a bad
value gets the same one-line ``ValueError`` naming the field as ``strategy_options``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be True or False, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """Options of tensor parallelism (the ``tp`` degree).

    Example:
        >>> TensorParallel(sequence_parallel=True).as_options()
        {'sequence_parallel': True}
    """

    plan: dict[str, str] | None = None
    """``{glob over module names: "colwise" | "rowwise"}``; None: the automatic plan."""

    sequence_parallel: bool = False
    """Shard the residual stream and the norms over the sequence between split layers."""

    loss_parallel: bool = False
    """Split the output layer over the vocabulary; its logits stay sharded."""

    output_layer: str | None = None
    """The output linear loss parallel splits; None: ``head``, ``lm_head`` or ``output``."""

    def __post_init__(self) -> None:
        _check_bool("TensorParallel", "sequence_parallel", self.sequence_parallel)
        _check_bool("TensorParallel", "loss_parallel", self.loss_parallel)
        from paratrain.strategies.tensor.strategy import TPOptions

        TPOptions(**self.as_options())  # the runtime's own checks, once, here

    def as_options(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as the runtime's option names."""
        return _changed(self)


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Options of sharded data parallelism (the ``dp_shard`` degree, FSDP2).

    Example:
        >>> Sharding(reshard_after_forward=False).as_options()
        {'reshard_after_forward': False}
    """

    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (ZeRO-3); False keeps them for
    backward (ZeRO-2: more memory, one all-gather fewer per step)."""

    offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""

    wrap_policy: Any = None
    """Which submodules are their own unit: a class, a class name, a tuple of them or a
    predicate; None: the model's repeated blocks."""

    def __post_init__(self) -> None:
        _check_bool("Sharding", "reshard_after_forward", self.reshard_after_forward)
        _check_bool("Sharding", "offload", self.offload)
        from paratrain.strategies.fsdp import FSDPOptions

        FSDPOptions(**self.as_options())

    def as_options(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as the runtime's option names."""
        return _changed(self)


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Options of pipeline parallelism (the ``pp`` degree).

    Example:
        >>> Pipeline(schedule="gpipe", microbatches=8).as_options()
        {'schedule': 'gpipe', 'num_microbatches': 8}
    """

    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved_1f1b``."""

    microbatches: int = 4
    """Micro-batches per step."""

    stages_per_rank: int | None = None
    """Stages each rank runs (``interleaved_1f1b``: 2 or more)."""

    split_points: tuple[int, ...] | None = None
    """Where stages 1.. begin (child or block indices); None balances the stages."""

    def __post_init__(self) -> None:
        from paratrain.strategies.pipeline.strategy import PipelineOptions

        PipelineOptions(**self.as_options())

    def as_options(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as the runtime's option names."""
        changed = _changed(self)
        if "microbatches" in changed:
            changed["num_microbatches"] = changed.pop("microbatches")
        return changed


def _changed(options: Any) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in fields(options)
            if getattr(options, f.name) != f.default}
