"""The user-facing ``Run``: one training script for one process or many.

Example:
    >>> run = paratrain.Run(strategy="ddp")                     # doctest: +SKIP
    >>> model, optimizer = run.prepare(model, optimizer)        # doctest: +SKIP
    >>> loader = run.loader(train_set, batch_size=64)           # doctest: +SKIP
    >>> for epoch in run.epochs(3):                              # doctest: +SKIP
    ...     for x, y in run.progress(loader):
    ...         loss = F.cross_entropy(model(x), y)
    ...         run.backward(loss)
    ...         run.step(optimizer)
    ...     run.print(f"epoch {epoch}: loss {run.mean(loss):.4f}")
    ...     run.save("checkpoints/")
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from paratrain.activation_checkpointing import apply_activation_checkpointing
from paratrain.compile import CompileClock, CompileOptions
from paratrain.config import RunConfig
from paratrain.data.batched import build_loader
from paratrain.data.loader import DistributedLoader, ShardedSampler, check_map_style
from paratrain.distributed import _compat
from paratrain.distributed.process_group import destroy_process_group
from paratrain.fault_tolerance.axis import replica_groups
from paratrain.fault_tolerance.options import group_checkpoint_dir
from paratrain.reliability import signals
from paratrain.reliability.stragglers import StragglerDetector
from paratrain.run import collective_calls, hooks, misuse
from paratrain.run.accumulation import StepState
from paratrain.run.build import build_parts
from paratrain.run.hooks import AfterStep, FaultHook, HealthHook, PeriodicSave, StopOnSignal
from paratrain.run.metrics import Metrics
from paratrain.run.pretrained import Pretrained, setup_model
from paratrain.run.router_metrics import RouterLoad
from paratrain.run.samples import SampleCounter
from paratrain.run.seeding import seed_everything
from paratrain.run.state import RunState
from paratrain.run.step import TrainStep
from paratrain.settings import Settings
from paratrain.strategies.capabilities import OrdersParallelisms, ServerRole, strategy_metrics
from paratrain.sync_batchnorm import convert_sync_batchnorm


@collective_calls.tracked  # a collective method called on some ranks only: one line
class Run(TrainStep, Metrics, Pretrained):
    """A training run: topology, strategy, precision, data, checkpoints and reporting.

    Construct it first thing in the script. It reads the launcher's environment
    (a single process when unlaunched), creates the process group, seeds every
    RNG with ``seed`` so that models are built identically on all ranks, and
    picks the strategy. The keyword arguments are the fields of :class:`RunConfig`
    (documented there); a misspelled one is one line naming the closest.
    """

    def __init__(
        self, *, strategy: str = "auto", strategy_options: dict[str, Any] | None = None,
        parallel: Any = None, sync_batchnorm: bool = False, precision: str = "32",
        float8: Any = None, tf32: bool = True,
        accumulate: int = 1, max_grad_norm: float | None = None, nan: str = "stop",
        spike: Any = None,
        stragglers: Any = True, fault_tolerance: Any = None,
        checkpoint_activations: Any = None, seed: int = 0, timeout_s: float | None = None,
        accelerator: str = "auto", checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None, keep_checkpoints: int = 2,
        async_save: bool = False, progress: bool = True,
        metrics_path: str | os.PathLike | None = None,
        tensorboard_dir: str | os.PathLike | None = None, loggers: Any = (),
        tokens_per_sample: int | None = None,
        peak_flops: float | None = None, compile: bool | dict[str, Any] = False,
        environ: dict[str, str] | None = None, **misspelled: Any,
    ) -> None:
        # Bad input and lost peers end the process with one line, not a traceback.
        signals.install_excepthook()
        settings = Settings.from_environ(environ)
        signals.install_excepthook(show_traceback=settings.show_traceback,
                                   launched=settings.launched)
        config = {name: value for name, value in locals().items()
                  if name in RunConfig.__dataclass_fields__}
        config["strategy_options"] = {} if strategy_options is None else strategy_options
        # timeout_s=None: PARATRAIN_TIMEOUT_S when set, else RunConfig's default.
        if timeout_s is None:
            config.pop("timeout_s")
            if settings.timeout_s is not None:
                config["timeout_s"] = settings.timeout_s
        config.update(misspelled)
        self.config = group_checkpoint_dir(  # a misspelled name: one line
            RunConfig.from_arguments(config), settings.replica_group)
        self._closed = False
        self._peer_lost = False
        parts = build_parts(self.config, settings, environ)
        self.settings = settings
        self.topology = parts.topology
        self._owns_group = parts.owns_group
        self.strategy = parts.strategy
        self.precision = parts.precision
        self._health, self._hang, self._stop = parts.health, parts.hang, parts.stop
        self._lock = parts.lock  # checkpoint_dir's, on rank 0
        self.reporter = parts.reporter
        self.throughput = parts.throughput
        """Tokens/s and MFU derived from the samples/s (see :mod:`paratrain.run.flops`)."""
        self._flop_counter = parts.flop_counter
        notice = self.strategy.notice()
        if notice:
            self.print(notice)
        seed_everything(self.config.seed)
        self.state = RunState(config=self.config, topology=self.topology,
                              strategy=self.strategy, precision=self.precision,
                              print_fn=self.print, trackers=self.reporter.trackers)
        if self.reporter.trackers is not None:  # a checkpoint tells trackers its step
            self.reporter.trackers.current_step = lambda: self.global_step
        self._init_step_checks()
        self.epoch_stats: list[dict[str, float]] = []
        self._router_load: RouterLoad | None = None  # tokens per expert, for the epoch row
        self._step = StepState(self.config.accumulate)  # the micro-steps' shared state
        self._compile: CompileOptions | None = None
        self._compile_clock = CompileClock(enabled=False)
        self._train_loader: DistributedLoader | None = None
        self._epoch_start = (0, time.perf_counter())
        self._samples = SampleCounter()  # of user loaders iterated through progress()
        self._stragglers = StragglerDetector.for_run(  # only observes: same losses
            self.config.stragglers, health=self._health, device=self.device,
            lockstep=self.strategy.data_parallel_size == self.world_size,
            print_fn=self.print, log=self.reporter.log)
        self._replicas = replica_groups(self.config.fault_tolerance, settings, self.topology,
                                        self.print, self.strategy, self.config.precision)
        self._after_step: list[AfterStep] = [
            self._replicas.next_step,  # the next step's quorum, before anything else
            FaultHook(parts.faults),
            HealthHook(self._health),
            hooks.StragglerHook(self._stragglers, lambda: self._train_loader),
            PeriodicSave(self.config.checkpoint_every, self.save),
            # A stop exits right after: its checkpoint is written before save returns.
            StopOnSignal(self._stop, functools.partial(self.save, wait=True), self.close,
                         self.print, self.config.checkpoint_dir),
        ]

    # -- identity ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.is_main

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (not micro-batches)."""
        return self.state.global_step

    # -- setup ------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                scheduler: Any = None) -> Any:
        """Place and wrap ``model`` for the strategy; return ``(model, optimizer)`` or ``model``.

        After this, every rank draws different random numbers (dropout, augmentation):
        the global RNGs are reseeded with ``seed + 1 + rank``, except that tensor-parallel
        peers share their lowest peer's rank (``strategy.random_stream_rank``).
        """
        misuse.check_not_prepared(model, self.state.models, self.strategy.unwrap)
        if optimizer is not None:
            misuse.check_optimizer_matches(model, optimizer)
            notice = misuse.optimizer_notice(optimizer, self.device)
            if notice:
                self.print(notice)
        misuse.check_scheduler_matches(optimizer, scheduler)
        for notice in (misuse.router_loss_notice(model),
                       self._flop_counter.skip_user_compiled(model)):
            if notice:
                self.print(notice)
        if self.strategy.data_parallel_size == self.world_size:
            # Every rank holds (a shard of) the same model: compare shapes before any
            # wrapper communicates, since a wrapper fails obscurely on a mismatch.
            # Pipeline stages and parameter servers hold different parts.
            with self._guard_peers():
                self._health.check_model(model)
        if self.config.checkpoint_activations is not None:
            if isinstance(self.strategy, OrdersParallelisms):
                # At its place in the layout's order (after tp/cp/ep, before FSDP).
                self.strategy.configure_activation_checkpointing(
                    self.config.checkpoint_activations)
            else:
                apply_activation_checkpointing(model, self.config.checkpoint_activations)
        if self.config.sync_batchnorm:
            model = convert_sync_batchnorm(model, group=self.strategy.data_parallel_group,
                                           group_size=self.strategy.data_parallel_size,
                                           device_type=self.device.type)
        model = self.precision.convert_module(model, float8=self.config.float8,
                                              strategy=self.strategy)
        self._configure_compile()  # after checkpointing: compile sees the recompute
        # Wrapping communicates (DDP broadcasts the parameters): a peer lost here is one
        # line too.
        with self._guard_peers():
            before, given = self._optimizers.parameters_of(model), optimizer  # see record
            model = setup_model(self.strategy, model, optimizer)  # a meta one too
            if optimizer is not None:
                prepared = self.strategy.setup_optimizer(optimizer)
                if scheduler is not None and prepared is not optimizer:
                    # Rebuilt over the strategy's new parameters: schedule the new one.
                    _compat.rebind_lr_scheduler(scheduler, prepared)
                optimizer = prepared
        if isinstance(self.strategy, ServerRole) and self.strategy.serve(model, optimizer):
            # A non-training role (parameter server) finished its work: leave cleanly.
            self.close()
            raise SystemExit(0)
        self._wrap_forward(model)
        self._stragglers.watch(model)
        self._router_load = RouterLoad.attach(model) or self._router_load
        self.state.register(model, optimizer, scheduler)
        self._optimizers.record(before, self.strategy.unwrap(model), given, optimizer)
        seed_everything(self.config.seed + 1 + self.strategy.random_stream_rank)
        return model if optimizer is None else (model, optimizer)

    def loader(self, dataset: Dataset, *, batch_size: int, shuffle: bool = True,
               drop_last: bool = False, num_workers: int = 0, pin_memory: bool | None = None,
               persistent_workers: bool = True, collate_fn: Any = None, batched: bool = True,
               device_resident: bool = False) -> DistributedLoader:
        """A training loader over this rank's shard; reshuffled each epoch by :meth:`epochs`.

        ``batch_size`` is per rank; the global batch is ``batch_size * data-parallel size``.
        With ``drop_last=False`` the last samples are padded from the start of the
        epoch so every rank takes the same number of steps; ``drop_last=True`` drops
        those that do not fill a whole global batch. Built inside :meth:`epochs`, it
        starts at the current epoch's shuffle and position. ``batched`` gathers each
        batch of an in-memory dataset with one indexing operation (same batches, see
        docs/performance.md); ``device_resident`` keeps such a dataset on the GPU.
        """
        return self._make_loader(dataset, batch_size=batch_size, shuffle=shuffle, pad=True,
                                 drop_last=drop_last, num_workers=num_workers,
                                 pin_memory=pin_memory, persistent_workers=persistent_workers,
                                 collate_fn=collate_fn, train=True, batched=batched,
                                 device_resident=device_resident)

    def eval_loader(self, dataset: Dataset, *, batch_size: int, num_workers: int = 0,
                    collate_fn: Any = None, batched: bool = True,
                    device_resident: bool = False) -> DistributedLoader:
        """An evaluation loader: every sample exactly once across ranks (no padding)."""
        return self._make_loader(dataset, batch_size=batch_size, shuffle=False, pad=False,
                                 drop_last=False, num_workers=num_workers, pin_memory=None,
                                 persistent_workers=False, collate_fn=collate_fn, train=False,
                                 batched=batched, device_resident=device_resident)

    def _make_loader(self, dataset: Dataset, *, batch_size: int, shuffle: bool, pad: bool,
                     drop_last: bool, num_workers: int, pin_memory: bool | None,
                     persistent_workers: bool, collate_fn: Any, train: bool, batched: bool,
                     device_resident: bool) -> DistributedLoader:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        check_map_style(dataset, "run.loader()" if train else "run.eval_loader()")
        rank, replicas = self.strategy.data_parallel_rank, self.strategy.data_parallel_size
        if train:  # fault tolerant: each replica group its share (evaluation: every group all)
            rank, replicas = self._replicas.data_shard(rank, replicas)
        sampler = ShardedSampler(
            len(dataset), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=self.config.seed,
            drop_last=drop_last, pad=pad, batch_size=batch_size,
        )
        loader = build_loader(
            dataset, sampler, batch_size=batch_size, device=self.device,
            num_workers=num_workers,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
            persistent_workers=persistent_workers, collate_fn=collate_fn, batched=batched,
            device_resident=device_resident,
        )
        # This rank's part of each batch (context parallel: a slice of every sequence).
        loader.local_batch = self.strategy.local_batch
        if train:
            self._check_static_batches(sampler, batch_size)
            self._train_loader = loader
            self.state.register_loader(loader)
        return loader

    # -- the loop ---------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield epoch numbers, resuming where a checkpoint left off.

        Before each epoch the training loaders are reseeded (a new shuffle); a
        resumed epoch starts at the checkpoint's sample offset. After each epoch
        the global samples/s are recorded in :attr:`epoch_stats`.
        """
        misuse.check_num_epochs(num_epochs)
        self.state.maybe_resume(num_epochs)  # says so when the checkpoint is already done
        self._join_replica_groups()  # fault tolerant: a group that came back heals here
        while self.state.epoch < num_epochs:
            epoch = self.state.epoch
            self._epoch_start = (self.state.start_epoch(epoch), time.perf_counter())
            self._samples.restart()
            yield epoch
            self._finish_accumulation()
            # Router load summed over the ranks that saw different tokens (collective).
            routed = (self._router_load.epoch_metrics(self.strategy.loss_group,
                                                      reduce=self.strategy.loss_size > 1)
                      if self._router_load is not None else {})
            stats = {"epoch": epoch, **self.epoch_throughput(), **strategy_metrics(self.strategy),
                     **routed, "skipped_steps": self._finite.take_epoch_skipped(),
                     **self._stragglers.take_epoch()}
            self.epoch_stats.append(stats)
            self.reporter.log(stats, step=self.global_step)
            self.state.epoch = epoch + 1

    def epoch_throughput(self) -> dict[str, float | None]:
        """Global samples (of ``run.loader``, or handed out by :meth:`progress` from
        another loader), seconds and samples/s of the current epoch so far.

        Also ``tokens_per_s`` (with ``tokens_per_sample``), ``tflops_per_device``
        once the first step's FLOPs are counted, and ``mfu`` (None when n/a). With
        ``compile``, ``compile_s`` is the first step's time, which the rates leave out,
        ``graphs`` the graphs compiled so far and ``recompiles`` those after the first step.
        """
        start_offset, start_time = self._epoch_start
        elapsed = time.perf_counter() - start_time
        loader, counted = self._train_loader, self._samples.in_epoch
        samples = counted if counted or loader is None else loader.position - start_offset
        speed = samples / elapsed if elapsed > 0 else 0.0
        compiled = self._compile_clock.report(self._compile) if self._compile_clock.enabled \
            else {}
        return {"samples": samples, "seconds": elapsed, "samples_per_s": speed,
                **self.throughput.rates(speed), **compiled}

    def progress(self, batches: Iterable[Any], *, desc: str | None = None) -> Iterator[Any]:
        """Iterate ``batches`` with a rank-0 progress bar counting global samples."""
        batches, remaining, per_batch = self._samples.plan(batches,
                                                           self.strategy.data_parallel_size)
        desc = desc or f"epoch {self.state.epoch}"
        return self.reporter.progress(batches, total_samples=remaining,
                                      samples_per_batch=per_batch, desc=desc,
                                      rates=self._stragglers.bar_rates(self._bar_rates))

    # -- checkpoints --------------------------------------------------------------
    def save(self, directory: str | os.PathLike | None = None, *, wait: bool = False) -> str | None:
        """Write a resumable checkpoint; returns its path (None on ranks that do not write).

        With ``async_save=True`` it returns once the state is copied off the device and
        the file is written in the background (complete before the next save and at
        :meth:`close`); ``wait=True`` returns only once it is written on every rank.
        """
        if self._step.micro_step:
            raise ValueError(
                "save() was called in the middle of a gradient-accumulation group; "
                "call it after a run.step() that stepped the optimizer"
            )
        self._finite.settle()  # a non-finite step stops the run before it is saved
        return self.state.save(directory, wait=wait)

    def load(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, data position, step and RNG states from ``path``."""
        self.state.load(path)

    # -- lifetime -----------------------------------------------------------------
    def close(self) -> None:
        """Release wrapped modules, then the process group. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        # A background checkpoint write ends first: a sharded one needs the process group.
        failed = self.state.finish_saves(agree=not self._peer_lost)
        if self._lock is not None:  # no write is in flight any more
            self._lock.release()
        self._count_flops_done()  # a run that never called backward
        self._hang.close()
        self._optimizers.close()
        self.reporter.close()
        self.state.release()
        # After a lost peer the pending agreement can only time out: do not wait for it.
        self._stop.close(wait=not self._peer_lost)
        self._replicas.close()
        self.strategy.teardown()
        self.precision.restore()
        if self._owns_group:
            destroy_process_group()
        if failed is not None:
            raise failed

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
