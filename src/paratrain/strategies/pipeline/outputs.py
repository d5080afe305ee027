"""What a pipelined Hugging Face model returns, and the check that its stages are the model.

Before a Hugging Face model is cut into stages, :func:`check_stages` runs the model and
its stages one after the other, in one process, on a small input: the stages must give
the model's logits bit for bit (on the CPU; within 1e-4 elsewhere), or the pipeline is
refused in one line. The same run tells what the model returns (its output class, e.g.
``CausalLMOutputWithPast``), the shape of its logits, and whether its own loss
(``labels=``) is the loss function the pipeline replays per micro-batch.

A pipelined model then returns that output class (:class:`OutputSpec`): in training its
``logits`` are a :class:`~.deferred.Deferred` of the logits' shape and its ``loss``
(with ``labels=``) the model's ``loss_function(logits, labels)`` recorded after them;
in evaluation both are real tensors on every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.strategies.pipeline.deferred import Deferred, Node

_IGNORE_INDEX = -100  # transformers' loss functions ignore these labels


@dataclass(frozen=True)
class MicroBatchLoss:
    """A causal LM's own loss on one micro-batch: its ``loss_function`` summed over the
    micro-batch's tokens and divided by the whole batch's count, so the micro-batches'
    losses add up to the model's mean (``sums_microbatches``)."""

    loss_function: Any
    vocab_size: int
    num_items: torch.Tensor
    sums_microbatches: bool = True
    __name__ = "loss_function"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits, labels, self.vocab_size,
                                  num_items_in_batch=self.num_items)


@dataclass(frozen=True)
class OutputSpec:
    """What a pipelined Hugging Face model returns (found by :func:`check_stages`)."""

    model_class: str
    output_class: type
    per_token: bool
    """Logits have a sequence dimension (``(B, T, V)``), else ``(B, C)``."""
    tail: tuple[int, ...]
    """The logits' dimensions after the batch (and sequence) ones."""
    loss_function: Any = None
    """The model's own loss function when it is a causal LM's, verified; else None."""
    vocab_size: int = 0

    def logits_shape(self, ids: torch.Tensor) -> tuple[int, ...]:
        """The logits' shape for the token ids ``ids``."""
        return (*ids.shape[:2 if self.per_token else 1], *self.tail)

    def check_labels(self, labels: torch.Tensor | None) -> None:
        """ValueError in one line when ``labels=`` cannot be replayed per micro-batch."""
        if labels is not None and self.loss_function is None:
            raise ValueError(
                f"a pipelined {self.model_class} does not compute its loss from labels= "
                "(only a causal LM's own loss is replayed per micro-batch); compute it "
                "from the output, e.g. F.cross_entropy(out.logits, labels)")

    def training_output(self, logits: Deferred, labels: torch.Tensor | None) -> Any:
        """The output object with deferred ``logits`` (and ``loss`` with ``labels``)."""
        loss = None
        if labels is not None:
            count = (labels[..., 1:] != _IGNORE_INDEX).sum()
            loss_fn = MicroBatchLoss(self.loss_function, self.vocab_size, count)
            loss = Deferred(Node(loss_fn, (logits, labels), parent=logits._node))
        return self.output_class(loss=loss, logits=logits)

    def evaluation_output(self, logits: torch.Tensor, labels: torch.Tensor | None) -> Any:
        """The output object of a forward-only schedule, as one process computes it."""
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
        return self.output_class(loss=loss, logits=logits)


def _sample_ids(config: Any, device: torch.device) -> torch.Tensor:
    # Long enough that a small sliding window is exercised; no random stream touched.
    length = min(16, getattr(config, "max_position_embeddings", None) or 16)
    vocab = getattr(config, "vocab_size", None) or 2
    return ((torch.arange(length, device=device) * 7 + 3) % vocab).unsqueeze(0)


def _causal_lm_loss(model: nn.Module) -> Any:
    """transformers' causal LM loss when it may be the model's (checked by running both),
    else None. A model without a ``loss_type`` (GPT-2) gets transformers' default, that."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    if getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return None
    return LOSS_MAPPING.get("ForCausalLM")


def _same(got: Any, expected: torch.Tensor) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return False
    if expected.device.type == "cpu":
        return torch.equal(got, expected)
    return torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


def check_stages(model: nn.Module, stages: nn.Module) -> OutputSpec:
    """What ``model`` returns, once ``stages`` (its parts run by a stage forward, in one
    process) are checked to compute its logits; ValueError in one line if they do not.

    The check runs in ``eval()`` mode without gradients and leaves the model's mode and
    the random streams as they were.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = _sample_ids(config, device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else []):
            expected = model(ids)
            got = stages(ids)
            loss_fn = _causal_lm_loss(model)
            if loss_fn is not None:
                try:
                    own = model(ids, labels=ids).loss
                    replayed = loss_fn(expected.logits, ids, config.vocab_size)
                except (RuntimeError, ValueError, TypeError):
                    own = replayed = None  # labels of another shape: not a causal LM
                loss_fn = loss_fn if own is not None and _same(replayed, own) else None
    finally:
        for module, training in modes:
            module.training = training
    logits = getattr(expected, "logits", None)
    if not isinstance(logits, torch.Tensor) or not _same(got, logits):
        raise ValueError(
            f"a pipeline's stages of {name} do not compute what its forward computes "
            "(their logits differ on a sample input), so it cannot be pipelined as it is; "
            "train it with dp_shard, dp_replicate or tp, or register an adapter whose "
            "stage_forward reproduces its forward (docs/strategies.md, 'Models')")
    per_token = logits.dim() == ids.dim() + 1
    return OutputSpec(model_class=name, output_class=type(expected), per_token=per_token,
                      tail=tuple(logits.shape[2 if per_token else 1:]),
                      loss_function=loss_fn, vocab_size=getattr(config, "vocab_size", 0))
