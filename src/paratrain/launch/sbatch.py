"""``paratrain slurm [sbatch options] -- [launch flags] script.py args``: an sbatch script.

It writes a batch script that runs ``srun paratrain launch ...`` once per node, prints its
path, and with ``--submit`` hands it to ``sbatch``. The script asks Slurm for:

* ``--nodes``, one task per node (the launcher; it starts ``--nproc-per-node``
  processes), ``--cpus-per-task`` (default one core per process) and ``--gpus-per-node``;
* ``--signal=USR1@90``: USR1 90 s before the time limit, to the ``srun`` step (not the
  batch shell), which the runs turn into a checkpoint, ``scontrol requeue`` and exit 0
  (:class:`paratrain.reliability.signals.GracefulStop`); ``--requeue`` so that the job
  may go back to the queue, ``--open-mode=append`` so that the log keeps every attempt.

Options this command does not know (``--qos high``, ``--mem=64G``) are copied as
``#SBATCH`` lines. Inside the job ``paratrain launch`` reads the node count, node rank,
master address and port from Slurm (:mod:`paratrain.launch.slurm`).

Example::

    >>> text = render(build_parser().parse_args(["--nodes", "2", "--time", "1:00:00"]),
    ...               [], ["-m", "pkg.train", "--epochs", "3"], launcher="paratrain")
    >>> [line for line in text.splitlines() if line.startswith("srun")][0].split(" launch ")[1]
    '--nproc-per-node 1 -m pkg.train --epochs 3'
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["SbatchError", "build_parser", "main", "render"]

_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}(:\d{1,2})?)?)$")
_SIGNAL = re.compile(r"^(?:(?P<where>[A-Z]+):)?(?P<name>[A-Za-z0-9]+)(?:@(?P<seconds>\d+))?$")


class SbatchError(ValueError):
    """A request that would give a broken batch script; the message says how to fix it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain slurm", allow_abbrev=False,
        usage="paratrain slurm [options] [other sbatch options] -- [launch flags] SCRIPT [ARGS]",
        description="Write (and with --submit, submit) an sbatch script that runs "
                    "`srun paratrain launch` on every node, checkpoints and requeues itself.")
    add = parser.add_argument
    add("--nodes", "-N", type=int, default=1, help="nodes (default 1)")
    add("--nproc-per-node", type=int, default=None,
        help="processes per node (default: --gpus-per-node, else 1)")
    add("--gpus-per-node", type=int, default=0, help="GPUs per node (default none)")
    add("--cpus-per-task", type=int, default=None,
        help="cores for each node's processes together (default: one per process)")
    add("--time", "-t", default=None, help="time limit, e.g. 4:00:00 or 1-12:00:00")
    add("--partition", "-p", default=None, help="partition")
    add("--account", "-A", default=None, help="account to charge")
    add("--job-name", "-J", default=None, help="job name (default: the script's name)")
    add("--output", "-o", default="slurm-%x-%j.out", help="log file (default slurm-%%x-%%j.out)")
    add("--signal", default="USR1@90",
        help="signal and seconds before the time limit that save and requeue (default USR1@90)")
    add("--no-requeue", action="store_true", help="do not let the job be requeued")
    add("--write", default=None, help="where to write the script (default JOB_NAME.sbatch)")
    add("--submit", action="store_true", help="submit the script with sbatch")
    return parser


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise SbatchError("put the launch command after --: paratrain slurm [sbatch options] "
                          "-- [launch flags] train.py [args]")
    cut = argv.index("--")
    if not argv[cut + 1:]:
        raise SbatchError("nothing to run after --; give the training script: paratrain slurm "
                          "... -- train.py [args]")
    return argv[:cut], argv[cut + 1:]


def _extra_lines(extra: list[str]) -> list[str]:
    """``--qos high --mem=4G`` -> ``--qos=high``, ``--mem=4G`` (each a ``#SBATCH`` line)."""
    lines: list[str] = []
    for token in extra:
        if token.startswith("-"):
            lines.append(token)
        elif lines and "=" not in lines[-1] and lines[-1].startswith("--"):
            lines[-1] += f"={token}"
        elif lines and lines[-1].startswith("-") and not lines[-1].startswith("--"):
            lines[-1] += f" {token}"
        else:
            raise SbatchError(f"{token!r} before -- is neither an option nor an option's value; "
                              "put the script and its arguments after --")
    return lines


def requeue_signal(spec: str) -> tuple[signal.Signals, str]:
    """``USR1@90`` -> (SIGUSR1, ``USR1@90``); SbatchError names a spec Slurm or paratrain
    would not honour (``B:`` would signal only the batch shell, not the training)."""
    match = _SIGNAL.match(spec.strip())
    key = (match.group("name").upper() if match else "")
    key = key if key.startswith("SIG") or key.isdigit() else f"SIG{key}"
    found = (signal.Signals(int(key)) if key.isdigit() and int(key) in signal.valid_signals()
             else getattr(signal.Signals, key, None))
    if match is None or found is None or found in (signal.SIGKILL, signal.SIGSTOP,
                                                   signal.SIGTERM, signal.SIGINT):
        raise SbatchError(f"--signal {spec!r} must be SIG[@SECONDS] with a catchable signal "
                          "other than TERM/INT, e.g. USR1@90")
    if match.group("where"):
        raise SbatchError(f"--signal {spec!r}: {match.group('where')}: would not reach the "
                          "training processes; use e.g. USR1@90 (sent to the srun step)")
    seconds = match.group("seconds") or "90"
    return found, f"{found.name[3:]}@{seconds}"


