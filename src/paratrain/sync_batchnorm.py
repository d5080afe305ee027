"""``Run(sync_batchnorm=True)``: batch statistics over the global batch, as one process.

Plain BatchNorm normalises each rank's batch by that batch's own mean and variance, so a
data-parallel run differs from one process by more than rounding. On CUDA the
layers become torch's ``SyncBatchNorm``. torch's version refuses CPU tensors, so on CPU
(gloo) they become :class:`GroupBatchNorm`, which all-reduces the per-channel sums
through ``torch.distributed.nn.functional.all_reduce`` (autograd-aware: the backward
all-reduces the gradients of the sums, as SyncBatchNorm's kernels do).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class GroupBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are taken over a process group's ranks.

    Two all-reduces per forward: the sums and counts (for the mean), then the centred
    squares (for the variance): two passes as one process's kernel does, so the
    variance does not lose digits to ``E[x^2] - mean^2``'s cancellation.

    The arithmetic is float64, the result cast back to the input's type: torch's CPU
    kernel accumulates float32 in double too, and its backward's per-channel sums cancel
    almost entirely. Left in float32 through autograd, those sums over a channel's
    ``N x H x W`` elements put errors of 1% into a ResNet's first convolution's
    gradient (8 images of 64 x 64), where one process's kernel errs by 5e-6.
    """

    def __init__(self, source: _BatchNorm, group: Any) -> None:
        super().__init__(source.num_features, source.eps, source.momentum, source.affine,
                         source.track_running_stats)
        # The same Parameter objects (as torch's convert_sync_batchnorm keeps them): the
        # optimizer the user built over the model must still update them.
        if source.affine:
            self.weight, self.bias = source.weight, source.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(self, name, getattr(source, name))
        self.group = group
        self.training = source.training

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        from torch.distributed.nn.functional import all_reduce

        self._check_input_dim(input)
        wide = input.double()
        dims = [d for d in range(input.dim()) if d != 1]
        shape = [1, -1] + [1] * (input.dim() - 2)
        local_count = input.numel() // input.shape[1]
        totals = torch.cat([wide.sum(dims), wide.new_tensor([float(local_count)])])
        totals = all_reduce(totals, group=self.group)
        count = totals[-1]
        mean = totals[:-1] / count
        centred = wide - mean.reshape(shape)
        var = all_reduce((centred * centred).sum(dims), group=self.group) / count
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.double().reshape(shape) + self.bias.double().reshape(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), int(count.item()))
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        self.num_batches_tracked += 1
        momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                    else self.momentum)
        unbiased = var * (count / max(count - 1, 1))
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype),
                                                  alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype),
                                                 alpha=momentum)


def convert_sync_batchnorm(model: nn.Module, *, group: Any, group_size: int,
                           device_type: str) -> nn.Module:
    """``model`` with every BatchNorm synchronised over ``group`` (None: the whole job).

    Unchanged with ``group_size`` 1: one rank's batch is the global batch.
    """
    if group_size == 1:
        return model
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    return _replace(model, group)


def _replace(module: nn.Module, group: Any) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, GroupBatchNorm):
        return GroupBatchNorm(module, group)
    for name, child in module.named_children():
        replaced = _replace(child, group)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


__all__ = ["GroupBatchNorm", "convert_sync_batchnorm"]
