"""Horovod's ``DistributedOptimizer``: gradients all-reduced as backward produces them."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from paratrain.horovod._api import Average, NoneCompressor, Sum, _topology, size


# -- the distributed optimizer ---------------------------------------------------------
class _DistributedOptimizerMixin:
    """What :func:`DistributedOptimizer` adds to the user's optimizer class.

    Each parameter's gradient is all-reduced as soon as its last backward pass of the
    step has produced it (a post-accumulate-grad hook), so communication overlaps the
    rest of the backward pass. Reductions are started in one fixed order (reverse
    parameter order, which is roughly the order backward produces them) on every rank:
    torch.distributed matches collectives by order, not by name as Horovod does.
    """

    def _hvd_setup(self, named_parameters: Iterable[tuple[str, Any]] | None, compression: Any,
                   backward_passes_per_step: int, op: str,
                   gradient_predivide_factor: float) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            pairs = list(named_parameters)
            if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
                raise ValueError("named_parameters must be (name, parameter) pairs, usually "
                                 "model.named_parameters()")
            names = [name for name, _ in pairs]
            duplicates = sorted({name for name in names if names.count(name) > 1})
            if duplicates:
                raise ValueError(f"named_parameters has duplicate names: {duplicates}")
            named = {id(p) for _, p in pairs}
            if any(id(p) not in named for p in params):
                raise ValueError("named_parameters was given but does not name every parameter "
                                 "of the optimizer; pass model.named_parameters() of the whole model")
        self._hvd_compression = compression
        self._hvd_op = op
        self._hvd_predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_order = [p for p in reversed(params) if p.requires_grad]
        self._hvd_hooks = []
        self._hvd_should_synchronize = True
        self._hvd_synchronized = False
        self._hvd_reset()
        if size() > 1:
            self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_on_grad)
                               for p in self._hvd_order]

    def _hvd_reset(self) -> None:
        self._hvd_passes = {id(p): 0 for p in self._hvd_order}
        self._hvd_ready: set[int] = set()
        self._hvd_next = 0
        self._hvd_pending: list[tuple[torch.Tensor, Any, torch.Tensor, Any]] = []

    def _hvd_on_grad(self, param: torch.Tensor) -> None:
        passes = self._hvd_passes[id(param)] + 1
        if passes > self.backward_passes_per_step:
            raise AssertionError(
                f"gradients were computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before step(); raise "
                "backward_passes_per_step to accumulate gradients locally")
        self._hvd_passes[id(param)] = passes
        if passes == self.backward_passes_per_step:
            self._hvd_ready.add(id(param))
            self._hvd_launch(only_ready=True)

    def _hvd_launch(self, *, only_ready: bool) -> None:
        while self._hvd_next < len(self._hvd_order):
            param = self._hvd_order[self._hvd_next]
            if only_ready and id(param) not in self._hvd_ready:
                return  # keep the fixed order: wait for this one before starting later ones
            if param.grad is None:
                # This rank produced no gradient, another may have: reduce zeros.
                param.grad = torch.zeros_like(param)
            sent, ctx = self._hvd_compression.compress(param.grad)
            sent = sent.contiguous()
            if self._hvd_op == Average and self._hvd_predivide != 1.0:
                sent.div_(self._hvd_predivide)
            work = dist.all_reduce(sent, op=dist.ReduceOp.SUM, async_op=True)
            self._hvd_pending.append((param, ctx, sent, work))
            self._hvd_next += 1

    def synchronize(self) -> None:
        """Wait for every gradient reduction and write the results into ``.grad``."""
        if size() > 1:
            self._hvd_launch(only_ready=False)
            scale = self._hvd_predivide / size() if self._hvd_op == Average else 1.0
            for param, ctx, sent, work in self._hvd_pending:
                work.wait()
                result = self._hvd_compression.decompress(sent, ctx)
                if result is not param.grad:
                    param.grad.copy_(result)
                if scale != 1.0:
                    param.grad.mul_(scale)
            self._hvd_reset()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` skip the synchronisation already done by :meth:`synchronize`.

        Example (clipping the averaged gradients):
            >>> optimizer.synchronize()                                   # doctest: +SKIP
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # doctest: +SKIP
            >>> with optimizer.skip_synchronize():                        # doctest: +SKIP
            ...     optimizer.step()
        """
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        self._hvd_reset()

    def step(self, closure: Any = None) -> Any:
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): the gradients are reduced twice",
                              stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_pending or any(self._hvd_passes.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        self._hvd_reset()
        self._hvd_synchronized = False
        super().load_state_dict(state_dict)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, Any]] | None = None,
                         compression: Any = NoneCompressor, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all processes.

    The result is still an instance of the optimizer's class and shares its state and
    parameter groups. With ``backward_passes_per_step=N`` the gradients of N backward
    passes are summed locally and reduced once, before the N-th pass's ``step()``;
    as in Horovod, scale the loss by ``1/N`` if the update should use their mean.
    ``num_groups``/``groups`` (Horovod's grouped all-reduce) are accepted and ignored.
    """
    _topology()
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum (Adasum is not supported), got {op!r}")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if op != Average and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {})
    wrapped = cls.__new__(cls)
    # Share state and param groups; drop per-instance wrappers of step (e.g. an LR
    # scheduler's) so that calls reach the synchronising step.
    wrapped.__dict__.update({k: v for k, v in vars(optimizer).items()
                             if k not in ("step", "zero_grad")})
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor)
    return wrapped


