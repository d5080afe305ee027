"""The training loop: :class:`Run` (:mod:`~paratrain.run.core`), its step
(:mod:`~paratrain.run.step`) and checkpointed state (:mod:`~paratrain.run.state`)."""

from paratrain.run.core import Run, seed_everything

__all__ = ["Run", "seed_everything"]
