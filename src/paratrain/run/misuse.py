"""Checks for training-loop mistakes that would otherwise run on silently.

Each turns a run that "works" but learns nothing, or reports a meaningless
number, into one line that names the mistake and the fix (docs/reliability.md
lists them). They are local and cost nothing measurable: no communication.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def check_optimizer_matches(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """ValueError when none of ``optimizer``'s parameters belongs to ``model``.

    Typically the optimizer was built from another instance of the model (one
    created before the model was rebuilt or reloaded): its steps would never
    change the model being trained.
    """
    owned = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if params and not any(id(p) in owned for p in params):
        raise ValueError(
            "run.prepare(model, optimizer): none of the optimizer's parameters belong to "
            "this model, so training would not change it; build the optimizer from this "
            "model (e.g. torch.optim.SGD(model.parameters(), ...)) before calling prepare"
        )


def check_scheduler_matches(optimizer: torch.optim.Optimizer | None, scheduler: Any) -> None:
    """ValueError when ``scheduler`` was built over another optimizer than ``optimizer``:
    it would set learning rates nothing reads."""
    if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("the scheduler passed to prepare() drives another optimizer; build "
                         "it over the optimizer you pass with it")


def check_step_has_gradients(*, backward_called: bool, models: Iterable[nn.Module],
                             optimizer: torch.optim.Optimizer) -> None:
    """RuntimeError at an optimizer step with no backward in its accumulation group.

    A group where only some micro-steps call ``run.backward`` is fine (e.g. a
    skipped batch); gradients from a plain ``loss.backward()`` are accepted too.
    """
    if backward_called:
        return
    params = [p for model in models for p in model.parameters()]
    params += [p for group in optimizer.param_groups for p in group["params"]]
    if not any(p.grad is not None for p in params):
        raise RuntimeError(
            "run.step(optimizer) found no gradients: run.backward(loss) was not called "
            "since the last optimizer step, so nothing would learn; call "
            "run.backward(loss) before run.step(optimizer)"
        )


def check_evaluated(count: float) -> None:
    """ValueError when an evaluation saw no sample on any rank (its accuracy would read 0.0)."""
    if count == 0:
        raise ValueError(
            "run.evaluate() got an empty loader on every rank, so there is no loss or "
            "accuracy to report; pass a loader with at least one batch (e.g. "
            "run.eval_loader(dataset, batch_size=...) over a non-empty dataset)"
        )


def check_ps_servers(strategy_name: str, ps_servers: int | None) -> None:
    """ValueError when ``paratrain launch --ps-servers`` was given to a non-``ps`` strategy."""
    value = ps_servers
    if value and strategy_name != "ps":
        raise ValueError(
            f"--ps-servers {value} (PARATRAIN_PS_SERVERS) applies to strategy 'ps' only, "
            f"but the strategy is {strategy_name!r}; use Run(strategy='ps') or launch "
            "without --ps-servers"
        )


def check_num_epochs(num_epochs: Any) -> None:
    """ValueError unless ``run.epochs(num_epochs)`` got an integer >= 0 (``"3"`` from
    ``sys.argv`` would otherwise fail with a comparison traceback)."""
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 0:
        raise ValueError(f"run.epochs(num_epochs) needs an integer >= 0, got {num_epochs!r} "
                         f"({type(num_epochs).__name__}); e.g. run.epochs(int(args.epochs))")


# -- repeated set-up -------------------------------------------------------------------

def check_not_prepared(model: nn.Module, prepared: Iterable[nn.Module], unwrap: Any) -> None:
    """ValueError when ``model`` (or the module inside it) was already given to prepare.

    A second prepare wraps it again: DDP then registers a second set of gradient hooks on
    the same parameters and fails in backward with "please file an issue"; other
    strategies shard or convert twice.
    """
    inner = unwrap(model)
    if any(inner is unwrap(other) for other in prepared):
        raise ValueError(
            "run.prepare() was called twice on the same model; call it once per model "
            "and train the model it returned (model, optimizer = run.prepare(model, optimizer))"
        )


def router_loss_notice(model: nn.Module) -> str | None:
    """A notice for a Hugging Face mixture of experts trained without its load-balancing
    loss: those configs default to ``output_router_logits=False``, under which
    ``out.loss`` is the language-model loss alone and the router may send most tokens to
    a few experts (the rest then never learn). None for any other model."""
    config = getattr(model, "config", None)
    experts = max((getattr(config, name, None) or 0 for name in
                   ("num_local_experts", "num_experts")), default=0)
    if not isinstance(experts, int) or experts < 2:
        return None
    if getattr(config, "output_router_logits", True) is not False:
        return None
    return (f"notice: {type(model).__name__} routes tokens to {experts} experts but its config "
            "has output_router_logits=False, so out.loss has no load-balancing term and the "
            "router may collapse onto a few experts; set config.output_router_logits=True "
            "(its router_aux_loss_coef weights the term)")


def optimizer_notice(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """A one-line suggestion when a GPU run's optimizer updates one tensor at a time.

    torch's optimizers step all parameters in a few kernels (``foreach``, their default
    on CUDA) or in one (``fused=True``); with ``foreach=False``, or an optimizer that has
    neither, each parameter costs several kernel launches per step, which dominates the
    step of a small model.
    """
    if device.type != "cuda":
        return None
    defaults = optimizer.defaults
    if defaults.get("fused") or ("foreach" in defaults and defaults["foreach"] is not False):
        return None
    name = type(optimizer).__name__
    how = "foreach=False" if "foreach" in defaults else "it has no foreach or fused form"
    return (f"paratrain: optimizer {name} updates one tensor at a time on the GPU ({how}); "
            f"a torch optimizer with fused=True (or foreach=True) launches a few kernels "
            f"per step instead of several per parameter")
