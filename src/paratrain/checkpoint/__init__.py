"""Checkpoints: one-file ``.pt`` saves (:mod:`~paratrain.checkpoint.files`), sharded
``torch.distributed.checkpoint`` directories (:mod:`~paratrain.checkpoint.sharded`,
their files checked and published by :mod:`~paratrain.checkpoint.shard_files`), which
one a resume loads (:mod:`~paratrain.checkpoint.resume`) and the directory's lock
(:mod:`~paratrain.checkpoint.lock`)."""

from paratrain.checkpoint.files import (
    CheckpointError,
    CorruptCheckpoint,
    atomic_save,
    check_directory,
    latest_checkpoint,
    list_checkpoints,
    safe_load,
)
from paratrain.checkpoint.lock import CheckpointDirInUse

__all__ = ["CheckpointDirInUse", "CheckpointError", "CorruptCheckpoint", "atomic_save",
           "check_directory", "latest_checkpoint", "list_checkpoints", "safe_load"]
