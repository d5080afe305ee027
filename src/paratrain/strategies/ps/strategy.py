"""``ps``: a parameter server with synchronous, asynchronous and bounded-staleness training.

Roles: of ``W`` processes the last ``K = num_servers`` ranks are servers and the
first ``W - K`` are workers, so rank 0 is always a worker: it prints, logs
metrics and writes checkpoints as with every other strategy. Each server owns a
balanced contiguous range of the optimizer's flattened parameters and an
optimizer (rebuilt from the user's, or from ``optimizer_factory``) over that
range; workers hold no optimizer state. On a server rank ``run.prepare()``
serves until every worker has closed its run, then closes the run and raises
``SystemExit(0)``, so the user's loop never runs there and the same script works
for ``ddp`` and ``ps``.

Per step a worker pushes its gradients (each server gets its range) and waits
for the parameters of its next step; the mode decides when they come (see
:mod:`paratrain.strategies.ps.server`). Messages are tensors sent point to
point (docs/parameter-server.md describes the protocol).

Example:
    >>> run = paratrain.Run(strategy="ps", strategy_options={"mode": "ssp", "staleness": 2})  # doctest: +SKIP
    # paratrain launch --nproc-per-node 4 --ps-servers 1 train.py
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.settings import Settings
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import ReportsMetrics, ServerRole
from paratrain.strategies.ps.protocol import FlatLayout
from paratrain.strategies.ps.server import ParameterServer
from paratrain.strategies.ps.worker import PSStats, WorkerClient

MODES = ("sync", "async", "ssp")
WEIGHTINGS = ("equal", "inverse")
SERVERS_ENV = "PARATRAIN_PS_SERVERS"


@dataclass(frozen=True, kw_only=True)
class PSOptions:
    """Options of the ``ps`` strategy."""

    num_servers: int | None = None
    """Server ranks (the last ranks of the job). None: ``PARATRAIN_PS_SERVERS`` (set by
    ``paratrain launch --ps-servers K``), else 1."""

    mode: str = "sync"
    """``sync``: average one gradient per worker per step (equals ``ddp``); ``async``:
    apply each gradient on arrival; ``ssp``: like sync, but a worker may run up to
    ``staleness`` steps ahead of the slowest."""

    staleness: int = 0
    """The ssp bound ``s`` (``ssp`` with 0 is ``sync``)."""

    staleness_weighting: str = "equal"
    """How much a gradient counts: ``equal``, or ``inverse`` to weight it by
    ``1 / (1 + staleness)`` (the staleness-aware rule of Zhang et al., 2016): an ssp
    round becomes the weighted average of its gradients, and an async update is
    scaled by the weight (for SGD a per-update learning rate; Adam mostly cancels a
    constant scale). Fresh gradients have weight 1, so ``sync`` is unchanged."""

    optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None
    """Builds a server's optimizer from its param groups (dicts with ``params`` and the
    user's hyperparameters). None: the class and defaults of the optimizer given to
    ``prepare``."""

    def __post_init__(self) -> None:
        if self.num_servers is not None and (
            not isinstance(self.num_servers, int) or self.num_servers < 1
        ):
            raise ValueError(f"num_servers must be an integer >= 1, got {self.num_servers!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0, got {self.staleness!r}")
        if self.staleness and self.mode != "ssp":
            raise ValueError(f"staleness applies to mode='ssp' only (mode is {self.mode!r}); "
                             "use mode='ssp' or leave staleness at 0")
        if self.staleness_weighting not in WEIGHTINGS:
            raise ValueError(f"staleness_weighting must be one of {WEIGHTINGS}, got "
                             f"{self.staleness_weighting!r}")
        if self.optimizer_factory is not None and not callable(self.optimizer_factory):
            raise ValueError("optimizer_factory must be callable (param groups -> optimizer)")


def resolve_num_servers(options: PSOptions, environ: Mapping[str, str]) -> int:
    """``num_servers`` from the options, else from the launcher's ``--ps-servers``
    (``Settings.ps_servers``), else 1."""
    if options.num_servers is not None:
        return options.num_servers
    return Settings.from_environ(environ).ps_servers or 1


class PSStrategy(Strategy, ServerRole, ReportsMetrics):
    """Workers push gradients to server ranks, which own parameters and optimizer state."""

    name = "ps"
    Options = PSOptions

    def __init__(self, topology, options=None, *, timeout_s: float = 300.0) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        self.num_servers = resolve_num_servers(self.options, os.environ)
        world = topology.world_size
        if world <= self.num_servers:
            raise ValueError(
                f"strategy 'ps' with num_servers={self.num_servers} needs more than "
                f"{self.num_servers} processes (servers plus at least one worker), got "
                f"{world}; start it with `paratrain launch --nproc-per-node N --ps-servers K`"
            )
        self.num_workers = world - self.num_servers
        self.worker_ranks = list(range(self.num_workers))
        self.server_ranks = list(range(self.num_workers, world))
        self.is_server = topology.rank >= self.num_workers
        self._groups_ready = False
        self._worker_group: dist.ProcessGroup | None = None
        self._wire_group: dist.ProcessGroup | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._client: WorkerClient | None = None
        self._saved_state: dict[int, dict[str, torch.Tensor]] | None = None
        self._last_stats: PSStats | None = None

    def notice(self) -> str:
        staleness = f", staleness {self.options.staleness}" if self.options.mode == "ssp" else ""
        return (f"parameter server: {self.num_workers} worker(s) (ranks 0-{self.num_workers - 1}),"
                f" {self.num_servers} server(s), mode {self.options.mode}{staleness}")

    # -- data-parallel layout: workers only ------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        return 0 if self.is_server else self.topology.rank

    @property
    def data_parallel_size(self) -> int:
        return self.num_workers

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        if not self._groups_ready:
            raise RuntimeError("strategy 'ps': call run.prepare(model, optimizer) before "
                               "collectives (mean, sum, gather, evaluate)")
        return self._worker_group

    # -- setup and the server role ------------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        if self._model is not None:
            raise ValueError("strategy 'ps' serves one model per run; prepare() was called twice")
        self._model = model.to(self.topology.device)
        return self._model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._optimizer = optimizer
        return optimizer

    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        if optimizer is None:
            raise ValueError("strategy 'ps' needs the optimizer: call run.prepare(model, "
                             "optimizer); the servers rebuild it on their shards")
        self._create_groups()
        layout = FlatLayout.from_optimizer(optimizer, self.num_servers)
        if self.is_server:
            server = ParameterServer(
                layout=layout, server_index=self.topology.rank - self.num_workers,
                worker_ranks=self.worker_ranks, mode=self.options.mode,
                staleness=self.options.staleness,
                staleness_weighting=self.options.staleness_weighting, optimizer=optimizer,
                optimizer_factory=self.options.optimizer_factory, group=self._wire_group,
                timeout_s=self.timeout_s,
            )
            server.serve()
            return True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._client = WorkerClient(layout=layout, params=params, server_ranks=self.server_ranks,
                                    num_workers=self.num_workers, group=self._wire_group)
        # Start from the servers' values, whatever each worker initialised.
        self._client.pull(self._lrs())
        return False

    def _create_groups(self) -> None:
        # new_group is collective over the whole job: servers and workers both get here.
        if dist.is_initialized():
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self._worker_group = dist.new_group(self.worker_ranks, timeout=timeout)
            if self.topology.backend == "nccl":
                # Receiving from whichever worker is ready (src=None) needs gloo: the
                # protocol runs on a gloo group over CPU copies of the tensors.
                self._wire_group = dist.new_group(backend="gloo", timeout=timeout)
        self._groups_ready = True

    def _lrs(self) -> list[float]:
        return [float(group["lr"]) for group in self._optimizer.param_groups]

    # -- the step -------------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Push this worker's gradients; the servers step; load the parameters they send."""
        self._client.push(self._lrs())

    # -- collectives among workers --------------------------------------------------------
    def _settle(self) -> None:
        # A worker waiting in a collective pushes nothing; in sync mode a worker that
        # is still stepping would wait forever for its gradient. Parking first lets the
        # others' rounds close without it until they reach the collective too.
        if self._client is not None and self.num_workers > 1:
            self._client.park(self._lrs(), if_changed=True)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._settle()
        return super().all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._settle()
        return super().all_gather(tensor)

    def agree_flags(self, flags: torch.Tensor) -> torch.Tensor:
        # Workers do not step together, not even in sync mode (a worker with fewer steps
        # finishes while the others go on, and the server averages whoever is left): a
        # per-step collective among them would mismatch. Each decides on its own flags.
        return flags.unsqueeze(0)

    def barrier(self) -> None:
        """Park: released once every worker that has not finished is parked."""
        self._settle()

    def gather_rng_states(self, blob: torch.Tensor) -> torch.Tensor:
        # Workers are ranks 0 .. num_workers - 1, so rows are indexed by global rank.
        return self.all_gather(blob)

    # -- checkpoints ------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The servers' parameters once every unfinished worker has parked here.

        Collective over workers (like every save). Workers that already finished do
        not hold the others back, and rank 0 also receives the optimizer state taken
        at the same point.
        """
        self._saved_state = self._client.park(self._lrs(), want_state=self.topology.is_main)
        return self.unwrap(model).state_dict()

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if not self.topology.is_main:
            return {}
        # torch's own per-parameter layout: loadable by any strategy and server count.
        return {"state": self._saved_state or {},
                "param_groups": optimizer.state_dict()["param_groups"]}

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        optimizer.load_state_dict({"state": {}, "param_groups": state["param_groups"]})
        if self.topology.is_main:
            per_param = {int(index): value for index, value in state["state"].items()}
            self._client.load(self._lrs(), per_param)
        # No worker pushes before the servers hold the loaded model and state.
        self._client.park(self._lrs(), want_state=False)

    # -- observability -------------------------------------------------------------------
    def stats(self) -> PSStats:
        """The servers' counters and staleness histograms (any worker; not collective)."""
        if self._client is None:
            raise RuntimeError("stats() is available on worker ranks after run.prepare()")
        return self._client.stats(self._lrs())

    def metrics(self) -> dict[str, Any]:
        """Update rate since the last call and staleness histograms, for rank 0's log."""
        if self._client is None or not self.topology.is_main:
            return {}
        stats, previous = self.stats(), self._last_stats
        self._last_stats = stats
        updates = stats.updates - (previous.updates if previous else 0)
        seconds = stats.elapsed_s - (previous.elapsed_s if previous else 0.0)
        overall = stats.histogram.sum(dim=0)
        count = int(overall.sum())
        mean = float((overall * torch.arange(overall.numel())).sum()) / count if count else 0.0
        out: dict[str, Any] = {"ps_updates": stats.updates,
                               "ps_updates_per_s": updates / seconds if seconds > 0 else 0.0,
                               "ps_staleness_mean": mean, "ps_staleness_max": stats.max_staleness}
        for worker, row in enumerate(stats.histogram.tolist()):
            out[f"ps_staleness_w{worker}"] = " ".join(f"{k}:{c}" for k, c in enumerate(row) if c)
        return out

    # -- lifetime ----------------------------------------------------------------------------
    def teardown(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                client.done(self._lrs())
            except RuntimeError:
                pass  # the servers are gone; whatever ended them is reported elsewhere
