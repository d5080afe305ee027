"""Typed run configuration, validated once with errors that name the bad field."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from typing import Any

from paratrain.fieldtypes import check_types
from paratrain.trackers.base import Tracker, check_loggers

PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true", "float8")
NAN_POLICIES = ("stop", "skip", "warn")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that shapes a run, apart from the user's model, optimizer and data."""

    strategy: str = "auto"
    """Name of the parallel strategy: ``auto`` (``ddp`` when launched with several
    processes, ``single`` otherwise), ``single``, ``dp``, ``ddp`` or one added later."""

    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen strategy, e.g. ``{"bucket_cap_mb": 25}`` for ``ddp``."""

    parallel: Any = None
    """The layout as degrees: a ``paratrain.Parallel``, a dict of its fields or a string
    such as ``"dp_shard=4,tp=2"`` (one degree may be -1: fill the world). With the default
    ``strategy="auto"`` it picks the code that runs the layout; with a named strategy it
    must describe the same degrees. None: ``PARATRAIN_PARALLEL`` (``paratrain launch
    --parallel``) when set. See docs/strategies.md."""

    sync_batchnorm: bool = False
    """Convert every BatchNorm layer to ``SyncBatchNorm`` in ``run.prepare`` so that the
    batch statistics are taken over the global batch (the data-parallel ranks), as one
    process would."""

    precision: str = "32"
    """Numeric precision: ``32``, ``bf16-mixed``, ``16-mixed``, ``bf16-true`` or ``float8``
    (``bf16-mixed`` with the Linears in torchao's float8; ``pip install 'paratrain[float8]'``,
    see docs/precision.md)."""

    float8: Any = None
    """Options of ``precision="float8"``: a :class:`paratrain.float8.Float8`, a dict of its
    fields (``{"recipe": "rowwise", "skip": ["lm_head"]}``) or None (tensorwise, the output
    head kept bfloat16). Refused with any other precision."""

    tf32: bool = True
    """On a CUDA GPU, float32 matmuls run on TF32 tensor cores
    (``torch.set_float32_matmul_precision("high")``) unless the process already chose a
    matmul precision; ``run.close`` restores it. False keeps full float32 products."""

    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""

    max_grad_norm: float | None = None
    """Clip gradients to this global L2 norm before each optimizer step."""

    nan: str = "stop"
    """What a non-finite (NaN/inf) loss, or gradient norm with ``max_grad_norm``, does:
    ``stop`` (one line naming the step, the ranks and the batch, before the step's
    update), ``skip`` (no update, no scheduler step, counted in
    ``run.epoch_stats``' ``skipped_steps``; 8 in a row stop) or ``warn`` (one warning
    line, training goes on). Under ``16-mixed`` the loss scaler skips such steps itself
    and 8 in a row stop the run. See ``docs/precision.md``."""

    spike: Any = None
    """Loss-spike check: a :class:`paratrain.run.spikes.Spike`, a dict of its fields
    (``factor``, ``window``, ``policy``), True (factor 3 over a window of 50 losses,
    ``skip``) or None (off). A loss above ``factor`` times the largest of the last
    ``window`` losses stops, skips the batch or warns. See ``docs/precision.md``."""

    stragglers: Any = True
    """Name a rank slower than the others (in forward compute or data wait) in one line:
    True (every 50 steps, 1.2x the median for 3 checks), False or None (off), or a dict
    of :class:`paratrain.reliability.stragglers.Stragglers`' fields (``check_every``,
    ``margin``, ``patience``, ``min_share``). Multi-rank jobs where every rank takes every
    step; see docs/reliability.md."""

    fault_tolerance: Any = None
    """Options of fault-tolerant training across replica groups (torchft): a
    :class:`paratrain.FaultTolerance` or a dict of its fields; used when the job is
    started with ``paratrain launch --fault-tolerant`` (defaults then, when None). See
    docs/reliability.md."""

    checkpoint_activations: Any = None
    """Submodules whose activations are recomputed in backward to save memory: a
    module class, a class name, a dotted-path glob, a predicate ``fn(module) -> bool``
    or a list of classes and names (see ``paratrain.activation_checkpointing``)."""

    seed: int = 0
    """Seed for model initialisation, data order and per-rank randomness."""

    timeout_s: float = 300.0
    """Collective timeout in seconds: a lost peer fails the job after this long."""

    accelerator: str = "auto"
    """``auto``, ``cpu`` or ``cuda``. ``auto`` takes ``PARATRAIN_ACCELERATOR`` when it is
    set (``cpu`` keeps every process on the CPU with GPUs visible), else CUDA when visible.
    More processes per node than GPUs are refused unless ``PARATRAIN_SHARE_GPUS=1``
    (``paratrain launch --share-gpus``) shares them round-robin, for testing only."""

    checkpoint_dir: str | os.PathLike | None = None
    """Directory for resumable checkpoints; a run resumes from its newest one."""

    checkpoint_every: int | None = None
    """Write a checkpoint every this many optimizer steps (needs checkpoint_dir)."""

    keep_checkpoints: int = 2
    """How many complete checkpoints to keep in checkpoint_dir."""

    async_save: bool = False
    """Write checkpoints in the background: ``run.save()`` and ``checkpoint_every`` copy
    the state off the device and return; the write ends before the next save, at
    ``close()`` and at a SIGTERM stop. A hard kill during the write resumes from the
    previous checkpoint (see docs/checkpoints.md)."""

    progress: bool = True
    """Show a progress bar on rank 0."""

    metrics_path: str | os.PathLike | None = None
    """Append metrics on rank 0 to this ``.csv`` or ``.jsonl`` file."""

    tensorboard_dir: str | os.PathLike | None = None
    """Also write metrics to TensorBoard event files here (needs tensorboard)."""

    loggers: tuple[str | Tracker, ...] | list[str | Tracker] = ()
    """Experiment trackers rank 0 logs to: ``"mlflow"``, ``"wandb"``, ``"tensorboard"`` or
    :class:`paratrain.trackers.Tracker` instances (``MLflowTracker(tracking_uri=...)``).
    They get the configuration and layout, ``run.log`` rows and epoch statistics with the
    step; a resumed run continues the same tracker run; a failing tracker warns once and
    training goes on. Needs ``pip install 'paratrain[trackers]'``; see docs/trackers.md."""

    tokens_per_sample: int | None = None
    """Tokens in one sample (e.g. the sequence length): adds tokens/s to the bar,
    the epoch stats and the metrics log."""

    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU, overriding the table of known GPUs (needed
    on CPU and unlisted GPUs); 0 turns FLOP counting and MFU off."""

    compile: bool | dict[str, Any] = False
    """``torch.compile`` the model in ``run.prepare``: True, or a dict of its options
    (``mode``, ``fullgraph``, ``dynamic``, ``backend``, ``options``, ``scope``: per block
    or whole, ``optimizer``: the optimizer step too). The strategy places it (see
    ``docs/performance.md``); ``{"mode": "reduce-overhead"}`` adds CUDA graphs of the
    whole step."""

    @classmethod
    def from_arguments(cls, arguments: dict[str, Any], *,
                       also: tuple[str, ...] = ("environ",)) -> RunConfig:
        """The config of ``Run(**arguments)``; a misspelled name is one ValueError line
        with the closest valid name (``also``: ``Run``'s own arguments)."""
        known = [f.name for f in fields(cls)]
        for name in arguments:
            if name not in known:
                close = difflib.get_close_matches(name, [*known, *also], n=1)
                hint = f"did you mean {close[0]!r}?" if close else \
                    f"the arguments are {', '.join([*known, *also])}"
                raise ValueError(f"Run() got an unknown argument {name!r}; {hint}")
        return cls(**arguments)

    def __post_init__(self) -> None:
        from paratrain.compile import CompileOptions

        # Types first, one line each: the checks below assume them. precision,
        # accelerator and compile keep their own message, which lists the choices.
        check_types(RunConfig, {f.name: getattr(self, f.name) for f in fields(self)
                                if f.name not in ("precision", "accelerator", "compile",
                                                  "loggers")},
                    infinite_ok=("max_grad_norm",))  # inf: measure the norm, never clip
        for name in ("checkpoint_dir", "metrics_path", "tensorboard_dir"):
            if getattr(self, name) is not None:  # a pathlib.Path is a str from here on
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        CompileOptions.from_config(self.compile)
        if not isinstance(self.loggers, (tuple, list)):
            raise ValueError(f"loggers must be a list of tracker names or Tracker objects, "
                             f"e.g. ['mlflow'], got {self.loggers!r}")
        check_loggers(self.loggers)
        object.__setattr__(self, "loggers", tuple(self.loggers))
        if not isinstance(self.strategy, str) or not self.strategy:
            raise ValueError(f"strategy must be a strategy name, got {self.strategy!r}")
        if self.parallel is not None:
            from paratrain.parallel import Parallel

            Parallel.parse(self.parallel)
        if not isinstance(self.sync_batchnorm, bool):
            raise ValueError(f"sync_batchnorm must be True or False, got {self.sync_batchnorm!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.tf32, bool):
            raise ValueError(f"tf32 must be True or False, got {self.tf32!r}")
        if self.float8 is not None and self.precision != "float8":
            raise ValueError(f"float8 options were given with precision {self.precision!r}; "
                             "use precision='float8' or drop float8")
        if self.precision == "float8":
            from paratrain.float8 import Float8

            object.__setattr__(self, "float8", Float8.parse(self.float8))
        if self.nan not in NAN_POLICIES:
            raise ValueError(f"nan must be one of {NAN_POLICIES}, got {self.nan!r}")
        from paratrain.run.spikes import Spike

        object.__setattr__(self, "spike", Spike.parse(self.spike))
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1, got {self.accumulate!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        from paratrain.reliability.stragglers import Stragglers

        object.__setattr__(self, "stragglers", Stragglers.parse(self.stragglers))
        from paratrain.fault_tolerance.options import FaultTolerance

        object.__setattr__(self, "fault_tolerance", FaultTolerance.coerce(self.fault_tolerance))
        from paratrain.activation_checkpointing import validate_spec

        validate_spec(self.checkpoint_activations)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.accelerator not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"accelerator must be 'auto', 'cpu' or 'cuda', got {self.accelerator!r}"
            )
        if self.checkpoint_every is not None:
            if self.checkpoint_every < 1:
                raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
            if self.checkpoint_dir is None:
                raise ValueError("checkpoint_every needs checkpoint_dir to be set")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save must be True or False, got {self.async_save!r}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.tokens_per_sample is not None and (
                isinstance(self.tokens_per_sample, bool)
                or not isinstance(self.tokens_per_sample, int) or self.tokens_per_sample < 1):
            raise ValueError(
                f"tokens_per_sample must be an integer >= 1 or None, got {self.tokens_per_sample!r}"
            )
        if self.peak_flops is not None and (
                isinstance(self.peak_flops, bool) or not isinstance(self.peak_flops, (int, float))
                or not self.peak_flops >= 0):
            raise ValueError(
                f"peak_flops must be a number of FLOP/s >= 0 (e.g. 989e12) or None, "
                f"got {self.peak_flops!r}"
            )
        if self.metrics_path is not None and not self.metrics_path.endswith((".csv", ".jsonl")):
            raise ValueError(
                f"metrics_path must end in .csv or .jsonl, got {self.metrics_path!r}"
            )
