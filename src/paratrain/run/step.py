"""The step of ``Run``: backward, accumulation, clipping, the optimizer step and what follows.

Kept apart from :mod:`paratrain.run` (set-up, data, evaluation, checkpoints) so the
layers of a step read in one place: ``step`` -> ``_optimizer_step`` (accumulate, clip,
step) -> the after-step hooks (faults, health, periodic save, SIGTERM/SIGINT), with
``forward``/``backward`` under ``no_sync`` on every micro-step but the last.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from paratrain import compile as compiling
from paratrain.compiled_step import CompiledOptimizerStep
from paratrain.data.loader import DataCursor, ShardedSampler
from paratrain.run import misuse
from paratrain.run.build import guard_peers
from paratrain.run.finite import FiniteGuard
from paratrain.run.prepared import PreparedOptimizers, SchedulerSteps
from paratrain.run.seeding import reseed_lost_streams
from paratrain.run.spikes import spike_guard
from paratrain.strategies.capabilities import require_compile


class TrainStep:
    """The training-step methods of :class:`paratrain.Run` (which owns every attribute)."""

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping at the last step (with ``max_grad_norm``).

        Kept on the device by the step and read only here, so that a step does not wait
        for the device; reading it waits for that step's gradients.
        """
        norm = self._step.last_grad_norm
        return None if norm is None else float(norm)

    def _init_step_checks(self) -> None:
        """The checks of a step: the right optimizer and schedulers, finite losses."""
        self._optimizers = PreparedOptimizers(self.strategy.name)
        self._scheduler_steps = SchedulerSteps()
        self._finite = FiniteGuard(
            policy=self.config.nan, agree=self.strategy.agree_flags, rank=self.rank,
            device=self.device, scaled=self.precision.scaler is not None,
            records=self.state.nonfinite_batches, warn=self.print,
            spikes=spike_guard(self.config.spike, self.state.loss_spikes, self.print))
        self._compiled_step: CompiledOptimizerStep | None = None  # compile['optimizer']

    def _join_replica_groups(self) -> None:
        """Fault tolerant: the first quorum; a group that came back resumes at its healing
        peer's data cursor, with fresh random streams (as after a resume on another world
        size), since its own streams died with it."""
        # A peer healing from this rank continues where a checkpoint of it would: at the
        # next sample (after an epoch's last batch, the next epoch's first).
        cursor = self._replicas.join(self.state, self.precision,
                                     lambda: self.state.loaders.cursor(self.state.epoch),
                                     restarted=self.settings.restart_count > 0)
        if cursor is not None:
            self.state.resume_at(cursor)
            reseed_lost_streams(self.config.seed, self.strategy.random_stream_rank,
                                self.state.global_step)

    def _data_cursor(self) -> DataCursor:
        loader = self._train_loader
        return loader.cursor if loader is not None else DataCursor(epoch=self.state.epoch,
                                                                   offset=0)

    def _bar_rates(self, samples_per_s: float) -> dict[str, float | None]:
        """The progress bar's rates (:class:`~paratrain.run.flops.Throughput`) and the
        optimizer steps skipped so far, once there are any."""
        rates = self.throughput.bar_rates(samples_per_s)
        skipped = self._finite.skipped_steps
        return {**rates, "skipped_steps": skipped} if skipped else rates

    def _configure_compile(self) -> None:
        """Hand ``compile`` to the strategy before ``setup_model`` (CUDA graphs checked)."""
        options = compiling.CompileOptions.from_config(self.config.compile)
        if options is None:
            return
        strategy = require_compile(self.strategy)
        options, fallback = compiling.resolve(
            options, device=self.device, precision=self.config.precision,
            strategy_reason=strategy.cuda_graphs_blocker())
        if fallback:
            self.print(fallback)
        strategy.configure_compile(options)
        self._compile = options
        if self._compiled_step is None:
            self._compiled_step = CompiledOptimizerStep.configure(
                options, strategy=self.strategy, print_fn=self.print)
        self._compile_clock.enabled = True

    def _check_static_batches(self, sampler: ShardedSampler, batch_size: int) -> None:
        if self._compile is not None and self._compile.cuda_graphs:
            notice = compiling.partial_batch_notice(
                samples_per_rank=sampler.total_size // sampler.num_replicas,
                batch_size=batch_size)
            if notice:
                self.print(notice)

    def backward(self, loss: torch.Tensor, *, count: torch.Tensor | float | None = None) -> None:
        """Backward pass of ``loss``, scaled for accumulation and precision.

        Without ``count``, ``loss`` is a mean and the update is the mean over the
        micro-batches of the accumulation group. With ``count``, ``loss`` is a *sum*
        over ``count`` elements (tokens, samples, total weight) of this micro-batch,
        and the update is divided by the count summed over all ranks and micro-steps
        (see :mod:`paratrain.losses`).
        """
        self._step.saw_backward(count)
        # The update must be the mean over all micro-batches of the group, so each
        # micro-batch's loss counts 1/accumulate.
        if self.config.accumulate > 1 and count is None:
            loss = loss / self.config.accumulate
        if count is None:
            # Context parallel: a mean over this rank's slice of the sequences, weighted so
            # that its average over the loss group is the mean over every token.
            factor = self.strategy.mean_loss_factor()
            if factor != 1.0:
                loss = loss * factor
        try:
            with self._guard_peers(), self._hang.phase("backward"):
                self.strategy.backward(self.precision.scale_loss(loss))
            # After backward: a pipeline's loss has its value only then.
            self._finite.saw_loss(loss)
        finally:
            self._count_flops_done()
        if self._compiled_step is None:  # else the first optimizer step compiles too
            self._stop_compile_clock()
        self._step.close_no_sync()

    def _stop_compile_clock(self) -> None:
        if self._compile_clock.stop():
            # The compiling step is reported as compile_s, not in the epoch's samples/s.
            loader = self._train_loader
            self._epoch_start = (loader.position if loader is not None else 0,
                                 self._compile_clock.stopped_at)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """End a micro-step; on the last one of an accumulation group, update the weights.

        Returns True at the end of a group: the optimizer stepped (or, with
        ``16-mixed``, the scaler skipped an overflowed step; see
        ``run.precision.skipped_steps``). Gradients are zeroed after it.
        """
        self._count_flops_done()  # in case backward bypassed run.backward
        if not self._step.advance(self._train_loader):
            return False
        misuse.check_step_has_gradients(backward_called=self._step.backward_seen,
                                        models=self.state.models, optimizer=optimizer)
        self._optimizers.check_step(optimizer, self.state.models)
        self._scheduler_steps.check(self.state.schedulers, self.state.global_step)
        with self._guard_peers(), self._hang.phase("step"):
            self._optimizer_step(optimizer)
        return True

    def _guard_peers(self) -> contextlib.AbstractContextManager:
        """Turn a failed collective into a PeerLostError naming the lost rank and host."""
        return guard_peers(self._health, on_lost=self._mark_peer_lost)

    def _mark_peer_lost(self) -> None:
        self._peer_lost = True

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        state = self._step
        group_size = state.micro_step
        correction = 1.0
        if state.counts.active:
            # Summed losses: divide by the global count of the group (all ranks).
            correction = state.counts.gradient_factor(self.strategy)
        elif group_size < self.config.accumulate:
            # Documented rule for a partial group at the end of an epoch: it is
            # stepped as a smaller batch, i.e. the mean over the micro-batches it has.
            correction = self.config.accumulate / group_size
        state.group_done()
        if correction != 1.0:
            for model in self.state.models:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(correction)
        self._replicas.average_gradients(self.state.models)  # over replica groups (torchft)
        if self.config.max_grad_norm is not None:
            # The norm must be of the true gradients, so the scaler's factor goes first.
            self.precision.unscale(optimizer)
            norms = [self.strategy.clip_grad_norm(m, self.config.max_grad_norm)
                     for m in self.state.models]
            # A tensor: converting it here would wait for the device every step.
            state.last_grad_norm = torch.stack([n.float() for n in norms]).norm()
            self._finite.saw_grad_norm(state.last_grad_norm)
        step = self.state.global_step + 1
        # nan="skip": a non-finite step is not applied (grads zeroed, schedulers held).
        skip = self._finite.before_update(step, self._train_loader, loss_factor=correction)
        committed = self._replicas.commit(step)  # False: a replica group failed in this step
        skip = skip or not committed
        if skip:  # no update; a GradScaler still checks the gradients and updates its scale
            self.precision.step(optimizer, lambda: None)
        step_with = self._compiled_step or self.strategy.optimizer_step
        stepped = not skip and self.precision.step(optimizer, lambda: step_with(optimizer))
        if committed:  # an uncommitted step is not the loss scaler's skip
            self._finite.after_update(stepped, step)
        if self._compiled_step is not None and stepped:  # the first step compiled it
            self._stop_compile_clock()
        optimizer.zero_grad(set_to_none=True)
        if stepped:
            for scheduler in self.state.schedulers:
                scheduler.step()
            self._scheduler_steps.stepped(self.state.schedulers, step)
        self.state.global_step += 1
        cursor = self._data_cursor()
        for hook in self._after_step:
            hook(self.state.global_step, cursor)

    def _finish_accumulation(self) -> None:
        if self._step.abandon():
            # The loop left the epoch mid-group (e.g. a break): drop the partial gradients.
            for optimizer in self.state.optimizers:
                optimizer.zero_grad(set_to_none=True)
        self._finite.settle()  # the epoch's last step: warn before the epoch ends

    def _count_flops_done(self) -> None:
        if self._flop_counter.active:
            self._flop_counter.stop()
            self.throughput.flops_per_sample = self._flop_counter.flops_per_sample

    def _wrap_forward(self, model: nn.Module) -> None:
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and model.training:
                # The first training micro-step (forward to backward) is counted for MFU.
                self._flop_counter.start(args, kwargs)
                self._compile_clock.start()
                if self._compile is not None and self._compile.cuda_graphs:
                    # A new micro-step: the previous replay's outputs may be reused.
                    torch.compiler.cudagraph_mark_step_begin()
            step = self._step
            if (torch.is_grad_enabled() and model.training and not step.no_sync_open
                    and not step.at_boundary(self._train_loader)):
                # Not the last micro-step: forward and backward run inside no_sync so
                # gradients accumulate locally; the context closes after backward.
                step.open_no_sync(self.strategy.no_sync(model))
            # DDP's forward may communicate (buffers)
            with self._guard_peers(), self._hang.phase("forward"):
                return self.precision.forward(original, *args, **kwargs)

        model.forward = forward  # type: ignore[method-assign]

