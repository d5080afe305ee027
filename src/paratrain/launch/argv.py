"""Where the launcher's command line ends and the script's begins.

As with torchrun, every argument after the script belongs to the script, so
``paratrain launch train.py --nproc-per-node 2`` starts one process and hands
``--nproc-per-node 2`` to ``train.py``; a script that ignores flags it does not know
then trains on one process without a word. :func:`misplaced_flags_notice` names such
flags in one line (a warning: the script may have a flag of the same name).

Example::

    >>> from paratrain.launch.launcher import build_parser
    >>> argv = ["train.py", "--nproc-per-node", "2"]
    >>> misplaced_flags_notice(build_parser().parse_args(argv), argv).split(",")[0]
    '--nproc-per-node appears after the script train.py'
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["misplaced_flags_notice"]


def misplaced_flags_notice(args: argparse.Namespace, argv: Sequence[str]) -> str | None:
    """One line naming the launcher flags among ``args.script_args``, or None.

    ``argv`` is the command line ``args`` was parsed from: a ``--`` right after the
    script (which argparse drops) says the arguments are meant for it, and silences this.
    A launcher flag is ``--`` and the name of a parsed option, with ``-`` or ``_``
    (``--nproc-per-node``, ``--nproc_per_node``), alone or as ``--flag=value``.
    """
    before = len(argv) - len(args.script_args) - 1  # the token before the script's args
    if args.script_args[:1] == ["--"] or (before >= 0 and argv[before] == "--"):
        return None
    names = set(vars(args)) - {"script", "script_args"}
    found: list[str] = []
    for arg in args.script_args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag[2:].replace("-", "_") in names and flag not in found:
            found.append(flag)
    if not found:
        return None
    verb, pronoun = ("appears", "it goes") if len(found) == 1 else ("appear", "they go")
    return (f"{', '.join(found)} {verb} after the script {args.script}, so {pronoun} to the "
            "script, not to the launcher; put launcher flags before the script")
