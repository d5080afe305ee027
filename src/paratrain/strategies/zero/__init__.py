"""ZeRO stages 1 and 2: data parallel with the optimizer state (``zero1``) or also the
gradients (``zero2``) sharded over the ranks, parameters whole on every rank."""
