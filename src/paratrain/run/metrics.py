"""Evaluation and metrics over the data-parallel ranks: the collective read-outs of ``Run``.

A mix-in of :class:`~paratrain.run.core.Run` (beside :class:`~paratrain.run.step.TrainStep`):
it reads the run's ``strategy``, ``precision``, ``device`` and ``reporter``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.distributed.dtensor import whole
from paratrain.run import evaluation, misuse


class Metrics:
    """``run.evaluate``, ``run.mean``/``sum``/``gather``, ``run.print`` and ``run.log``."""

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable[Any], *, loss_fn: Any = None,
                 batch_fn: Any = None) -> dict:
        """Loss and accuracy of a classifier or language model over ``loader``, exact
        across ranks.

        Sums and counts are reduced, not per-rank means, so the result equals the
        single-process one even when ranks hold different numbers of samples or tokens.
        Batches: ``(inputs, labels)``, a dict (every key the model's ``forward`` takes
        goes in: ``model(**batch)``), or ``batch_fn(batch)``'s pair; outputs: logits or
        an object with ``.logits`` (Hugging Face). Labels of -100 are not counted, and a
        causal LM's token labels are shifted by one, as its own loss does
        (:mod:`paratrain.run.evaluation`). ``loss_fn(logits, labels)`` returns a summed loss.

        Example::

            batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
            result = run.evaluate(model, run.eval_loader(dataset, batch_size=8))
            run.print(result["loss"], result["accuracy"], result["count"])
        """
        module = self.strategy.unwrap(model)
        was_training = module.training
        module.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        # Sharded strategies run uncounted stand-in batches so every rank's forward
        # (which communicates) runs equally often.
        for call, counted in evaluation.calls(self.strategy, module, loader, batch_fn):
            out = self.precision.forward(module, *call.args, **call.kwargs)
            if not counted:
                continue
            # whole(): vocabulary-sharded logits (tp's loss_parallel) are DTensors.
            logits, y = whole(evaluation.logits_of(out)), call.labels
            if loss_fn is not None:
                totals[0] += whole(loss_fn(logits.float(), y)).double()
                totals[1] += (logits.argmax(dim=-1) == y).sum()
                totals[2] += y.numel()
                continue
            logits, y = evaluation.align(module, logits, y)
            kept = y != evaluation.IGNORE_INDEX
            totals[0] += F.cross_entropy(logits.float(), y, reduction="sum",
                                         ignore_index=evaluation.IGNORE_INDEX).double()
            totals[1] += (logits.argmax(dim=-1)[kept] == y[kept]).sum()
            totals[2] += kept.sum()
        module.train(was_training)
        loss_sum, correct, count = self.strategy.all_reduce(totals, "sum").tolist()
        misuse.check_evaluated(count)
        return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1),
                "count": int(count)}

    def _reduce(self, value: Any, op: str) -> Any:
        tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value,
                                 device=self.device)
        if not tensor.is_floating_point():
            tensor = tensor.double()
        with self._guard_peers():
            result = self.strategy.all_reduce(tensor.float() if op == "mean" else tensor, op)
        return result.item() if result.numel() == 1 else result

    def mean(self, value: Any) -> Any:
        """Mean of ``value`` over data-parallel ranks (a float for scalars)."""
        return self._reduce(value, "mean")

    def sum(self, value: Any) -> Any:
        """Sum of ``value`` over data-parallel ranks (a float for scalars)."""
        return self._reduce(value, "sum")

    def gather(self, value: Any) -> torch.Tensor:
        """``value`` from every data-parallel rank, stacked along a new first dimension."""
        return self.strategy.all_gather(torch.as_tensor(value, device=self.device))

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        self.reporter.print(*args, **kwargs)

    def log(self, metrics: dict[str, Any]) -> None:
        """Append ``metrics`` to the metrics log and the trackers (rank 0), stamped with the
        global step; trackers also get the epoch's samples/s so far (tokens/s, MFU if known)."""
        self.reporter.log(metrics, step=self.global_step, live=self._live_rates)

    def _live_rates(self) -> dict[str, float]:
        rates = self.epoch_throughput()
        return {f"throughput/{k}": rates[k] for k in ("samples_per_s", "tokens_per_s", "mfu")
                if rates.get(k) is not None}
