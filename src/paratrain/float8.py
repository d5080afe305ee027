"""Float8 training through torchao: ``Run(precision="float8", float8=...)``.

Everything runs under bfloat16 autocast, as with ``bf16-mixed``; in addition the model's
``nn.Linear`` layers become torchao's float8 training linears
(``torchao.float8.convert_to_float8_training``): their three matmuls (output, input
gradient, weight gradient) take float8 operands with dynamic scales, on the H100/H200
(and Ada) float8 tensor cores. The weights stay float32 (the optimizer's), so checkpoints
are those of the plain model.

Kept as ``nn.Linear`` (bfloat16 under autocast): the output head (``skip``'s default) and
every Linear whose ``in_features`` or ``out_features`` is not a multiple of 16 (what the
float8 matmul needs). Recipes are torchao's ``Float8LinearConfig.from_recipe_name``:
``tensorwise`` (one scale per tensor, the fastest) or ``rowwise`` (one per row, power of
two, more accurate).

Under FSDP on NCCL the tensorwise weights are all-gathered in float8
(``enable_fsdp_float8_all_gather``: half the bytes of bfloat16); each weight's scale is
reduced at its all-gather (torchao's ``precompute_float8_dynamic_scale_for_fsdp`` is an
optional batching of those reductions, not used). Refused in one line: torchao missing,
a CUDA GPU older than sm_89, a sharded layout on gloo (gloo has no float8 dtypes) and
tensor parallel (torchao's ``Float8ColwiseParallel`` plans are not wired in yet). On the
CPU torchao's emulation (``emulate=True``) rounds to float8 with the same scales and
multiplies the dequantised values in a wider type (bfloat16 under CPU autocast), so the
feature runs, and is tested, without a GPU.

Example:
    >>> Float8.parse({"recipe": "rowwise"}).recipe
    'rowwise'
    >>> Float8(recipe="blockwise")
    Traceback (most recent call last):
    ...
    ValueError: float8.recipe must be 'tensorwise' or 'rowwise', got 'blockwise'
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.fieldtypes import from_fields

__all__ = ["HEAD_NAMES", "MIN_TORCHAO", "RECIPES", "Float8", "check_available", "convert",
           "float8_linears", "output_heads"]

RECIPES = ("tensorwise", "rowwise")
"""torchao's recipe names ``float8.recipe`` takes."""

HEAD_NAMES = ("head", "lm_head", "output", "classifier")
"""Last name components that mark a Linear as the output head."""

MIN_TORCHAO = (0, 18)
"""The oldest torchao whose float8 API this module was written against."""

_INSTALL = "pip install 'paratrain[float8]'"


@dataclass(frozen=True, kw_only=True)
class Float8:
    """Options of ``precision="float8"`` (``Run(float8=...)``: this, a dict of its fields,
    or None for the defaults).

    Example:
        >>> Float8(skip=["lm_head", "blocks.0.*"]).skip
        ('lm_head', 'blocks.0.*')
    """

    recipe: str = "tensorwise"
    """``tensorwise`` (default) or ``rowwise``: torchao's ``Float8LinearConfig`` recipe."""

    skip: tuple[str, ...] | list[str] | None = None
    """Module names kept as bfloat16 ``nn.Linear``: globs over the dotted name, a name
    without a dot also matches that last component anywhere (``"lm_head"`` matches
    ``model.lm_head``). None: the output head (:func:`output_heads`). Linears whose
    features are not multiples of 16 are kept whatever ``skip`` says."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"float8.recipe must be 'tensorwise' or 'rowwise', "
                             f"got {self.recipe!r}")
        if self.skip is not None:
            if isinstance(self.skip, str) or not isinstance(self.skip, (tuple, list)) or \
                    not all(isinstance(p, str) and p for p in self.skip):
                raise ValueError(f"float8.skip must be a list of module-name patterns "
                                 f"(e.g. ['lm_head']) or None, got {self.skip!r}")
            object.__setattr__(self, "skip", tuple(self.skip))

    @classmethod
    def parse(cls, value: Any) -> Float8:
        """``value`` (None, a dict of the fields or a Float8) as a Float8; ValueError naming
        the bad field otherwise."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"float8 must be a dict such as {{'recipe': 'rowwise'}}, a "
                             f"paratrain.float8.Float8 or None, got {value!r}")
        return from_fields(cls, value, name="float8")

    def skipped_names(self, model: nn.Module) -> tuple[str, ...]:
        """The patterns in force for ``model``: ``skip``, or its output head's name."""
        return self.skip if self.skip is not None else tuple(output_heads(model))

    def module_filter_fn(self, model: nn.Module) -> Callable[[nn.Module, str], bool]:
        """torchao's ``module_filter_fn`` for ``model``: True for the Linears to convert.

        A pattern of ``skip`` that names no Linear of ``model`` is a ValueError (a typo
        would otherwise convert the layer it meant to keep).
        """
        patterns = self.skipped_names(model)
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        for pattern in patterns:
            if not any(_matches(name, pattern) for name in linears):
                shown = ", ".join(linears[:6]) + (", ..." if len(linears) > 6 else "")
                raise ValueError(f"float8.skip pattern {pattern!r} names no nn.Linear of the "
                                 f"model; its Linears are: {shown or 'none'}")

        def keep_float8(module: nn.Module, name: str) -> bool:
            if not isinstance(module, nn.Linear):
                return False
            if module.in_features % 16 or module.out_features % 16:
                return False  # torch._scaled_mm needs multiples of 16
            return not any(_matches(name, pattern) for pattern in patterns)

        return keep_float8

    def linear_config(self, *, emulate: bool, fsdp_float8_all_gather: bool) -> Any:
        """torchao's ``Float8LinearConfig`` of the recipe; float8 all-gather only for
        ``tensorwise`` (torchao supports no other)."""
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(
            config, emulate=emulate,
            enable_fsdp_float8_all_gather=fsdp_float8_all_gather and self.recipe == "tensorwise")


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or (
        "." not in pattern and fnmatch.fnmatchcase(name.rpartition(".")[2], pattern))


