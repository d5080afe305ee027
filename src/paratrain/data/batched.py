"""Batches gathered with one indexing operation from an in-memory dataset.

The DataLoader path calls ``dataset[i]`` once per sample and stacks the results
(``default_collate``). For a dataset that already holds its samples as tensors that
is pure overhead: ``tensor.index_select(0, index)`` builds the same batch (the same
values, dtypes, shapes and list container) in one operation. :class:`BatchedLoader`
does that with the same :class:`~paratrain.data.loader.ShardedSampler` order and
the same cursor, so every batch, and therefore every loss, is bitwise what the
DataLoader path gives.

On CUDA the batch is gathered into pinned host memory and copied on a side stream
while the previous batch computes; with ``device_resident=True`` the tensors are
copied to the GPU once (when they take at most half its free memory) and each
batch is gathered there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from paratrain.data.loader import DistributedLoader, ShardedSampler, move_to_device

# A resident copy may take this share of the device's free memory; the rest is the model's.
RESIDENT_SHARE = 0.5


class TensorSource:
    """The tensors of a :class:`~torch.utils.data.TensorDataset`, gathered by index."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors
        # Host gathers go through numpy's take, which copies on one thread: ATen's
        # index_select splits a batch over OpenMP threads, whose start-up costs far
        # more than the copy when the cores are busy (0.3-20 ms against 0.2 ms for a
        # Fashion-MNIST batch on two shared cores). None: a dtype numpy lacks (bf16).
        self.arrays = [_host_array(t) for t in tensors]

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def gather(self, index: torch.Tensor, *, pin: bool) -> list[torch.Tensor]:
        """The samples at ``index`` as ``default_collate`` would stack them (a list)."""
        out = []
        for tensor, array in zip(self.tensors, self.arrays):
            if array is None and not pin:
                out.append(tensor.index_select(0, index))
                continue
            # Gathering straight into pinned memory saves the copy that pin_memory() makes.
            buffer = torch.empty((len(index), *tensor.shape[1:]), dtype=tensor.dtype,
                                 pin_memory=pin)
            if array is None:
                torch.index_select(tensor, 0, index, out=buffer)
            else:  # "clip": the sampler's indices are in range, and it avoids a buffered copy
                np.take(array, index.numpy(), axis=0, out=buffer.numpy(), mode="clip")
            out.append(buffer)
        return out

    def resident(self, device: torch.device) -> TensorSource | None:
        """A copy on ``device``, or None when it would not leave room for the model."""
        free, _ = torch.cuda.mem_get_info(device)
        if self.nbytes > free * RESIDENT_SHARE:
            return None
        return TensorSource(tuple(t.to(device) for t in self.tensors))


