"""``fsdp``: fully sharded data parallel through PyTorch's FSDP2 (``fully_shard``).

Each rank keeps 1/N of every parameter, gradient and optimizer state. Before a
wrapped block runs forward (and again in backward) its parameters are
all-gathered; after backward its gradients are reduce-scattered, so each rank
updates only its shard. Blocks are wrapped one by one (the wrap policy) so that
only one block is ever unsharded at a time, then the root is wrapped.

With a 2-D mesh (``replicate x shard``, see :mod:`paratrain.distributed.mesh`) the same
code is HSDP: sharded within a node, replicated across nodes (used by the
``hybrid`` strategy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from paratrain.checkpoint.meta_init import materialise, on_meta
from paratrain.checkpoint.sharded import parameter_names
from paratrain.compile import compile_forward
from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh
from paratrain.distributed.topology import Topology
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import (
    Compiles,
    LockstepEvaluation,
    PrecisionPolicy,
    ShardedState,
    ShardsOnMeta,
)
from paratrain.strategies.dtensor_params import (
    DTensorParameters,
    mixed_precision_policy,
    shard_units,
)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """Options of the ``fsdp`` strategy."""

    wrap_policy: Any = None
    """Which submodules become their own FSDP unit (all-gathered separately):
    None = for a Hugging Face model, each block named by its ``_no_split_modules`` and
    the input embedding and output layer; for other models every direct child of the
    model that has parameters (the children of a ``ModuleList``/``ModuleDict`` child,
    e.g. transformer blocks, individually);
    a module class, a class name or a tuple of them; or a predicate
    ``fn(module) -> bool``. The root is always wrapped last."""

    reshard_after_forward: bool = True
    """Free the gathered parameters after each block's forward and gather them again
    in backward (less memory, one more all-gather per block); False keeps them
    until backward (what the ``zero2`` strategy fixes)."""

    offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory
    (FSDP2's ``CPUOffloadPolicy``): parameters are copied to the device for each
    unit's forward and backward, and the optimizer steps on the CPU."""

    def __post_init__(self) -> None:
        policy = self.wrap_policy
        many = isinstance(policy, (tuple, list))
        if not (policy is None or _is_class_spec(policy) or (callable(policy) and not many)
                or (many and policy and all(_is_class_spec(p) for p in policy))):
            raise ValueError(
                "wrap_policy must be None, a module class, a class name, a tuple of "
                f"them or a predicate fn(module) -> bool, got {policy!r}"
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}"
            )
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload must be True or False, got {self.offload!r}")


def _is_class_spec(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, type) and issubclass(value, nn.Module))


def wrap_predicate(policy: Any, root: nn.Module) -> Callable[[nn.Module], bool]:
    """The wrap policy as a predicate over submodules (the root is handled separately)."""
    if policy is None and _no_split_classes(root):
        return _per_block(root)
    if policy is None:
        blocks = set()
        for child in root.children():
            members = child.children() if isinstance(child, _CONTAINERS) else [child]
            blocks.update(id(m) for m in members if any(True for _ in m.parameters()))
        return lambda module: id(module) in blocks
    if isinstance(policy, (str, type)):
        policy = (policy,)
    if isinstance(policy, (tuple, list)):
        classes = tuple(p for p in policy if isinstance(p, type))
        names = {p for p in policy if isinstance(p, str)}
        return lambda module: isinstance(module, classes) or type(module).__name__ in names
    return policy


def _no_split_classes(root: nn.Module) -> frozenset[str]:
    # A Hugging Face model names the classes that must stay whole on one device: its
    # blocks (LlamaDecoderLayer, GPTNeoXLayer, ...).
    names = getattr(type(root), "_no_split_modules", None)
    if not isinstance(names, (list, tuple, set)):
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str))


def _per_block(root: nn.Module) -> Callable[[nn.Module], bool]:
    """Units for a Hugging Face model: each block its own (the classes of its
    ``_no_split_modules``), and the input embedding and output layer each their own, so
    the forward gathers one block at a time, never the base model whole. Tied ones stay
    with the unit around them (``shard_units`` checks)."""
    classes = _no_split_classes(root)
    units = {id(m) for m in root.modules() if m is not root and type(m).__name__ in classes}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            layer = getattr(root, getter)() if hasattr(root, getter) else None
        except (AttributeError, NotImplementedError):
            layer = None
        if isinstance(layer, nn.Module) and any(True for _ in layer.parameters()):
            units.add(id(layer))
    return lambda module: id(module) in units


class FSDPStrategy(DTensorParameters, Strategy, ShardedState, LockstepEvaluation,
                   PrecisionPolicy, Compiles, ShardsOnMeta):
    """Shard parameters, gradients and optimizer state over the data-parallel ranks.

    Args:
        topology: this process's place in the job.
        options: :class:`FSDPOptions`.
        degrees: the layout; by default every rank is one shard (``shard_degree``
            = world size). ``replicate_degree > 1`` gives HSDP.
    """

    name = "fsdp"
    Options = FSDPOptions

    def __init__(self, topology: Topology, options: Any = None, *, timeout_s: float = 300.0,
                 degrees: ParallelDegrees | None = None) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        degrees = degrees or ParallelDegrees(shard_degree=topology.world_size)
        if degrees.pipeline_degree != 1:
            raise ValueError(f"pipeline_degree must be 1 for FSDP, got {degrees.pipeline_degree}")
        self.mesh = ParallelMesh(degrees, topology)
        self.active = topology.is_distributed
        self._mp_policy = None
        self._names: dict[int, str] = {}
        self._params: dict[str, nn.Parameter] = {}

    def notice(self) -> str | None:
        if self.active:
            return super().notice()
        return f"strategy {self.name!r} in one process: nothing to shard, running as 'single'"

    def configure_precision(self, precision: Any) -> None:
        self._mp_policy = mixed_precision_policy(precision,
                                                 refuse_fp16="with sharded gradients")

    def cuda_graphs_blocker(self) -> str | None:
        return "FSDP's all-gathers and frees run between the graphs" if self.active else None

    def _fsdp_mesh(self):
        if self.mesh.degrees.replicate_degree > 1:
            return self.mesh.submesh("replicate", "shard")
        return self.mesh.submesh("shard")

    def _offload_policy(self):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if not self.options.offload:
            return OffloadPolicy()
        # Pinned host memory makes the copies to the GPU asynchronous; it needs CUDA.
        return CPUOffloadPolicy(pin_memory=self.topology.device.type == "cuda")

    def setup_model(self, model: nn.Module) -> nn.Module:
        # With offload, fully_shard moves each unit to the device only to shard it and
        # puts the shard back on the CPU: the whole model never sits on the device.
        # A model on the meta device is sharded there; only the shards get memory.
        meta = on_meta(model)
        if not (self.active and self.options.offload) and not meta:
            model = model.to(self.topology.device)
        names = parameter_names(model)
        if self.active:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            compile_options = self._compile
            shard_units(
                model, wrap_predicate(self.options.wrap_policy, model),
                # Per block, before sharding (as torchtitan does): the block's graph stays
                # whole, FSDP's hooks run around it.
                before_shard=None if compile_options is None
                else lambda unit: compile_forward(unit, compile_options),
                mesh=self._fsdp_mesh(), reshard_after_forward=self.options.reshard_after_forward,
                mp_policy=self._mp_policy or MixedPrecisionPolicy(),
                offload_policy=self._offload_policy())
        elif self._compile is not None:
            compile_forward(model, self._compile)
        if meta:
            materialise(model, "cpu" if self.active and self.options.offload
                        else self.topology.device)
        self._remember(model, names)
        return model

