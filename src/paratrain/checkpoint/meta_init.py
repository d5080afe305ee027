"""Models built without memory: parameters on the meta device, materialised by ``prepare``.

``run.prepare`` gives a model built under :func:`empty_weights` (or
``torch.device("meta")``) memory for only this rank's shards under ``fsdp`` (the
strategy shards first, see :class:`~paratrain.strategies.capabilities.ShardsOnMeta`)
and for the whole model elsewhere; ``run.load_pretrained`` or ``run.load`` then fills it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build models inside it with parameters on the meta device and buffers real.

    ``run.prepare`` then materialises only this rank's shards (``fsdp``) or the
    model (other layouts), and :func:`load_pretrained` fills them. Buffers stay real
    because buffers computed in ``__init__`` and not saved (rotary frequencies) could
    not be restored; ``with torch.device("meta")`` suits models without such buffers.

    Example:
        >>> with empty_weights():                                  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> model, optimizer = run.prepare(model, optimizer)       # doctest: +SKIP
        >>> run.load_pretrained("gpt2-finetuned/")                 # doctest: +SKIP
    """
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.device.type == "meta" for t in tensors)


def materialise(module: nn.Module, device: torch.device | str,
                optimizer: torch.optim.Optimizer | None = None) -> None:
    """Give ``module``'s meta tensors (this rank's shards once sharded) uninitialised
    memory on ``device``. Parameters that become new objects (plain tensors leaving the
    meta device do) are put in their place in ``optimizer``'s groups, so an optimizer
    built over the meta model stays valid. One line for a buffer that was built on meta
    and is not saved (nothing could restore it)."""
    saved = set(module.state_dict())
    for name, buffer in module.named_buffers():
        if buffer.device.type == "meta" and name not in saved:
            raise ValueError(f"buffer {name!r} was built on the meta device and checkpoints do "
                             "not hold it; build the model under "
                             "paratrain.checkpoint.meta_init.empty_weights() instead")
    # to_empty re-allocates every tensor: the real buffers (built by empty_weights) are
    # put back after it.
    real = {name: buffer for name, buffer in module.named_buffers()
            if buffer.device.type != "meta"}
    before = dict(module.named_parameters())
    tied: dict[int, list[str]] = {}  # one parameter under several names (GPT-2's head)
    for name, param in module.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    module.to_empty(device=device)
    for first, *others in (names for names in tied.values() if len(names) > 1):
        # to_empty gives each name its own new tensor: tie them again.
        for name in others:
            owner, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(owner), attribute, module.get_parameter(first))
    with torch.no_grad():
        for name, buffer in real.items():
            module.get_buffer(name).copy_(buffer)
    now = dict(module.named_parameters())
    new = {id(old): now[name] for name, old in before.items() if now[name] is not old}
    if optimizer is not None and new:
        for group in optimizer.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]