class ItemsSource:
    """A dataset with ``__getitems__`` (torch's batched fetch), collated as DataLoader does."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.device = torch.device("cpu")

    def gather(self, index: torch.Tensor, *, pin: bool) -> Any:
        batch = default_collate(self.dataset.__getitems__(index.tolist()))  # type: ignore[attr-defined]
        return map_tensors(batch, torch.Tensor.pin_memory) if pin else batch

    def resident(self, device: torch.device) -> None:
        return None  # the items are built on the host by the dataset's own code


def batched_source(dataset: Dataset) -> TensorSource | ItemsSource | None:
    """How to gather ``dataset`` by batch, or None when only per-sample access is exact."""
    if callable(getattr(dataset, "__getitems__", None)):
        return ItemsSource(dataset)
    # A subclass that overrides __getitem__ (a transform) must see every sample.
    if isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__:
        tensors = tuple(dataset.tensors)
        devices = {t.device for t in tensors}
        # default_collate stacks into a contiguous batch; index_select of a strided
        # source could differ in layout (and so in kernel choice) downstream.
        if len(devices) == 1 and all(t.is_contiguous() for t in tensors):
            return TensorSource(tensors)
    return None


class BatchedLoader(DistributedLoader):
    """A :class:`DistributedLoader` that builds each batch with one gather.

    The sampler, cursor, ``len()``, ``position`` and ``set_epoch`` are the base
    class's; only how a batch is built differs, and the batches are equal element
    for element. ``loader.dataloader`` remains the equivalent DataLoader (its
    ``collate_fn`` and length are used), but it is never iterated.
    """

    def __init__(self, dataset: Dataset, sampler: ShardedSampler, *,
                 source: TensorSource | ItemsSource, batch_size: int, device: torch.device,
                 pin_memory: bool, device_resident: bool = False,
                 drop_last_batch: bool = False) -> None:
        super().__init__(dataset, sampler, batch_size=batch_size, device=device, num_workers=0,
                         pin_memory=pin_memory, persistent_workers=False,
                         drop_last_batch=drop_last_batch)
        self.source = source
        if device_resident and device.type == "cuda" and source.device != device:
            placed = source.resident(device)
            if placed is None:
                warnings.warn(f"device_resident=True: the dataset does not fit in half of "
                              f"{device}'s free memory or is not a tensor dataset; its batches "
                              "are streamed from pinned host memory instead", stacklevel=3)
            else:
                self.source = placed

    def _device_batches(self) -> Iterator[Any]:
        indices = self.sampler.indices().to(self.source.device)
        batches = list(indices.split(self.batch_size)) if len(indices) else []
        if self.dataloader.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.device.type == "cuda" and self.source.device.type == "cpu":
            yield from self._streamed(batches)
            return
        for index in batches:
            yield move_to_device(self.source.gather(index, pin=False), self.device)

    def _streamed(self, batches: list[torch.Tensor]) -> Iterator[Any]:
        """Copy batch k+1 on a side stream while the caller computes on batch k."""
        pin = self.dataloader.pin_memory
        side = torch.cuda.Stream(device=self.device)
        pending = None
        for index in batches:
            host = self.source.gather(index, pin=pin)
            with torch.cuda.stream(side):
                moved = move_to_device(host, self.device, non_blocking=pin)
                ready = torch.cuda.Event()
                ready.record(side)
            if pending is not None:
                yield self._hand_over(*pending)
            pending = (moved, ready)
        if pending is not None:
            yield self._hand_over(*pending)

    def _hand_over(self, batch: Any, ready: torch.cuda.Event) -> Any:
        current = torch.cuda.current_stream(self.device)
        # The caller's stream waits for this batch's copy only, not for the next one's.
        current.wait_event(ready)
        for tensor in tensors_of(batch):
            # Memory allocated on the side stream is used on the caller's: tell the allocator.
            tensor.record_stream(current)
        return batch


def _host_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a host tensor, or None where numpy cannot hold it."""
    if tensor.device.type != "cpu":
        return None
    try:
        return tensor.detach().numpy()
    except (TypeError, RuntimeError):
        return None


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor of a (nested) batch, keeping its containers."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        mapped = [map_tensors(v, fn) for v in batch]
        return type(batch)(*mapped) if hasattr(batch, "_fields") else type(batch)(mapped)
    return batch


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) batch."""
    found: list[torch.Tensor] = []
    map_tensors(batch, lambda t: found.append(t) or t)
    return found


def build_loader(dataset: Dataset, sampler: ShardedSampler, *, batch_size: int,
                 device: torch.device, num_workers: int, pin_memory: bool,
                 persistent_workers: bool, collate_fn: Any, batched: bool,
                 device_resident: bool) -> DistributedLoader:
    """A :class:`BatchedLoader` where it gives the same batches, else a :class:`DistributedLoader`.

    Worker processes (``num_workers > 0``) are an explicit request for per-sample
    loading in parallel (decoding, augmenting), and a custom ``collate_fn`` expects
    the per-sample items that a gather never builds: both keep the DataLoader path.
    """
    source = batched_source(dataset) if batched else None
    if source is None or num_workers > 0 or collate_fn is not None:
        return DistributedLoader(dataset, sampler, batch_size=batch_size, device=device,
                                 num_workers=num_workers, pin_memory=pin_memory,
                                 persistent_workers=persistent_workers, collate_fn=collate_fn)
    return BatchedLoader(dataset, sampler, source=source, batch_size=batch_size, device=device,
                         pin_memory=pin_memory, device_resident=device_resident)
