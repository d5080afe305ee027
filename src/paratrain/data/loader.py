"""Distributed sampling with a world-size-independent, resumable cursor.

Every epoch has one global order of samples (a permutation seeded by
``seed`` and ``epoch``). Global batch ``k`` is positions ``[k*G, (k+1)*G)`` of
that order, with ``G = batch_size * num_replicas``, and rank ``r`` takes every
``num_replicas``-th position starting at ``r``. So the set of samples in each
global batch does not depend on the number of ranks, and the data position is
a single number: the global sample offset reached in the epoch. Resuming from
``(epoch, offset)`` continues with exactly the samples not yet seen, at the same
or at another world size.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

# Orders the starts of iteration of all loaders: the run's data position is the one
# of the loader that training iterated last (see paratrain.data.training).
_ITERATIONS = itertools.count()


@dataclass
class DataCursor:
    """Where a loader is in its data: epoch and global sample offset within it."""

    epoch: int = 0
    offset: int = 0


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The global order of sample indices for ``epoch``; identical on every rank."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator()
    # Seeding by (seed, epoch) reshuffles each epoch, identically on every rank.
    generator.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def check_map_style(dataset: Any, caller: str) -> None:
    """One line when ``dataset`` cannot be sharded by index: an ``IterableDataset``, a
    generator or any other iterable without ``len()`` and ``[index]``.

    The sampler shards one global order of indices, which is what makes every rank take
    the same steps and a checkpoint resume at the exact sample; a stream has neither.
    """
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__")
                                                    and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"{caller} needs a dataset with len() and [index] (it shards one global order "
            f"of indices over the ranks and resumes at an exact sample), got a "
            f"{type(dataset).__name__}; for a stream, materialise it (list(stream)) or wrap "
            "it in a torch.utils.data.Dataset with __len__ and __getitem__")


class ShardedSampler(Sampler[int]):
    """Indices of one rank's shard of the global order, from the cursor's offset on.

    Args:
        num_samples: length of the dataset.
        num_replicas: number of data-parallel ranks.
        rank: this rank's data-parallel index.
        shuffle: reshuffle every epoch (seeded; same order on every rank).
        seed: shuffling seed.
        drop_last: drop the tail that does not fill a whole global batch
            (``batch_size * num_replicas`` samples) instead of padding it with
            samples from the start of the epoch's order: like DataLoader's
            ``drop_last``, no rank gets a partial last batch.
        pad: with ``drop_last=False``, pad so every rank gets the same number of
            samples (training: ranks must take the same number of steps). Set
            False for evaluation, where padding would count samples twice.
        batch_size: samples per rank and batch; only ``drop_last`` uses it.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        batch_size: int = 1,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        if drop_last and num_samples < batch_size * num_replicas:
            raise ValueError(
                f"dataset has {num_samples} samples, fewer than one global batch of "
                f"{batch_size * num_replicas} ({batch_size} per rank x {num_replicas} "
                f"data-parallel rank{'s' * (num_replicas > 1)}), so "
                "drop_last=True leaves nothing to train on; use a smaller batch_size or "
                "drop_last=False"
            )
        if pad and num_samples < num_replicas:
            raise ValueError(
                f"dataset has {num_samples} samples but there are {num_replicas} data-parallel "
                "ranks; use a larger dataset or fewer processes"
            )
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.batch_size = batch_size
        self.cursor = DataCursor()

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        """Start ``epoch`` at global sample ``offset`` (0 for a fresh epoch)."""
        self.cursor = DataCursor(epoch=epoch, offset=offset)

    @property
    def total_size(self) -> int:
        """Samples in the epoch across all ranks, after padding or dropping the tail."""
        if self.drop_last:
            # Whole global batches only, as DataLoader(drop_last=True) over each rank's
            # DistributedSampler shard would leave: every rank takes the same full steps.
            global_batch = self.batch_size * self.num_replicas
            return (self.num_samples // global_batch) * global_batch
        if self.pad:
            return math.ceil(self.num_samples / self.num_replicas) * self.num_replicas
        return self.num_samples

    def _remaining_positions(self) -> torch.Tensor:
        order = epoch_order(
            self.num_samples, seed=self.seed, epoch=self.cursor.epoch, shuffle=self.shuffle
        )
        total = self.total_size
        if total > self.num_samples:
            # Pad from the start of the order so the padding does not depend on the offset.
            order = torch.cat([order, order[: total - self.num_samples]])
        return order[min(self.cursor.offset, total) : total]

    def indices(self) -> torch.Tensor:
        """This rank's remaining sample indices, in order, as one int64 tensor."""
        return self._remaining_positions()[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        remaining = max(0, self.total_size - self.cursor.offset)
        return len(range(self.rank, remaining, self.num_replicas))


class DistributedLoader:
    """A DataLoader over one rank's shard that tracks its position and moves batches to a device.

    Iterating yields batches on ``device``. The loader counts the global samples
    it has handed out so that a checkpoint taken mid-epoch resumes exactly.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: ShardedSampler,
        *,
        batch_size: int,
        device: torch.device,
        num_workers: int,
        pin_memory: bool,
        persistent_workers: bool,
        collate_fn: Any = None,
        drop_last_batch: bool = False,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.device = device
        self._generator = torch.Generator()
        self.dataloader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            collate_fn=collate_fn,
            drop_last=drop_last_batch,
            # A private generator keeps worker seeding from consuming the global RNG,
            # which would make a resumed run diverge from an uninterrupted one.
            generator=self._generator,
        )
        self.batches_in_epoch = 0
        self.local_batch: Any = None
        """This rank's part of each batch (the strategy's ``local_batch``), or None."""
        self.started = -1  # when iteration last started (_ITERATIONS); -1: never
        self.wait_s = 0.0
        """Seconds the loop waited in ``next`` for batches (read by the straggler check)."""
        self.retired: str | None = None  # why iterating it is refused, once a run replaced it

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.sampler.num_replicas

    @property
    def cursor(self) -> DataCursor:
        """Epoch and global offset of the next sample to be handed out."""
        return DataCursor(epoch=self.sampler.cursor.epoch, offset=self.position)

    @property
    def position(self) -> int:
        consumed = self.batches_in_epoch * self.global_batch_size
        return min(self.sampler.cursor.offset + consumed, self.sampler.total_size)

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        self.sampler.set_epoch(epoch, offset)
        self.batches_in_epoch = 0

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> Iterator[Any]:
        if self.retired is not None:
            raise RuntimeError(self.retired)
        self.started = next(_ITERATIONS)
        cursor = self.sampler.cursor
        if cursor.offset >= self.sampler.total_size:
            # Iterating an exhausted loader again (e.g. evaluation every epoch) starts over.
            self.set_epoch(cursor.epoch, 0)
            cursor = self.sampler.cursor
        self._generator.manual_seed(
            (self.sampler.seed * 1_000_003 + cursor.epoch) * 4099 + self.sampler.rank
        )
        local = self.local_batch
        for index, batch in enumerate(self._timed(self._device_batches())):
            self.batches_in_epoch = index + 1
            yield batch if local is None else local(batch)
        # The epoch is exhausted; the position now reads as the end of the epoch.
        self.sampler.cursor.offset = self.sampler.total_size
        self.batches_in_epoch = 0

    def take_wait(self) -> float:
        """The seconds waited for batches since the last call."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, adding the time each takes to arrive to ``wait_s`` (two clock reads)."""
        clock = time.perf_counter
        while True:
            start = clock()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.wait_s += clock() - start
            yield batch

    def _device_batches(self) -> Iterator[Any]:
        """This epoch's remaining batches on ``device``; subclasses change how they are built."""
        non_blocking = self.dataloader.pin_memory and self.device.type == "cuda"
        for batch in self.dataloader:
            yield move_to_device(batch, self.device, non_blocking=non_blocking)


def move_to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``: one call per batch.

    The nesting is walked by a private helper, not by calling this function again, so a
    wrapper or spy around ``move_to_device`` sees each batch once (a spy that counted
    the per-tensor calls read two moves per ``(x, y)`` batch).
    """
    return _moved(batch, device, non_blocking)


def _moved(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: _moved(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_moved(v, device, non_blocking) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if hasattr(batch, "to"):
        return batch.to(device)
    return batch
