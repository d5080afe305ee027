"""The process ``paratrain launch`` starts for each worker: it runs the user's script.

``python .../paratrain/launch_worker.py --script train.py ARGS`` behaves like
``python train.py ARGS`` (``--module pkg.train`` like ``python -m pkg.train``),
with three differences that only show at the end of the process:

* An ``atexit`` hook, registered before the script runs (so it runs after the
  script's own hooks), collects garbage and destroys a default process group the
  script left behind. A DDP reducer holds the group from inside a reference
  cycle; left to interpreter shutdown, gloo's threads were torn down there and
  the process sometimes aborted (``terminate called without an active
  exception``) after training had finished.
* Ctrl-C / SIGINT (which the launcher forwards when it is interrupted) ends
  the worker with exit code 130 and no ``KeyboardInterrupt`` traceback: the
  launcher prints the one line. During the runner's own start-up (importing
  torch) it ends the process at once.
* An uncaught error is recorded in torchrun's error file and not printed here:
  the launcher prints the error of the rank that failed first, once (see
  :func:`paratrain.reliability.signals.install_excepthook`).
"""

from __future__ import annotations

import os
import signal
import sys

_early_signals: list[int] = []  # requeue signals received while the runner started

if __name__ == "__main__":
    # Started as a file, so this folder is sys.path[0]: its modules (data.py, plan.py,
    # ...) must not shadow the user's. Ctrl-C while torch is imported leaves nothing
    # to clean up; a KeyboardInterrupt there would surface as a confusing ImportError.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))
    # Slurm's requeue signal (default USR1) would end the worker while torch loads;
    # noted here, main() hands it to paratrain.reliability.signals.hold.
    signal.signal(signal.SIGUSR1, lambda signum, frame: _early_signals.append(signum))

import atexit  # noqa: E402 - after the start-up guard above
import gc  # noqa: E402
import runpy  # noqa: E402
from types import TracebackType  # noqa: E402

from paratrain.reliability import signals  # noqa: E402
from paratrain.settings import Settings  # noqa: E402

_RUNPY = os.path.dirname(runpy.__file__)


def release_process_group() -> None:
    """Free cycles that hold the default process group, then destroy it (idempotent)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        gc.collect()
        return
    gc.collect()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; a peer may already be gone
        pass


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the frames of this runner and runpy (the user never wrote them)."""
    here = os.path.abspath(__file__)
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name == here or name.startswith(_RUNPY) or name.startswith("<frozen runpy")):
            break
        tb = tb.tb_next
    return tb


def main(argv: list[str] | None = None) -> int:
    """Run ``--script PATH ARGS`` or ``--module NAME ARGS``; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] not in ("--script", "--module"):
        print("usage: launch_worker.py --script PATH | --module NAME [ARGS]",
              file=sys.stderr)
        return 2
    mode, target, args = argv[0], argv[1], argv[2:]
    settings = Settings.from_environ()
    signals.install_excepthook(show_traceback=settings.show_traceback,
                               launched=settings.launched)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # unless it is the requeue signal:
    signals.hold(settings.requeue_signal,  # Run() takes it over; see GracefulStop
                 received=settings.requeue_signal in _early_signals)
    atexit.register(release_process_group)
    sys.argv = [target, *args]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if mode == "--module":
            sys.path.insert(0, os.getcwd())  # what `python -m` puts first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # What `python PATH` puts first on sys.path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except KeyboardInterrupt:
        return signals.EXIT_SIGINT
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported like an uncaught error
        sys.excepthook(type(exc), exc, _user_frames(exc.__traceback__))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
