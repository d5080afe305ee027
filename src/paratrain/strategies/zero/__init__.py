"""ZeRO stage 1: data parallel with the optimizer state sharded over the ranks (``zero1``);
``zero2`` is the layout preset ``dp_shard`` with ``reshard_after_forward=False``."""