def validate(args: argparse.Namespace) -> None:
    """Fail fast, with one line, on options that make no working job."""
    for name in ("nodes", "nproc_per_node", "cpus_per_task"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SbatchError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.gpus_per_node < 0:
        raise SbatchError(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    if args.time is not None and not _TIME.match(args.time):
        raise SbatchError(f"--time {args.time!r} is not a Slurm time; use MINUTES, HH:MM:SS "
                          "or DAYS-HH:MM:SS")


# Launch flags that Slurm's allocation decides (paratrain slurm's own options set them).
_FROM_SLURM = {"nnodes": "--nodes", "node_rank": None, "master_addr": None,
               "master_port": None, "nproc_per_node": "--nproc-per-node"}


def launch_command(command: list[str]) -> argparse.Namespace:
    """``command`` parsed as ``paratrain launch`` would; SbatchError for a flag that would
    contradict the allocation or a missing script."""
    from paratrain.launch.kubernetes import explicit_options
    from paratrain.launch.launcher import build_parser as launch_parser

    parser = launch_parser()
    parsed = parser.parse_args(command)
    for option in sorted(explicit_options(parser, command) & set(_FROM_SLURM)):
        flag, ours = f"--{option.replace('_', '-')}", _FROM_SLURM[option]
        fix = f"give {ours} before -- instead" if ours else "drop it: Slurm's value is used"
        raise SbatchError(f"{flag} after -- would contradict the Slurm allocation; {fix}")
    if not (parsed.module or parsed.no_python) and not os.path.isfile(parsed.script):
        raise SbatchError(f"script {parsed.script!r} not found; check the path")
    return parsed


def job_name(args: argparse.Namespace, command: list[str]) -> str:
    """``--job-name``, else the script's name without its extension."""
    script = launch_command(command).script
    return args.job_name or os.path.splitext(os.path.basename(script))[0] or "paratrain"


def render(args: argparse.Namespace, extra: list[str], command: list[str], *,
           launcher: str) -> str:
    """The batch script's text for ``args`` (parsed by :func:`build_parser`), ``extra``
    sbatch options, and ``command`` (launch flags, script, its arguments)."""
    validate(args)
    nproc = args.nproc_per_node or args.gpus_per_node or 1
    sig, sig_spec = requeue_signal(args.signal)
    name = job_name(args, command)
    options = [f"--job-name={name}", f"--nodes={args.nodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={args.cpus_per_task or nproc}"]
    if args.gpus_per_node:
        options.append(f"--gpus-per-node={args.gpus_per_node}")
    options += [f"--{key}={getattr(args, key)}" for key in ("time", "partition", "account")
                if getattr(args, key)]
    options += [f"--output={args.output}", "--open-mode=append", f"--signal={sig_spec}",
                "--no-requeue" if args.no_requeue else "--requeue", *_extra_lines(extra)]
    lines = ["#!/bin/bash", "# Written by paratrain slurm; submit with: sbatch THIS_FILE",
             *(f"#SBATCH {option}" for option in options), "",
             "# paratrain launch reads nodes, node rank, master address and port from Slurm.",
             f"# On {sig.name} ({sig_spec.split('@')[1]} s before --time) the run saves a "
             "checkpoint, rank 0 requeues",
             "# the job (scontrol requeue) and it resumes from there when it starts again.",
             "set -e"]
    if sig != signal.SIGUSR1:
        lines.append(f"export PARATRAIN_REQUEUE_SIGNAL={sig.name[3:]}")
    launch = [launcher, "launch", "--nproc-per-node", str(nproc), *command]
    lines.append("srun --ntasks-per-node=1 --kill-on-bad-exit=1 " + shlex.join(launch))
    return "\n".join(lines) + "\n"


def _launcher() -> str:
    """The ``paratrain`` of this environment, as an absolute path the job can run."""
    beside = os.path.join(os.path.dirname(sys.executable), "paratrain")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("paratrain") or f"{sys.executable} -m paratrain.cli"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paratrain slurm``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv[:argv.index("--")] if "--" in argv else argv):
        build_parser().print_help()  # help needs no launch command
        return 0
    try:
        mine, command = _split(argv)
        args, extra = build_parser().parse_known_args(mine)
        text = render(args, extra, command, launcher=_launcher())
        path = os.path.abspath(args.write or f"{job_name(args, command)}.sbatch")
        with open(path, "w") as f:
            f.write(text)
    except (SbatchError, OSError) as exc:
        print(f"paratrain slurm: {exc}", file=sys.stderr)
        return 2
    print(path)
    if not args.submit:
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(f"paratrain slurm: sbatch is not on PATH; submit {path} on a Slurm login node",
              file=sys.stderr)
        return 2
    done = subprocess.run([sbatch, path], capture_output=True, text=True)
    print((done.stdout or done.stderr).strip(), file=sys.stdout if done.returncode == 0
          else sys.stderr)
    return done.returncode
