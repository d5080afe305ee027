"""Everything a checkpoint must capture for a run to continue exactly where it stopped."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratrain.checkpoint import files as checkpoint
from paratrain.checkpoint import shard_files
from paratrain.checkpoint.background import BackgroundWriter, snapshot, write_job
from paratrain.checkpoint.failures import failure_reason, is_dcp_failure, os_error, write_error
from paratrain.checkpoint.files import CheckpointError, CorruptCheckpoint
from paratrain.checkpoint.resume import resume_newest
from paratrain.data.loader import DataCursor, DistributedLoader
from paratrain.data.training import TrainingLoaders
from paratrain.run import spikes
from paratrain.run.seeding import reseed_lost_streams
from paratrain.strategies.capabilities import ShardedState, local_module

if TYPE_CHECKING:
    from paratrain.config import RunConfig
    from paratrain.distributed.topology import Topology
    from paratrain.precision import Precision
    from paratrain.strategies.base import Strategy


class RunState:
    """Registered model/optimizer/loaders plus counters; saves and restores them.

    It receives what it needs (config, topology, strategy, precision and a rank-0 print)
    instead of the ``Run``, so that the run and its state do not import each other.
    """

    def __init__(self, *, config: RunConfig, topology: Topology, strategy: Strategy,
                 precision: Precision, print_fn: Callable[[str], None],
                 trackers: Any = None) -> None:
        self._config = config
        self._trackers = trackers  # a TrackerHub: its run ids travel in the checkpoint
        self._topology = topology
        self._strategy = strategy
        self._precision = precision
        self._print = print_fn
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self.loaders = TrainingLoaders()
        self.global_step = 0
        self.epoch = 0
        self.nonfinite_batches: list[dict[str, Any]] = []
        """Steps whose loss was non-finite: step, epoch, sample offset of the batch, ranks
        (see ``RunConfig.nan``); saved in checkpoints, so a resumed run keeps the list."""
        self.loss_spikes = spikes.new_state()
        """Loss spikes met and the spike check's window (``RunConfig.spike``), saved alike."""
        self._resume_cursor: DataCursor | None = None
        self._resume_checked = False
        self._saved: Path | None = None  # the checkpoint of the current step, once written
        self._writer = BackgroundWriter()
        self._checkpoint_group: Any = None  # gloo group of the background sharded writes

    def register(self, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
        self.models.append(model)
        if optimizer is not None:
            self.optimizers.append(optimizer)
        if scheduler is not None:
            self.schedulers.append(scheduler)

    def register_loader(self, loader: DistributedLoader) -> None:
        """Follow the epochs with ``loader``; built inside one, it starts at its position."""
        self.loaders.add(loader, epoch=self.epoch)

    def release(self) -> None:
        if self._checkpoint_group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self._checkpoint_group)
            self._checkpoint_group = None
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
        self.loaders.start_epoch(epoch, offset)
        return offset

    def resume_at(self, cursor: DataCursor) -> None:
        """Continue at ``cursor`` (a healing peer's position), as a checkpoint would."""
        self.epoch, self._resume_cursor = cursor.epoch, cursor

    def maybe_resume(self, num_epochs: int | None = None) -> None:
        """Resume once from the newest usable checkpoint in ``checkpoint_dir``, if there is one.

        When that checkpoint already holds ``num_epochs`` epochs, the line says the
        training is complete: the loop will not run, and a quick exit is no surprise.

        A damaged newest checkpoint (a truncated file, a shard file missing or short)
        falls back to the previous kept one with a warning naming both, on every rank
        alike (see :func:`~paratrain.checkpoint.resume.resume_newest`); any other
        problem (another model, another optimizer) is raised, since older files share it.
        """
        if self._resume_checked:
            return
        self._resume_checked = True
        directory = self._config.checkpoint_dir
        if not directory:
            return
        # Every rank checks each candidate, then all agree (one small all-gather each).
        path = resume_newest(directory, load=self._load_state, agree=self._agree,
                             warn=self._print)
        if path is None:
            return
        if num_epochs is not None and self.epoch >= num_epochs:
            epochs = f"{num_epochs} epoch{'s' if num_epochs != 1 else ''}"
            self._print(f"resumed from {path}; training was already complete ({epochs}); "
                        "to train again, ask for more epochs or use another checkpoint_dir")
        else:
            self._print(f"resumed from {path} (epoch {self.epoch}, step {self.global_step})")

    def _agree(self, flags: torch.Tensor) -> torch.Tensor:
        """``flags`` of every rank that steps with this one (the strategy's all-gather)."""
        return self._strategy.agree_flags(flags.to(self._topology.device))

    # -- save -------------------------------------------------------------------------
    def _gather_rng(self) -> torch.Tensor:
        # Through the strategy: ranks that never save (parameter servers) take no part.
        return self._strategy.gather_rng_states(checkpoint.rng_state())

    def save(self, directory: str | os.PathLike | None, *, wait: bool = False) -> str | None:
        directory = directory or self._config.checkpoint_dir
        if directory is None:
            raise ValueError("save() needs a directory (or Run(checkpoint_dir=...))")
        # One write in flight: the previous background one ends (or raises) first.
        self.wait_for_saves()
        strategy, topology = self._strategy, self._topology
        background = self._config.async_save and _can_write_in_background(strategy)
        path = Path(directory) / checkpoint.checkpoint_name(self.global_step)
        if self._saved is not None and path.resolve() == self._saved:
            # checkpoint_every and an explicit save() at the same step: written once.
            if wait and background:
                strategy.barrier()
            return str(path) if topology.is_main else None
        cursor = self.loaders.cursor(self.epoch)
        state = {
            "format": "paratrain",
            "version": checkpoint.FORMAT_VERSION,
            "strategy": strategy.name,
            "world_size": topology.world_size,
            "global_step": self.global_step,
            "epoch": cursor.epoch,
            "cursor": {"epoch": cursor.epoch, "offset": cursor.offset},
            "schedulers": [s.state_dict() for s in self.schedulers],
            "optimizer_types": checkpoint.optimizer_types(self.optimizers),
            "precision": self._precision.state_dict(),
            "nonfinite_batches": list(self.nonfinite_batches),
            "loss_spikes": {key: list(items) for key, items in self.loss_spikes.items()},
            "rng": self._gather_rng(),
        }
        if self._trackers and topology.is_main:  # after a flush: the steps so far are in them
            state["trackers"] = self._trackers.state_dict()
        shards = staged = None
        if not isinstance(strategy, ShardedState):
            # State dicts may be collective (sharded strategies): every rank calls them.
            state["models"] = [strategy.model_state_dict(m) for m in self.models]
            state["optimizers"] = [
                strategy.optimizer_state_dict(self.models[0], o) for o in self.optimizers
            ]
            # Parameter names in optimizer order, so that a sharded strategy can load it.
            state["optimizer_params"] = [_optimizer_names(strategy.unwrap(self.models[0]), o)
                                         for o in self.optimizers]
        else:
            # Every rank writes its own shards (torch.distributed.checkpoint) next to the
            # small file, which rank 0 writes last: its presence marks a complete checkpoint.
            sharded = path.with_suffix(".dcp")
            staged = shard_files.staging_dir(sharded)  # renamed to `sharded` once complete
            state.update(models=[], optimizers=[], sharded=sharded.name,
                         num_models=len(self.models), optimizer_layout="flat")
            write = (functools.partial(strategy.start_sharded_save, group=self._group())
                     if background else strategy.save_sharded_state)
            shards = shard_files.write_staged(write, staged, self.models, self.optimizers,
                                              path=path, strategy=strategy,
                                              main=topology.is_main)
            if not background:
                strategy.barrier()
        if background:
            # Copied now, so the file holds this step whatever training does next.
            self._saved = path.resolve()  # reset if the write fails
            small = snapshot(state) if topology.is_main else None
            self._writer.start(write_job(shards, small, path, self._config.keep_checkpoints,
                                         staged=staged), label=str(path))
            if wait:
                self.wait_for_saves()
                strategy.barrier()  # as below: rank 0's file is complete before anyone exits
            return str(path) if topology.is_main else None
        written, failed = None, None
        if topology.is_main:
            try:
                if staged is not None:
                    shard_files.publish(staged, staged.parent / state["sharded"], path)
                written = str(checkpoint.commit(state, path, self._config.keep_checkpoints))
            except (OSError, RuntimeError) as exc:  # disk full, read-only: the previous stays
                failed = exc
        # Nobody continues (and may be killed) before the file is complete.
        strategy.barrier()
        code = 0 if failed is None else getattr(os_error(failed), "errno", -1)
        errors = self._agree(torch.tensor([code], dtype=torch.int64)).reshape(-1)
        if errors.any():  # every rank stops with one line: rank 0's reason
            raise write_error(path, failed or int(errors[0])) from None
        self._saved = path.resolve()
        return written

    def wait_for_saves(self) -> None:
        """Block until the background write is complete; CheckpointError if it failed."""
        try:
            self._writer.wait()
        except CheckpointError:
            self._saved = None  # that step may be saved again
            raise

    def finish_saves(self, *, agree: bool) -> CheckpointError | None:
        """At close: wait for the background write and return its error to raise last.

        ``agree``: then all ranks also meet once the write is done, so that on every
        rank a returned close() means a complete checkpoint (the synchronous save's
        barrier). Skipped while an exception ends the run (peers may be elsewhere);
        then the write's error is printed, so that it does not hide the first one.
        """
        ending = sys.exc_info()[1]  # close() from __exit__ or a finally block
        pending = self._writer.pending
        failed = None
        try:
            self.wait_for_saves()
        except CheckpointError as exc:
            failed = exc
        if pending and agree and ending is None:
            self._strategy.barrier()
        if failed is not None and ending is not None:
            print(f"paratrain: error: {failed}", file=sys.stderr, flush=True)
            return None
        return failed

    def _group(self) -> Any:
        """The gloo group of all ranks that background sharded writes use."""
        import datetime

        import torch.distributed as dist

        if self._checkpoint_group is None:
            # Collective, but every rank saves the same step, so all create it here.
            self._checkpoint_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self._config.timeout_s))
        return self._checkpoint_group

    # -- load ---------------------------------------------------------------------------
    def load(self, path: str | os.PathLike) -> None:
        self.wait_for_saves()  # ``path`` may be the checkpoint being written
        self._load_state(path, checkpoint.safe_load(path))

    def _load_state(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        """Restore ``state``, the small file ``path`` already read."""
        strategy, topology = self._strategy, self._topology
        num_models = state.get("num_models", len(state["models"]))
        if num_models != len(self.models):
            raise CheckpointError(
                f"checkpoint {path} holds {num_models} model(s) but "
                f"{len(self.models)} were prepared; call run.prepare() before loading"
            )
        checkpoint.check_optimizer_types(path, state, self.optimizers)
        if state.get("sharded"):
            self._load_sharded(path, state)
        for index, (model, model_state) in enumerate(zip(self.models, state["models"])):
            self._check_model(path, index, {k: tuple(v.shape) for k, v in model_state.items()})
            try:
                strategy.load_model_state_dict(model, model_state)
            except (RuntimeError, KeyError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {path} does not match the model "
                                      f"({_reason(exc)})") from None
        for index, (optimizer, optimizer_state) in enumerate(
                zip(self.optimizers, state["optimizers"])):
            if isinstance(strategy, ShardedState):
                optimizer_state = _by_name(path, optimizer_state,
                                           state.get("optimizer_params", [None])[index])
            try:
                strategy.load_optimizer_state_dict(self.models[0], optimizer, optimizer_state)
            except (RuntimeError, KeyError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {path} does not match the optimizer "
                                      f"({_reason(exc)})") from None
        for scheduler, scheduler_state in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
        self._precision.load_state_dict(state["precision"])
        self.nonfinite_batches[:] = state.get("nonfinite_batches", [])
        for key, items in self.loss_spikes.items():  # in place: the spike check holds them
            items[:] = state.get("loss_spikes", {}).get(key, [])
        self.global_step = int(state["global_step"])
        if self._trackers:
            self._trackers.load_state_dict(state.get("trackers"), step=self.global_step)
        self.epoch = int(state["epoch"])
        self._resume_cursor = DataCursor(**state["cursor"])
        rng = state["rng"]
        rank = topology.rank
        if int(state["world_size"]) == topology.world_size and rank < rng.shape[0]:
            checkpoint.set_rng_state(rng[rank])
        else:
            # Another world size: per-rank streams cannot be mapped; derive fresh ones.
            reseed_lost_streams(self._config.seed, strategy.random_stream_rank,
                                self.global_step)
        self._resume_checked = True
        self._saved = Path(path).resolve()

    def _check_model(self, path: str | os.PathLike, index: int,
                     found: dict[str, tuple[int, ...]]) -> None:
        """CheckpointError naming the first missing/unexpected key and shape mismatch."""
        strategy = self._strategy
        expected = {k: tuple(v.shape) for k, v in
                    local_module(strategy, self.models[index]).state_dict().items()}
        partial = isinstance(strategy, ShardedState) and strategy.partial_model
        problem = checkpoint.describe_mismatch(expected, found, partial=partial)
        if problem:
            raise CheckpointError(f"checkpoint {path} does not match the model: {problem}")

    def _load_sharded(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        # Written by a sharded strategy: any strategy, at any world size, reads it.
        from paratrain.checkpoint.sharded import load_sharded, saved_shapes

        directory = Path(path).parent / state["sharded"]
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint {path} needs its shard directory {directory}, "
                                  "which is missing; copy both together")
        for index in range(len(self.models)):
            self._check_model(path, index, saved_shapes(directory, index))
        strategy = self._strategy
        flat = state.get("optimizer_layout") == "flat"
        try:
            if isinstance(strategy, ShardedState):
                strategy.load_sharded_state(str(directory), self.models, self.optimizers,
                                            flat_optimizer=flat)
            else:
                # A replicated strategy reads every shard into its whole model.
                load_sharded(str(directory), [strategy.unwrap(m) for m in self.models],
                             self.optimizers, flat=flat)
        except (RuntimeError, KeyError, ValueError, FileNotFoundError) as exc:
            raise CheckpointError(f"sharded checkpoint {path} does not match the optimizer "
                                  f"({type(exc).__name__}: {_reason(exc)})") from None
        except BaseException as exc:
            if not is_dcp_failure(exc):  # raised on every rank, like DCP's own
                raise
            raise CorruptCheckpoint(f"checkpoint {path} is damaged: reading its shards failed "
                                    f"({failure_reason(exc)})") from None


def _can_write_in_background(strategy: Strategy) -> bool:
    """False for a sharded strategy in one process without a process group (it runs
    unsharded): DCP's single-process save warns from its writer thread, where the
    warning cannot be silenced without racing the training thread's filters."""
    import torch.distributed as dist

    return not isinstance(strategy, ShardedState) or dist.is_initialized()


def _reason(exc: BaseException) -> str:
    """The whole message of ``exc`` on one line (torch's spans several)."""
    return " ".join(str(exc).split())[:400] or type(exc).__name__


def _optimizer_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str] | None:
    """Names of ``optimizer``'s parameters in its state-dict order (None if not all in ``module``)."""
    names = {id(p): name for name, p in module.named_parameters()}
    groups = getattr(optimizer, "param_groups", None) or []
    order = [names.get(id(p)) for group in groups for p in group["params"]]
    return None if not order or None in order else order


def _by_name(path: str | os.PathLike, state: dict[str, Any], names: list[str] | None) -> dict:
    """A one-file optimizer state (keyed by index) keyed by parameter name instead."""
    if names is None:
        raise CheckpointError(
            f"checkpoint {path} does not record its optimizer's parameter names (written by an "
            "older paratrain), so a sharded strategy cannot place the optimizer state; "
            "resume it with strategy 'ddp' or 'single' and save again"
        )
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}
