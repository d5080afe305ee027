"""Small reference models used by the demo, ``bench`` and ``verify``."""

from __future__ import annotations

from torch import nn

__all__ = ["convnet"]


def convnet() -> nn.Sequential:
    """The classic 2-conv + pooling CNN for 28x28 grey images, 10 classes."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1600, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )
