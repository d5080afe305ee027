"""Everything a checkpoint must capture for a run to continue exactly where it stopped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint import CheckpointError
from paratrain.data import DataCursor, DistributedLoader

if TYPE_CHECKING:
    from paratrain.run import Run


class RunState:
    """Registered model/optimizer/loaders plus counters; saves and restores them."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self.loaders: list[DistributedLoader] = []
        self.global_step = 0
        self.epoch = 0
        self._resume_cursor: DataCursor | None = None
        self._resume_checked = False

    def register(self, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
        self.models.append(model)
        if optimizer is not None:
            self.optimizers.append(optimizer)
        if scheduler is not None:
            self.schedulers.append(scheduler)

    def register_loader(self, loader: DistributedLoader) -> None:
        self.loaders.append(loader)

    def release(self) -> None:
        self.models.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.loaders.clear()

    # -- epochs ---------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> int:
        """Point the training loaders at ``epoch``; return the global sample offset it starts at."""
        offset = 0
        if self._resume_cursor is not None and self._resume_cursor.epoch == epoch:
            offset = self._resume_cursor.offset
        self._resume_cursor = None
        for loader in self.loaders:
            loader.set_epoch(epoch, offset)
        return offset

    def maybe_resume(self) -> None:
        """Resume once from the newest checkpoint in ``checkpoint_dir``, if there is one."""
        if self._resume_checked:
            return
        self._resume_checked = True
        directory = self._run.config.checkpoint_dir
        latest = checkpoint.latest_checkpoint(directory) if directory else None
        if latest is not None:
            self.load(latest)
            self._run.print(f"resumed from {latest} (epoch {self.epoch}, step {self.global_step})")

    # -- save -------------------------------------------------------------------------
    def _cursor(self) -> DataCursor:
        if not self.loaders:
            return DataCursor(epoch=self.epoch, offset=0)
        loader = self.loaders[0]
        cursor = loader.cursor
        if cursor.offset >= loader.sampler.total_size:
            # Saved after the last batch: the next run starts the next epoch.
            return DataCursor(epoch=cursor.epoch + 1, offset=0)
        return cursor

    def _gather_rng(self) -> torch.Tensor:
        # Through the strategy: ranks that never save (parameter servers) take no part.
        return self._run.strategy.gather_rng_states(checkpoint.rng_state())

    def save(self, directory: str | os.PathLike | None) -> str | None:
        run = self._run
        directory = directory or run.config.checkpoint_dir
        if directory is None:
            raise ValueError("save() needs a directory (or Run(checkpoint_dir=...))")
        strategy = run.strategy
        cursor = self._cursor()
        state = {
            "format": "paratrain",
            "version": checkpoint.FORMAT_VERSION,
            "strategy": strategy.name,
            "world_size": run.world_size,
            "global_step": self.global_step,
            "epoch": cursor.epoch,
            "cursor": {"epoch": cursor.epoch, "offset": cursor.offset},
            "schedulers": [s.state_dict() for s in self.schedulers],
            "precision": run.precision.state_dict(),
            "rng": self._gather_rng(),
        }
        path = Path(directory) / checkpoint.checkpoint_name(self.global_step)
        if strategy.replicated:
            # State dicts may be collective (sharded strategies): every rank calls them.
            state["models"] = [strategy.model_state_dict(m) for m in self.models]
            state["optimizers"] = [
                strategy.optimizer_state_dict(self.models[0], o) for o in self.optimizers
            ]
        else:
            # Every rank writes its own shards (torch.distributed.checkpoint) next to the
            # small file, which rank 0 writes last: its presence marks a complete checkpoint.
            sharded = path.with_suffix(".dcp")
            strategy.save_sharded_state(str(sharded), self.models, self.optimizers)
            state.update(models=[], optimizers=[], sharded=sharded.name,
                         num_models=len(self.models), optimizer_layout="flat")
            strategy.barrier()
        written = None
        if run.is_main:
            written = str(checkpoint.atomic_save(state, path))
            checkpoint.prune(directory, run.config.keep_checkpoints)
            _prune_sharded(Path(directory))
        # Nobody continues (and may be killed) before the file is complete.
        strategy.barrier()
        return written

    # -- load ---------------------------------------------------------------------------
    def load(self, path: str | os.PathLike) -> None:
        run = self._run
        state = checkpoint.safe_load(path)
        num_models = state.get("num_models", len(state["models"]))
        if num_models != len(self.models):
            raise CheckpointError(
                f"checkpoint {path} holds {num_models} model(s) but "
                f"{len(self.models)} were prepared; call run.prepare() before loading"
            )
        if state.get("sharded"):
            # Written by a sharded strategy: any strategy, at any world size, reads it.
            try:
                run.strategy.load_sharded_state(
                    str(Path(path).parent / state["sharded"]), self.models, self.optimizers,
                    flat_optimizer=state.get("optimizer_layout") == "flat")
            except (RuntimeError, KeyError, ValueError, FileNotFoundError) as exc:
                reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                raise CheckpointError(
                    f"sharded checkpoint {path} does not match the model or optimizer "
                    f"({type(exc).__name__}: {reason})"
                ) from None
        for model, model_state in zip(self.models, state["models"]):
            try:
                run.strategy.load_model_state_dict(model, model_state)
            except (RuntimeError, KeyError, ValueError) as exc:
                reason = str(exc).strip().splitlines()[0][:200]
                raise CheckpointError(
                    f"checkpoint {path} does not match the model ({reason}); "
                    "was it written for another model?"
                ) from None
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
            try:
                run.strategy.load_optimizer_state_dict(self.models[0], optimizer, optimizer_state)
            except (RuntimeError, KeyError, ValueError) as exc:
                raise CheckpointError(
                    f"checkpoint {path} does not match the optimizer: {exc}"
                ) from None
        for scheduler, scheduler_state in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
        run.precision.load_state_dict(state["precision"])
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self._resume_cursor = DataCursor(**state["cursor"])
        rng = state["rng"]
        if int(state["world_size"]) == run.world_size and run.rank < rng.shape[0]:
            checkpoint.set_rng_state(rng[run.rank])
        else:
            # Another world size: per-rank streams cannot be mapped; derive fresh ones.
            from paratrain.run import seed_everything

            seed_everything(run.config.seed + 1 + run.rank + 7919 * self.global_step)
        self._resume_checked = True


def _prune_sharded(directory: Path) -> None:
    """Delete shard directories whose small checkpoint file was pruned (or never finished)."""
    import shutil

    kept = {p.with_suffix(".dcp").name for p in checkpoint.list_checkpoints(directory)}
    for shard_dir in directory.glob("step-*.dcp"):
        if shard_dir.is_dir() and shard_dir.name not in kept:
            shutil.rmtree(shard_dir, ignore_errors=True)
