"""Hugging Face checkpoints: safetensors files that ``transformers`` loads, and back.

* :func:`save_pretrained` writes one module's weights as ``model.safetensors`` (or
  ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``) under
  the model's own parameter names, gathered one output file at a time from whatever
  layout holds them, plus ``config.json`` for a ``transformers`` model.
* :func:`load_pretrained` reads such a directory into a prepared (possibly sharded)
  module; each rank reads only the slices its DTensor shards hold.
* Models built on the meta device (:mod:`~paratrain.checkpoint.meta_init`)
  are materialised shard by shard by ``run.prepare``, then filled by :func:`load_pretrained`.

The writer is ``safetensors.torch.save_file``, not DCP's ``HuggingFaceStorageWriter``:
that one writes every rank's pieces and consolidates them in a second pass over the
files; here rank 0 receives each whole tensor once and writes each file once, which
keeps the memory bound (one output file plus the largest tensor) and the bytes of a
single-process export. The reader is DCP's ``HuggingFaceStorageReader``
(``get_slice`` per requested piece).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint import gather

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _require_safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        # RuntimeError, as for the other extras: the excepthook prints it as one line.
        raise RuntimeError("Hugging Face checkpoints need safetensors, which is not "
                           "installed; install the hf extra: pip install 'paratrain[hf]'") from None


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` as
    ``transformers`` writes it (GB = 10**9 bytes, GiB = 2**30)."""
    if isinstance(size, int) and not isinstance(size, bool):
        number, unit = size, ""
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if match is None:
            raise ValueError(f"max_shard_size must be bytes or a size like '5GB', got {size!r}")
        number, unit = float(match.group(1)), match.group(2) or ""
    if number <= 0:
        raise ValueError(f"max_shard_size must be > 0, got {size!r}")
    return int(number * _UNITS[unit])