def output_heads(model: nn.Module) -> list[str]:
    """The names of ``model``'s output head(s), kept bfloat16 by default.

    The Linears named ``head``, ``lm_head``, ``output`` or ``classifier`` (last name
    component), and the last Linear whose ``out_features`` is the first embedding's
    ``num_embeddings`` (the vocabulary); when there is neither, the model's last Linear.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = [name for name, _ in linears if name.rpartition(".")[2] in HEAD_NAMES]
    # The token table comes first (tok_emb, wte, embed_tokens, word_embeddings), before
    # position tables, which may share a Linear's width.
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)),
                 None)
    sized = [name for name, m in linears if m.out_features == vocab]
    if sized and sized[-1] not in heads:
        heads.append(sized[-1])
    if not heads and linears:
        heads.append(linears[-1][0])
    return heads


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_available(device_type: str) -> None:
    """ValueError naming the fix unless float8 training can run on ``device_type``:
    torchao >= 0.18 importable, and on CUDA a GPU of compute capability 8.9 or newer."""
    # torchao registers an Enum with torch's pytree at import, which logs a deprecation
    # warning on every rank: hushed for the import only.
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ValueError(f"precision='float8' needs torchao: {_INSTALL}") from None
    finally:
        pytree_log.setLevel(level)
    found = getattr(torchao, "__version__", "0")
    if _version(found) < MIN_TORCHAO:
        raise ValueError(f"precision='float8' needs torchao >= "
                         f"{'.'.join(map(str, MIN_TORCHAO))}, found {found}: "
                         f"pip install -U 'paratrain[float8]'")
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ValueError(
                f"precision='float8' needs a GPU with float8 tensor cores (compute capability "
                f"8.9 or newer: L4, L40S, H100, H200); {torch.cuda.get_device_name()} is "
                f"sm_{major}{minor}: use precision='bf16-mixed'")


def _layout(strategy: Any) -> tuple[bool, bool]:
    """(FSDP shards the parameters, tensor parallel splits layers) for ``strategy``: the
    layout strategy's degrees, as :func:`~paratrain.strategies.layout.apply.parallelize`
    reads them. Other strategies keep whole float32 parameters."""
    degrees = getattr(strategy, "degrees", None)
    if degrees is None or not getattr(strategy, "active", False):
        return False, False
    sharded = degrees.data_parallel_degree * degrees.context_degree > 1
    return sharded, degrees.tensor_degree > 1


def _backend() -> str:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return ""
    return str(dist.get_backend())


def convert(model: nn.Module, options: Float8, *, device_type: str,
            strategy: Any = None) -> nn.Module:
    """``model`` with its Linears swapped for torchao's float8 training linears (in place;
    a bare ``nn.Linear`` is returned anew), for the run's device and ``strategy``.

    Emulated on the CPU; float8 all-gather under FSDP on NCCL with ``tensorwise``.
    ValueError, one line, for tensor parallel and for FSDP on another backend than NCCL.
    """
    check_available(device_type)
    sharded, tensor_parallel = _layout(strategy)
    name = getattr(strategy, "name", "this strategy")
    if tensor_parallel:
        raise ValueError(f"precision='float8' with tensor parallel (strategy {name!r}, tp > 1) "
                         "is not supported yet; use tp=1 (ddp, fsdp) or precision='bf16-mixed'")
    if sharded and "nccl" not in _backend():
        raise ValueError(f"precision='float8' with a sharded layout (strategy {name!r}) needs "
                         "NCCL: gloo has no float8 dtypes to all-gather; run on CUDA GPUs, or use "
                         "ddp (or single) on the CPU")
    from torchao.float8 import convert_to_float8_training

    config = options.linear_config(emulate=device_type != "cuda",
                                   fsdp_float8_all_gather=sharded)
    converted = convert_to_float8_training(model, config=config,
                                           module_filter_fn=options.module_filter_fn(model))
    if not any(_is_float8(m) for m in converted.modules()):
        warnings.warn("precision='float8' found no nn.Linear to convert (features multiples "
                      "of 16, not in float8.skip): the run trains as 'bf16-mixed'",
                      stacklevel=2)
    return converted


def _is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def float8_linears(model: nn.Module) -> list[str]:
    """The names of ``model``'s float8 training linears (for checks and reports)."""
    return [name for name, m in model.named_modules() if _is_float8(m)]
