"""Ray Train: a paratrain training function run as a ``TorchTrainer`` job.

``Run`` needs nothing specific to Ray. ``TorchTrainer`` starts one worker process per
``ScalingConfig(num_workers=...)``, forms the default torch.distributed group in them
(gloo on CPU, NCCL with ``use_gpu=True``) and sets torchrun's variables ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` before calling the training function. ``Run()`` inside it reads its
:class:`~paratrain.Topology` from those variables and reuses Ray's group
(``process_group.check_existing_group`` refuses, in one line, a group that disagrees with
them); ``run.close()`` leaves the group to Ray, which destroys it when the job ends.

This module only imports Ray's classes with one line naming the extra when Ray is
missing (Ray is optional: ``pip install 'paratrain[ray]'``).

Example:
    >>> from paratrain.cluster.ray import ScalingConfig, TorchTrainer   # doctest: +SKIP
    >>> trainer = TorchTrainer(train, train_loop_config={"epochs": 2},   # doctest: +SKIP
    ...                        scaling_config=ScalingConfig(num_workers=2, use_gpu=False))
    >>> trainer.fit()                                                    # doctest: +SKIP

``examples/ray_train.py`` is a whole script: the same function under Ray or under
``paratrain launch``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Ray's three classes are resolved by __getattr__ below.
__all__ = ["EXTRA", "ScalingConfig", "TorchConfig", "TorchTrainer", "require"]  # noqa: F822

EXTRA = "pip install 'paratrain[ray]'"
"""The install command named when Ray Train is missing."""

# Ray's classes, imported on first use so that `import paratrain.cluster.ray` works without it.
_FROM = {"TorchTrainer": "ray.train.torch", "TorchConfig": "ray.train.torch",
         "ScalingConfig": "ray.train"}


def require() -> None:
    """Import Ray Train; without it, a RuntimeError of one line naming the extra."""
    try:
        importlib.import_module("ray")  # names `ray` itself when Ray is missing altogether
        importlib.import_module("ray.train.torch")  # needs the train extra's packages too
    except ImportError as exc:
        missing = exc.name or "ray"
        raise RuntimeError(f"Ray Train is not installed ({missing} is missing); install "
                           f"the ray extra: {EXTRA}") from None


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require()
    return getattr(importlib.import_module(_FROM[name]), name)
