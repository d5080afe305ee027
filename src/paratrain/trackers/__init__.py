"""Experiment trackers: ``Run(loggers=["mlflow", "wandb", "tensorboard"])`` or instances.

Rank 0 logs the run's configuration and layout once, then every ``run.log(...)`` row
and each epoch's statistics (samples/s, tokens/s, MFU where known) with the optimizer
step and the peak memory. A resumed run continues the same tracker run. A tracker that
fails warns once and is switched off; training goes on. See docs/trackers.md.
"""

from paratrain.trackers.base import Tracker
from paratrain.trackers.mlflow import MLflowTracker
from paratrain.trackers.tensorboard import TensorBoardTracker
from paratrain.trackers.wandb import WandbTracker

__all__ = ["MLflowTracker", "TensorBoardTracker", "Tracker", "WandbTracker"]
