"""Seeding every random-number generator a training step touches."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["reseed_lost_streams", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def reseed_lost_streams(seed: int, stream_rank: int, step: int) -> None:
    """Fresh random streams for a rank whose own cannot be restored (a resume on another
    world size, a replica group healed from a peer): derived from the run's seed, the
    rank's stream and the step, so that they differ per rank and per resume point."""
    seed_everything(seed + 1 + stream_rank + 7919 * step)
