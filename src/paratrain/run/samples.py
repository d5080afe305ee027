"""Global samples of iterables paratrain did not build, for the progress bar and the epoch stats.

A :class:`~paratrain.data.loader.DistributedLoader` knows its global sample position.
A person's own ``torch.utils.data.DataLoader`` (say over a ``DistributedSampler``)
does not, so its size is read from the loader: samples per rank from its sampler
(or batches x batch size with ``drop_last``) times the data-parallel size, which is
not the world size under tensor or pipeline parallelism, where peers share a batch.
The samples it hands out through ``run.progress`` are counted from each batch's
leading dimension, so that ``run.epoch_throughput`` reports them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from paratrain.data.batched import tensors_of
from paratrain.data.loader import DistributedLoader


def batch_samples(batch: Any) -> int:
    """Samples in ``batch``: the leading dimension of its first tensor (0 if it has none)."""
    tensors = tensors_of(batch)
    return tensors[0].shape[0] if tensors and tensors[0].dim() > 0 else 0


def _dataloader_plan(loader: DataLoader) -> tuple[int, int] | None:
    """Samples per rank in an epoch of ``loader`` and per batch, or None if unknown."""
    batch_sampler = loader.batch_sampler
    size = getattr(batch_sampler, "batch_size", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if not size or sampler is None:
        return None  # no automatic batching, or a batch sampler of its own
    try:
        if getattr(batch_sampler, "drop_last", False):
            return len(batch_sampler) * size, size
        return len(sampler), size
    except TypeError:  # an iterable-style dataset: no length
        return None


class SampleCounter:
    """Global samples handed out by :meth:`plan`'s iterables, in all and in this epoch."""

    def __init__(self) -> None:
        self.total = 0
        self._at_epoch_start = 0

    def restart(self) -> None:
        """A new epoch starts: :attr:`in_epoch` counts from 0."""
        self._at_epoch_start = self.total

    @property
    def in_epoch(self) -> int:
        return self.total - self._at_epoch_start

    def plan(self, batches: Iterable[Any], replicas: int) -> tuple[Iterable[Any], int, int]:
        """``(batches to iterate, global samples to come, global samples per batch)``.

        ``replicas`` is the data-parallel size. A paratrain loader is returned as is;
        any other iterable comes back wrapped, counting the samples it hands out.
        """
        if isinstance(batches, DistributedLoader):
            sampler = batches.sampler
            return batches, sampler.total_size - sampler.cursor.offset, batches.global_batch_size
        known = _dataloader_plan(batches) if isinstance(batches, DataLoader) else None
        if known is None:
            # A list or generator of batches: sized from its first batch (exact when
            # the batches are equal, the last one aside).
            count = len(batches)  # type: ignore[arg-type]
            iterator = iter(batches)
            first = next(iterator, None)
            per_batch = max(batch_samples(first), 1) if first is not None else 1
            known = (count * per_batch, per_batch)
            batches = iterator if first is None else itertools.chain([first], iterator)
        per_rank, per_batch = known
        return self._counted(batches, replicas), per_rank * replicas, per_batch * replicas

    def _counted(self, batches: Iterable[Any], replicas: int) -> Iterator[Any]:
        for batch in batches:
            self.total += batch_samples(batch) * replicas
            yield batch