def plan_files(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names per output file, in order: a file is closed when the next tensor would
    pass ``max_bytes``; a tensor larger than that gets a file of its own (as
    ``huggingface_hub``'s ``split_torch_state_dict_into_shards`` does)."""
    files: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_bytes:
            files.append([name])
            continue
        if current and current_size + size > max_bytes:
            files.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        files.append(current)
    return files or [[]]


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _storage_key(value: torch.Tensor) -> tuple | None:
    """What makes two state-dict entries the same tensor (tied weights); None if empty."""
    local = gather.local(value)
    if local.numel() == 0 or local.device.type == "meta":
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(value.shape),
            local.stride(), local.dtype)


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state under its own names (no ``_orig_mod.``/``module.``/wrapper
    prefixes), as this rank holds it (DTensors stay sharded), with tied copies dropped:
    a tensor that shares storage with an earlier entry is left out, as ``transformers``
    writes a tied ``lm_head.weight``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state, seen = {}, set()
    for name, value in get_model_state_dict(module).items():
        key = _storage_key(value)
        if key is not None and key in seen:
            continue
        seen.add(key)
        state[name] = value
    return state


def check_target(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"save_pretrained: {path} is a file, not a directory; "
                         "give a directory path")
    return path


def save_pretrained(directory: str | os.PathLike, module: nn.Module, *,
                    max_shard_size: int | str = "5GB", main: bool = True,
                    partial: bool = False) -> list[str]:
    """Write ``module``'s weights to ``directory`` as ``transformers`` does (collective).

    Called on every rank with the module as the rank holds it; only ``main`` writes.
    Each output file's tensors are gathered, written and dropped before the next file's,
    one tensor at a time, so no rank holds more than one file plus the largest tensor
    beyond its own shards. Returns the files written (on ``main``; [] elsewhere).

    Example:
        >>> save_pretrained("out/", model)                    # doctest: +SKIP
        >>> transformers.AutoModelForCausalLM.from_pretrained("out/")  # doctest: +SKIP
    """
    _require_safetensors()
    from safetensors.torch import save_file

    path = check_target(directory)
    limit = parse_size(max_shard_size)
    state = model_state(module)
    listing = gather.listing(state, partial)
    owners = {name: rest for name, _, *rest in listing}
    plan = plan_files([(name, size) for name, size, *_ in listing], limit)
    # Where this rank's tensors live: the process group communicates there.
    device = next((gather.local(v).device for v in state.values()), torch.device("cpu"))
    names = file_names(len(plan))
    if main:
        path.mkdir(parents=True, exist_ok=True)
        _remove_stale(path, set(names))
    weight_map, total, count = {}, 0, 0
    for file_name, members in zip(names, plan):
        tensors = {}
        for name in members:
            tensor = gather.whole_on_main(state.get(name), *owners[name], main, device)
            if tensor is not None:
                tensors[name] = tensor
                total += tensor.numel() * tensor.element_size()
                count += tensor.numel()
            weight_map[name] = file_name
        if main:
            temporary = path / (file_name + ".tmp")
            save_file(tensors, str(temporary), metadata={"format": "pt"})
            os.replace(temporary, path / file_name)
        del tensors
    if not main:
        return []
    if len(names) > 1:
        index = {"metadata": {"total_parameters": count, "total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _save_config(module, path)
    return [str(path / name) for name in names]


def _remove_stale(path: Path, keep: set[str]) -> None:
    """Drop model files of an earlier save that this one does not rewrite: a loader
    would otherwise find two sets of weights in one directory."""
    for old in path.glob("model*.safetensors*"):
        if old.name not in keep and (old.name.endswith(".safetensors")
                                     or old.name == INDEX_FILE):
            old.unlink()


def _save_config(module: nn.Module, path: Path) -> None:
    """``config.json`` (and ``generation_config.json``) of a ``transformers`` model, with
    the fields its own ``save_pretrained`` fills in; nothing for other models."""
    config = getattr(module, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return
    floating = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if floating is not None:
        config.dtype = str(floating).split(".")[1]
    # FSDP2 renames the class of a module it wraps (FSDPGPT2LMHeadModel).
    config.architectures = [type(module).__name__.removeprefix("FSDP")]
    config.save_pretrained(str(path))
    can_generate = getattr(module, "can_generate", None)
    generation = getattr(module, "generation_config", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(str(path))


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint directory (one line if absent)."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"load_pretrained: {path} is not a directory; give the "
                                "directory save_pretrained wrote")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"load_pretrained: {index} is not a safetensors index "
                             f"({type(exc).__name__}); write it again") from None
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"load_pretrained: {path} holds neither {SINGLE_FILE} nor "
                                f"{INDEX_FILE}; give a directory written by save_pretrained")
    missing = [file for file in files if not file.is_file()]
    if missing:
        raise FileNotFoundError(f"load_pretrained: {missing[0]} named by {INDEX_FILE} is "
                                f"missing ({len(missing)} of {len(files)} files); copy all "
                                "the files of the checkpoint")
    return files


def saved_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of every tensor in ``files`` (their headers only)."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            for name in opened.keys():
                shapes[name] = tuple(opened.get_slice(name).get_shape())
    return shapes


def load_pretrained(directory: str | os.PathLike, module: nn.Module, *,
                    partial: bool = False, aliases: dict[str, str] | None = None) -> None:
    """Read a safetensors checkpoint into ``module`` as this rank holds it (collective).

    A DTensor parameter reads only its local shard (``get_slice``), so no rank reads
    or holds the whole model. Names, shapes and files are checked first: a mismatch is
    one line naming the first tensor. A tied copy left out of the files (as
    ``transformers`` writes them) is filled by the tensor it shares.

    ``partial``: ``module`` is part of the model (a pipeline stage): it reads its own
    tensors only, the files' others belong to other ranks. ``aliases``: for a tied copy
    whose other holder is on another rank (a head on the last stage tied to the
    embedding on the first), the name the files give the tensor.

    Example:
        >>> load_pretrained("gpt2-finetuned/", run.strategy.unwrap(model))  # doctest: +SKIP
    """
    _require_safetensors()
    import torch.distributed.checkpoint as dcp

    files = checkpoint_files(directory)
    found = saved_shapes(files)
    state = model_state(module)
    if any(value.device.type == "meta" for value in state.values()):
        raise ValueError("load_pretrained: the model is still on the meta device; "
                         "pass it through run.prepare() first, which materialises it")
    # A tied copy is read under the name the files hold it by.
    state = {name if name in found else (aliases or {}).get(name, name): value
             for name, value in state.items()}
    problem = _mismatch(state, found, partial=partial)
    if problem:
        raise ValueError(f"load_pretrained: {directory} does not match the model: {problem}")
    from paratrain.checkpoint.sharded import _single_process_quiet

    with _single_process_quiet():  # one process reads without a group on purpose
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)),
                 no_dist=not dist.is_initialized())


def _mismatch(state: dict[str, torch.Tensor], found: dict[str, tuple[int, ...]], *,
              partial: bool = False) -> str | None:
    missing = [name for name in state if name not in found]
    if missing:
        return (f"it has no tensor {missing[0]!r} ({len(missing)} of the model's "
                f"{len(state)} missing)")
    # Part of the model (a pipeline stage): the files' other tensors are other ranks'.
    unexpected = [] if partial else [name for name in found if name not in state]
    if unexpected:
        return f"it holds {unexpected[0]!r}, which the model does not have"
    for name, value in state.items():
        if tuple(value.shape) != found[name]:
            return (f"{name!r} is {list(found[name])} in the files but "
                    f"{list(value.shape)} in the model")
    return None
