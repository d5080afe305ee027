"""Turning a :class:`RunConfig` and the environment into the pieces a :class:`Run` drives.

``build_parts`` is the one place that wires topology, process group, strategy, precision
and the monitors together, in a fixed order (each step may depend on the ones before).
When a step fails, what was already built is released before the error propagates, so
a bad argument never leaves a process group or a signal handler behind.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.checkpoint.files import CheckpointError
from paratrain.checkpoint.lock import CheckpointDirInUse, DirectoryLock, acquire, job_of
from paratrain.config import RunConfig
from paratrain.distributed.process_group import destroy_process_group, init_process_group
from paratrain.distributed.topology import Topology
from paratrain.parallel import Parallel
from paratrain.parallel.presets import resolve_strategy
from paratrain.precision import Precision
from paratrain.reliability import hang, health, signals
from paratrain.reliability.faults import FaultPlan
from paratrain.run import misuse
from paratrain.run.flops import FirstStepFlops, Throughput, device_peak_flops
from paratrain.run.reporting import MetricsLog, Reporter
from paratrain.settings import Settings
from paratrain.strategies import create_strategy
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import PrecisionPolicy
from paratrain.trackers.hub import TrackerHub, run_params, tracker_for

__all__ = ["RunParts", "build_parts", "guard_peers", "lock_checkpoint_dir"]


@dataclass(kw_only=True)
class RunParts:
    """Everything ``Run`` delegates to, built once per run."""

    config: RunConfig
    settings: Settings
    topology: Topology
    owns_group: bool
    strategy: Strategy
    precision: Precision
    health: health.HealthMonitor
    hang: hang.HangMonitor
    stop: signals.GracefulStop
    reporter: Reporter
    throughput: Throughput
    flop_counter: FirstStepFlops
    faults: FaultPlan
    lock: DirectoryLock | None = None
    """``checkpoint_dir``'s lock, held by rank 0 until ``Run.close()`` releases it."""


@contextlib.contextmanager
def guard_peers(monitor: health.HealthMonitor | None, on_lost: Any = None) -> Iterator[None]:
    """Turn a failed collective into a PeerLostError naming the lost rank and host."""
    try:
        yield
    except RuntimeError as exc:
        if monitor is None or not monitor.is_peer_failure(exc):
            raise
        if on_lost is not None:
            on_lost()
        raise monitor.lost_peer_error(exc) from exc


