"""A run's training loaders: one data position that they follow wherever they are built.

A loader built before ``run.epochs()`` is pointed at each epoch as it starts. A
loader built inside the loop (``for epoch in run.epochs(3): loader = run.loader(...)``)
was not there when its epoch started, so it takes the position on registration: the
epoch's shuffle and start offset (after a resume, the checkpoint's), or, when it
replaces a loader over the same dataset, that loader's position. Either way it hands
out exactly the batches a loader built before the loop would.

A loader built inside an epoch replaces the loaders over the same dataset and those
built inside earlier epochs (the previous epochs' loaders): they stop following the
run, and iterating one again is refused in one line, since its shuffle and position
would be stale. The checkpoint's position is the one of the loader iterated last.
"""

from __future__ import annotations

from paratrain.data.loader import DataCursor, DistributedLoader


class TrainingLoaders:
    """The training loaders registered with a run, and where the current epoch started."""

    def __init__(self) -> None:
        self.loaders: list[DistributedLoader] = []
        self._built_in: dict[int, int | None] = {}  # id(loader) -> epoch it was built in
        self._started: DataCursor | None = None  # the last epoch started, at its offset

    def add(self, loader: DistributedLoader, *, epoch: int) -> None:
        """Register ``loader``; ``epoch`` is the run's epoch (in progress or next)."""
        in_epoch = self._started is not None and self._started.epoch == epoch
        position = self._started if in_epoch else None
        kept = []
        for old in self.loaders:
            built = self._built_in[id(old)]
            same = old.dataset is loader.dataset
            # Before the loop every loader is kept, as each follows the epochs.
            if not in_epoch or not (same or (built is not None and built < epoch)):
                kept.append(old)
                continue
            if same:
                position = old.cursor  # a rebuilt loader continues where the old one was
            old.retired = (
                f"this training loader was replaced by a run.loader() built in epoch {epoch}, "
                "so it no longer follows the run's epochs and checkpoint; iterate the newest "
                "loader (build one before run.epochs(), or a new one in every epoch)"
            )
            del self._built_in[id(old)]
        self.loaders = kept + [loader]
        self._built_in[id(loader)] = epoch if in_epoch else None
        if position is not None:
            loader.set_epoch(position.epoch, position.offset)

    def start_epoch(self, epoch: int, offset: int) -> None:
        """Point every loader at ``epoch``, from global sample ``offset``."""
        self._started = DataCursor(epoch=epoch, offset=offset)
        for loader in self.loaders:
            loader.set_epoch(epoch, offset)

    def cursor(self, epoch: int) -> DataCursor:
        """The run's data position: the loader iterated last's (``epoch``'s start if none)."""
        if not self.loaders:
            return DataCursor(epoch=epoch, offset=0)
        # max keeps the first of equals: the oldest loader when none was iterated.
        loader = max(self.loaders, key=lambda candidate: candidate.started)
        cursor = loader.cursor
        if cursor.offset >= loader.sampler.total_size:
            # Saved after the last batch: the next run starts the next epoch.
            return DataCursor(epoch=cursor.epoch + 1, offset=0)
        return cursor

    def clear(self) -> None:
        self.loaders.clear()
        self._built_in.clear()
