"""``ddp``: multi-process data parallel through ``DistributedDataParallel``.

Gradients are averaged with ring all-reduce in buckets that start while the
backward pass is still running, so communication overlaps computation.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.compile import CompileOptions, compile_model
from paratrain.distributed import _compat
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import Compiles

# comm_dtype -> name of the hook in torch.distributed.algorithms.ddp_comm_hooks.default_hooks
COMM_DTYPES = {"32": None, "bf16": "bf16_compress_hook", "fp16": "fp16_compress_hook"}


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """Options of the ``ddp`` strategy (see ``DistributedDataParallel``)."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size: smaller buckets start all-reduce earlier, larger ones amortise latency."""

    find_unused_parameters: bool = False
    """Set when some parameters get no gradient in a step (costs a graph traversal)."""

    gradient_as_bucket_view: bool = True
    """Gradients alias the communication buckets, saving one copy of the gradients."""

    static_graph: bool = False
    """Promise the graph is identical every step, enabling extra DDP optimisations."""

    sync_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm statistics) to all ranks at each forward."""

    comm_dtype: str = "32"
    """Dtype gradients are all-reduced in: ``32`` (as computed), ``bf16`` or ``fp16``
    (compressed by the standard DDP comm hooks: half the bytes, rounding error added)."""

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.comm_dtype not in COMM_DTYPES:
            raise ValueError(
                f"comm_dtype must be one of {tuple(COMM_DTYPES)}, got {self.comm_dtype!r}"
            )


class DDPStrategy(Strategy, Compiles):
    """Replicate the model on every process; all-reduce gradients during backward."""

    name = "ddp"
    Options = DDPOptions

    def __init__(self, topology, options=None, *, timeout_s: float = 300.0) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        self._wrapped: list[DistributedDataParallel] = []

    def configure_compile(self, options: CompileOptions) -> None:
        if self.options.bucket_cap_mb < 1:
            # Dynamo's DDP optimiser keeps DDP's first bucket at 1 MiB and refuses smaller
            # buckets after it.
            raise ValueError(f"compile with strategy 'ddp' needs bucket_cap_mb >= 1, got "
                             f"{self.options.bucket_cap_mb:g}; raise it or use compile=False")
        super().configure_compile(options)

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.topology.device)
        if self._compile is not None:
            # The wrapped module's forward runs inside DDP's forward, where Dynamo's DDP
            # optimiser splits the graph at bucket boundaries so that all-reduce still
            # overlaps backward.
            compile_model(model, self._compile)
        if not self.topology.is_distributed:
            return model
        device_ids = [self.topology.device.index] if self.topology.device.type == "cuda" else None
        ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.options.bucket_cap_mb,
            find_unused_parameters=self.options.find_unused_parameters,
            gradient_as_bucket_view=self.options.gradient_as_bucket_view,
            static_graph=self.options.static_graph,
            **_compat.ddp_buffer_sync_kwargs(self.options.sync_buffers),
        )
        hook = COMM_DTYPES[self.options.comm_dtype]
        if hook is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # state=None: the hook all-reduces over the default (world) group.
            ddp.register_comm_hook(state=None, hook=getattr(default_hooks, hook))
        if not (self.options.find_unused_parameters or self.options.static_graph):
            ddp.forward = _naming_unused(ddp, ddp.forward)  # type: ignore[method-assign]
        self._wrapped.append(ddp)
        return ddp

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def teardown(self) -> None:
        # Drop the reducers before the process group goes (see process_group.destroy_process_group).
        for ddp in self._wrapped:
            _compat.release_ddp_reducer(ddp)
        self._wrapped.clear()


# DDP's error when a parameter got no gradient in the previous step; it names the
# parameters by index (or by name under TORCH_DISTRIBUTED_DEBUG=INFO/DETAIL), in 30 lines.
_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+: ([^\n]+)")


def _naming_unused(ddp: DistributedDataParallel,
                   forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` with DDP's unused-parameter error turned into one line naming them."""

    @functools.wraps(forward)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as exc:
            if _UNFINISHED not in str(exc):
                raise
            raise RuntimeError(unused_parameters_line(ddp, str(exc))) from None

    return checked


def reducer_parameter_names(ddp: DistributedDataParallel) -> list[str]:
    """Names of the parameters DDP reduces, in its order (the indices of its messages):
    per module, its own parameters that require grad, not ignored, each once."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    names, seen = [], set()
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if (not param.requires_grad or f"{module_name}.{name}" in ignored
                    or id(param) in seen):
                continue
            seen.add(id(param))
            names.append(f"{module_name}.{name}" if module_name else name)
    return names


def unused_parameters_line(ddp: DistributedDataParallel, message: str) -> str:
    """One line naming the parameters DDP says received no gradient, and the fixes."""
    found = _NAMES.search(message)
    names = [n.strip() for n in found.group(1).split(",")] if found else []
    indices = _INDICES.search(message)
    if not names and indices:
        order = reducer_parameter_names(ddp)
        names = [order[int(i)] if int(i) < len(order) else f"#{i}"
                 for i in indices.group(1).split()]
    # Short enough for the launcher's last line (it keeps 300 characters).
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"strategy 'ddp': parameters that received no gradient: "
            f"{shown or 'unknown (DDP did not say)'}; pass strategy_options="
            "{'find_unused_parameters': True}, use them in the loss, or freeze them "
            "(requires_grad_(False)) before run.prepare()")