def build_parts(config: RunConfig, settings: Settings,
                environ: dict[str, str] | None) -> RunParts:
    """Build a run's pieces in order; on failure release what was built, then re-raise."""
    if config.checkpoint_dir is not None:
        # Here, not at the first save an epoch later.
        from paratrain.checkpoint.files import check_directory

        check_directory(config.checkpoint_dir)
    topology = Topology.from_env(environ, accelerator=config.accelerator, settings=settings)
    owns_group = init_process_group(topology, timeout_s=config.timeout_s,
                                    wait_report_s=settings.wait_report_s)
    strategy: Strategy | None = None
    monitor_hang: hang.HangMonitor | None = None
    stop: signals.GracefulStop | None = None
    lock: DirectoryLock | None = None
    try:
        layout = config.parallel
        if layout is None and settings.parallel is not None:
            layout = Parallel.from_environment(settings.parallel)
        resolved = resolve_strategy(
            config.strategy, config.strategy_options, layout,
            world_size=topology.world_size, local_world_size=topology.local_world_size,
            replica_groups=topology.replica_groups)
        strategy = create_strategy(resolved.name, topology, resolved.options,
                                   timeout_s=config.timeout_s, layout=resolved.layout)
        misuse.check_ps_servers(strategy.name, settings.ps_servers)
        precision = Precision(config.precision, topology.device.type, tf32=config.tf32)
        if isinstance(strategy, PrecisionPolicy):
            strategy.configure_precision(precision)
        # Once, cheaply: a node started with other settings fails here, not mid-run.
        monitor = health.HealthMonitor(
            topology=topology, every=settings.health_every,
            restarts_left=max(0, settings.max_restarts - settings.restart_count))
        with guard_peers(monitor):
            monitor.check_config(config)
            lock = lock_checkpoint_dir(config, topology, monitor.group, environ)
        # Records the collectives each rank enters; names the stuck one.
        monitor_hang = hang.HangMonitor(
            rank=topology.rank, world_size=topology.world_size, hosts=monitor.hosts,
            warn_after_s=hang.warn_after_s(config.timeout_s, settings.collective_warn_s))
        # Step checks and the SIGTERM agreement need every rank to take every step
        # (not so for parameter servers or pipeline stages).
        lockstep = strategy.data_parallel_size == topology.world_size
        if not lockstep:
            monitor.every = 0
        stop = signals.GracefulStop(group=monitor.group,
                                    enabled=config.checkpoint_dir is not None and lockstep,
                                    grace_s=settings.term_grace_s,
                                    requeue_signal=settings.requeue_signal,
                                    slurm_job_id=settings.slurm_job_id, main=topology.is_main)
        trackers = _trackers(config, strategy, topology)
        # loggers=["tensorboard"] writes tensorboard_dir itself: not twice.
        board = None if "tensorboard" in config.loggers else config.tensorboard_dir
        metrics = None
        if topology.is_main and (config.metrics_path or board):
            metrics = MetricsLog(config.metrics_path, board)
        reporter = Reporter(is_main=topology.is_main, show_progress=config.progress,
                            metrics=metrics, trackers=trackers)
        peak = device_peak_flops(device=topology.device, precision=config.precision,
                                 override=config.peak_flops)
        throughput = Throughput(
            tokens_per_sample=config.tokens_per_sample, peak_flops=peak, flops_per_sample=None,
            replicas=strategy.data_parallel_size, on_gpu=topology.device.type == "cuda")
        faults = FaultPlan.from_settings(settings, rank=topology.rank)
    except BaseException:
        # Nothing built may outlive a failed Run(): not the signal handlers, not the
        # hang monitor's thread, not the process group, not the checkpoint_dir's lock.
        if lock is not None:
            lock.release()
        if stop is not None:
            stop.close(wait=False)
        if monitor_hang is not None:
            monitor_hang.close()
        if strategy is not None:
            strategy.teardown()
        if owns_group:
            destroy_process_group()
        raise
    return RunParts(
        config=config, settings=settings, topology=topology, owns_group=owns_group,
        strategy=strategy, precision=precision, health=monitor, hang=monitor_hang, stop=stop,
        reporter=reporter, throughput=throughput,
        # Counted only when MFU can be reported: CPU runs without peak_flops do no extra work.
        flop_counter=FirstStepFlops(enabled=peak is not None),
        faults=faults, lock=lock)


def lock_checkpoint_dir(config: RunConfig, topology: Topology, group: Any,
                        environ: dict[str, str] | None) -> DirectoryLock | None:
    """Rank 0 takes ``checkpoint_dir``'s lock; every rank learns the outcome (collective on
    ``group``, the health monitor's gloo group) and raises the same one line if refused."""
    if config.checkpoint_dir is None:
        return None
    lock, refused = None, None
    if topology.is_main:
        try:
            lock, notice = acquire(config.checkpoint_dir,
                                   job=job_of(os.environ if environ is None else environ))
            if notice:
                print(notice, flush=True)
        except CheckpointError as exc:
            refused = str(exc)
        except OSError as exc:
            refused = (f"checkpoint_dir {str(config.checkpoint_dir)!r}: its lock cannot be "
                       f"taken ({exc.strerror or exc}); pass a writable local or shared directory")
    if group is not None:
        import torch.distributed as dist

        box = [refused]
        dist.broadcast_object_list(box, src=0, group=group)
        refused = box[0]
    if refused is not None:
        raise CheckpointDirInUse(refused)
    return lock


def _trackers(config: RunConfig, strategy: Strategy, topology: Topology) -> TrackerHub:
    """``config.loggers`` as a hub on rank 0 (an empty one elsewhere).

    Resolved on every rank, so that a missing client package is one line on all of them.
    """
    from paratrain.distributed.device import peak_memory_bytes

    trackers = [tracker_for(spec, tensorboard_dir=config.tensorboard_dir)
                for spec in config.loggers]
    directory = Path(config.checkpoint_dir) / "trackers" if config.checkpoint_dir else \
        Path("paratrain-trackers")
    params = run_params(
        config, world_size=topology.world_size, layout_strategy=strategy.name,
        data_parallel_size=strategy.data_parallel_size,
        layout=strategy.layout_line or f"{strategy.name}: {strategy.data_parallel_size} "
                                       f"data-parallel of {topology.world_size}")
    return TrackerHub(trackers if topology.is_main else [],
                      directory=directory, params=params,
                      memory=functools.partial(peak_memory_bytes, topology.device))
