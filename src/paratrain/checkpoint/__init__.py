"""Checkpoints: one-file ``.pt`` saves (:mod:`~paratrain.checkpoint.files`) and sharded
``torch.distributed.checkpoint`` directories (:mod:`~paratrain.checkpoint.sharded`)."""

from paratrain.checkpoint.files import (
    CheckpointError,
    CorruptCheckpoint,
    atomic_save,
    check_directory,
    latest_checkpoint,
    list_checkpoints,
    safe_load,
)

__all__ = ["CheckpointError", "CorruptCheckpoint", "atomic_save", "check_directory",
           "latest_checkpoint", "list_checkpoints", "safe_load"]
