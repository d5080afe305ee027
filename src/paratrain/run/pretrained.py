"""``Run.save_pretrained`` / ``Run.load_pretrained`` and models built on the meta device.

The work is in :mod:`paratrain.checkpoint.huggingface` and
:mod:`paratrain.checkpoint.meta_init`; here the run picks the module each rank holds
and decides who materialises a meta model (see docs/interchange.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from paratrain.checkpoint import huggingface
from paratrain.checkpoint.meta_init import materialise, on_meta
from paratrain.strategies.capabilities import ShardedState, ShardsOnMeta, local_module

if TYPE_CHECKING:
    from paratrain.run.state import RunState
    from paratrain.strategies.base import Strategy


def setup_model(strategy: Strategy, model: nn.Module,
                optimizer: torch.optim.Optimizer | None) -> nn.Module:
    """``strategy.setup_model(model)``, for a model on the meta device too.

    A :class:`ShardsOnMeta` strategy shards it first and materialises its shards; any
    other gets it materialised whole first (DDP broadcasts it, TP splits it). Pipeline
    stages are cut from a real model only. ``optimizer`` then holds the new parameters.
    """
    # One process has nothing to shard: the strategy runs the whole model.
    shards = (isinstance(strategy, ShardsOnMeta) and strategy.shards_on_meta()
              and strategy.topology.world_size > 1)
    if on_meta(model) and not shards:
        if isinstance(strategy, ShardedState) and strategy.partial_model:
            raise ValueError(f"strategy {strategy.name!r} splits a model built on the CPU "
                             "only; build it without the meta device (or use fsdp)")
        materialise(model, strategy.topology.device, optimizer)
    return strategy.setup_model(model)


class Pretrained:
    """Hugging Face checkpoints of a run's prepared model (mixed into ``Run``)."""

    strategy: Strategy
    state: RunState

    def _pretrained_module(self, model: nn.Module | None,
                           action: str) -> tuple[nn.Module, bool, nn.Module]:
        models = self.state.models
        if model is None:
            if len(models) != 1:
                raise ValueError(f"{action}() needs model=... when {len(models)} models are "
                                 "prepared" if models else
                                 f"{action}() needs a prepared model; call run.prepare() first")
            model = models[0]
        partial = isinstance(self.strategy, ShardedState) and self.strategy.partial_model
        return local_module(self.strategy, model), partial, model

    def save_pretrained(self, directory: str | os.PathLike, *, model: nn.Module | None = None,
                        max_shard_size: int | str = "5GB") -> list[str]:
        """Write the prepared model as a Hugging Face checkpoint (call on every rank).

        ``model.safetensors`` (or numbered files over ``max_shard_size`` and
        ``model.safetensors.index.json``) under the model's own parameter names, from
        any layout, plus ``config.json`` for a ``transformers`` model. Rank 0 writes;
        returns the files on rank 0, [] elsewhere.

        Example:
            >>> run.save_pretrained("gpt2-finetuned/")                # doctest: +SKIP
            >>> AutoModelForCausalLM.from_pretrained("gpt2-finetuned/")  # doctest: +SKIP
        """
        module, partial, _ = self._pretrained_module(model, "save_pretrained")
        written = huggingface.save_pretrained(directory, module, max_shard_size=max_shard_size,
                                              main=self.strategy.topology.is_main,
                                              partial=partial)
        self.strategy.barrier()  # every file is complete when any rank returns
        return written

    def load_pretrained(self, directory: str | os.PathLike, *,
                        model: nn.Module | None = None) -> None:
        """Fill the prepared model from a Hugging Face checkpoint (call on every rank).

        Each rank reads only the slices of the shards it holds, and a pipeline stage only
        its own tensors (a head tied to the embedding of another stage reads the
        embedding's). With a model built on the meta device
        (:func:`paratrain.checkpoint.meta_init.empty_weights`), no rank ever holds the
        whole model under ``fsdp``.

        Example:
            >>> with empty_weights():                                  # doctest: +SKIP
            ...     model = AutoModelForCausalLM.from_config(config)
            >>> model, optimizer = run.prepare(model, optimizer)       # doctest: +SKIP
            >>> run.load_pretrained("gpt2/")                           # doctest: +SKIP
        """
        module, partial, prepared = self._pretrained_module(model, "load_pretrained")
        # A pipeline's stage names its copy of a tensor tied across stages (tied_names).
        huggingface.load_pretrained(directory, module, partial=partial,
                                    aliases=getattr(prepared, "tied_names", None))
        self.strategy.barrier()
