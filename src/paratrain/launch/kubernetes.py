"""Kubernetes: ``paratrain launch train.py`` with no flags in a Kubeflow pod.

Kubeflow Trainer (a ``TrainJob`` on a torch runtime) and the training operator's
``PyTorchJob`` describe the job in each pod's environment:

* ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
  ``PET_MASTER_PORT`` (and, for elastic jobs, ``PET_RDZV_*``, ``PET_MAX_RESTARTS``):
  torchrun reads ``PET_<FLAG>`` as the default of ``--<flag>``, and so does
  ``paratrain launch``;
* the older ``PyTorchJob`` sets only ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and
  ``RANK`` for the pod, where ``WORLD_SIZE`` counts pods (nodes) and ``RANK`` is the pod's
  index: they stand for ``--nnodes`` and ``--node-rank``. Because a worker started by any
  launcher also sees these names, they are read only in a pod
  (``KUBERNETES_SERVICE_HOST``) and outside a worker (no ``LOCAL_RANK``).

A flag on the command line wins over the environment. When it contradicts it,
:func:`apply` returns one line saying so, except for ``--nnodes`` and ``--node-rank``:
those cannot differ from the pod's and work, so the pre-flight check refuses them
(:func:`paratrain.launch.preflight.scheduler_problems`).

Example::

    >>> pod = detect({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-0"})
    >>> pod.values["nnodes"], pod.values["node_rank"], pod.sources["node_rank"]
    ('2', 1, 'PET_NODE_RANK=1')
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["PodSettings", "apply", "detect", "explicit_options"]

#: launcher option -> how its value is read; the variable is ``PET_`` + the upper-case name.
TORCHRUN_OPTIONS: dict[str, Callable[[str], object]] = {
    "nnodes": str, "nproc_per_node": str, "node_rank": int, "master_addr": str,
    "master_port": int, "rdzv_backend": str, "rdzv_endpoint": str, "rdzv_id": str,
    "rdzv_conf": str, "local_addr": str, "max_restarts": int, "monitor_interval": float,
}
#: the older PyTorchJob's names (WORLD_SIZE counts pods there, not processes).
LEGACY = {"nnodes": "WORLD_SIZE", "node_rank": "RANK", "master_addr": "MASTER_ADDR",
          "master_port": "MASTER_PORT"}
#: options whose contradiction the pre-flight check refuses instead of a notice here.
CHECKED_BY_PREFLIGHT = ("nnodes", "node_rank")


class KubernetesError(ValueError):
    """A pod variable that cannot be read; the message names it and the fix."""


@dataclass(frozen=True)
class PodSettings:
    """Launcher options found in the environment: typed values and where each came from."""

    values: dict[str, object] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # option -> "PET_NNODES=2"

    def __bool__(self) -> bool:
        return bool(self.values)


def _read(values: dict, sources: dict, option: str, name: str, raw: str) -> None:
    try:
        values[option] = TORCHRUN_OPTIONS[option](raw.strip())
    except ValueError:
        kind = TORCHRUN_OPTIONS[option].__name__
        raise KubernetesError(
            f"{name}={raw!r} is not a valid {kind} for --{option.replace('_', '-')}; fix the "
            "job's environment or pass the flag") from None
    sources[option] = f"{name}={raw.strip()}"


def detect(environ: Mapping[str, str]) -> PodSettings:
    """The launcher options a Kubeflow pod's environment sets (empty outside one)."""
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for option in TORCHRUN_OPTIONS:
        name = f"PET_{option.upper()}"
        if environ.get(name, "").strip():
            _read(values, sources, option, name, environ[name])
    legacy = ("KUBERNETES_SERVICE_HOST" in environ and "LOCAL_RANK" not in environ
              and all(environ.get(name, "").strip() for name in LEGACY.values()))
    if legacy:
        for option, name in LEGACY.items():
            if option not in values:  # PET_* wins: newer operators set both
                _read(values, sources, option, name, environ[name])
    return PodSettings(values, sources)


def explicit_options(parser: argparse.ArgumentParser, argv: Iterable[str]) -> set[str]:
    """The options ``argv`` gives on the command line (not left to their defaults)."""
    unset = object()
    # argparse fills a default only where the namespace lacks the attribute.
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions
                                      if a.dest != argparse.SUPPRESS})
    parsed = parser.parse_args(list(argv), namespace=namespace)
    return {name for name, value in vars(parsed).items() if value is not unset}


def _shown(option: str, value: object) -> str:
    return f"--{option.replace('_', '-')} {value}"


def apply(args: argparse.Namespace, explicit: set[str], pod: PodSettings) -> list[str]:
    """Set the options of ``args`` not in ``explicit`` from ``pod``; one line per conflict.

    A flag given on the command line keeps its value; where it differs from the pod's, the
    returned line names both (``--nnodes`` and ``--node-rank`` are left to the pre-flight
    check, which refuses them).
    """
    notices = []
    for option, value in pod.values.items():
        if option not in explicit:
            setattr(args, option, value)
        elif str(getattr(args, option)) != str(value) and option not in CHECKED_BY_PREFLIGHT:
            notices.append(f"{_shown(option, getattr(args, option))} on the command line wins "
                           f"over {pod.sources[option]} set by Kubernetes; drop the flag to use "
                           "the job's value")
    return notices
