"""The ``paratrain`` command: a thin dispatcher to each subcommand's ``main``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> ("module:function", one-line help); imported only when used.
COMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("paratrain.launch:main", "start a script on one or many nodes (torchrun flags)"),
    "slurm": ("paratrain.launch.sbatch:main",
              "write (--submit: submit) an sbatch script that launches, checkpoints, requeues"),
    "demo": ("paratrain.demo:main", "train a ConvNet on Fashion-MNIST with 2 workers"),
    "plan": ("paratrain.plan.cli:main", "predict step time and memory of each strategy at scale"),
    "verify": ("paratrain.verify.cli:main",
               "check a setup gives the 1-process gradients at several world x batch splits"),
    "bench": ("paratrain.bench.cli:main", "measure speed, memory and scaling of every strategy"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: paratrain COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `paratrain COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from paratrain import __version__

        print(f"paratrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"paratrain: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    module_name, function_name = COMMANDS[name][0].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    return int(function(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
