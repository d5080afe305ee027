"""``paratrain launch``: a torchrun-compatible launcher (:mod:`~paratrain.launch.launcher`),
the per-process wrapper it starts (:mod:`~paratrain.launch.worker`) and its failure report
(:mod:`~paratrain.launch.report`)."""

from paratrain.launch.launcher import LaunchError, main

__all__ = ["LaunchError", "main"]
