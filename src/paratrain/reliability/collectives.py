"""A per-rank record of the collectives each rank entered, to name the stuck one.

While a :class:`~paratrain.Run` is active, the Python-level collectives of
``torch.distributed`` (``dist.all_reduce``, ``all_gather``, ``broadcast``,
``reduce_scatter_tensor``, ``barrier``, ...) are wrapped: each call records its
operation, dtype, shape, process group and the user's call site (the first
frame outside torch and paratrain) in a small ring buffer, then runs the
original. The run also marks its loop phase (forward, backward, step), because
DDP's gradient all-reduces run in C++ inside backward and never pass through
Python. :mod:`paratrain.reliability.hang` watches the record and, when a collective waits
too long, compares it across ranks and prints one line per divergent rank.

Why patch module attributes: torch has no public hook that runs when a Python
collective is *entered* (``_register_on_completion_hook`` fires on completion
and exists for NCCL only; the flight recorder is NCCL-only and private). The
originals are kept by the :class:`CollectiveRecorder` that installed them and
restored by :meth:`CollectiveRecorder.close`; nothing else is stored at module
level. Code that bound a function before the run started (``from
torch.distributed import all_reduce``) is not seen.
"""

from __future__ import annotations

import collections
import inspect
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Positional index or keyword of the tensor that describes each collective (the input).
_TENSOR_ARG: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input"),
    "all_to_all": (1, "input_tensor_list"), "all_to_all_single": (1, "input"),
    "gather": (0, "tensor"), "scatter": (0, "tensor"), "send": (0, "tensor"),
    "recv": (0, "tensor"), "barrier": (-1, ""),
    "all_gather_object": (1, "obj"), "broadcast_object_list": (0, "object_list"),
    "gather_object": (0, "obj"), "scatter_object_list": (1, "scatter_object_input_list"),
}
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
           torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8"}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# The package root (this file sits one folder below it).
_PARATRAIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_HISTORY = 16
_WRAPPED = "__paratrain_recorder__"


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~2 us more per collective
class Entry:
    """One collective as a rank entered it."""

    op: str
    what: str
    """``f32[64,128]``, ``2 x f32[64]``, ``object`` or ``""`` (barrier)."""
    group: Any
    """The process group object (None: the default group); resolved to ranks when reported."""
    site: str
    """``file.py:88``: the first caller outside torch and paratrain."""
    seq: int
    """How many recorded collectives this rank entered before this one."""
    start: float
    """``time.monotonic()`` at entry."""


def call_site(skip: int = 1) -> str:
    """``basename:line`` of the innermost frame outside torch and paratrain (else the innermost)."""
    frame = sys._getframe(skip + 1)
    first = frame
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name.startswith(_PARATRAIN_DIR)):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{os.path.basename(first.f_code.co_filename)}:{first.f_lineno}" if first else "?"


def describe(value: Any) -> str:
    """Short text for a collective's tensor argument: ``f32[431242]``, ``3 x f32[64]``."""
    if isinstance(value, torch.Tensor):
        dtype = _DTYPES.get(value.dtype, str(value.dtype).removeprefix("torch."))
        return f"{dtype}[{','.join(str(d) for d in value.shape)}]"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return f"{len(value)} x {describe(value[0])}"
    return "" if value is None else "object"


def group_label(group: Any) -> str:
    """``""`` for the default group, else ``group [0, 2]`` (its global ranks)."""
    if group is None or group is getattr(dist.GroupMember, "WORLD", None):
        return ""
    try:
        return f"group {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError, KeyError):
        return "another group"


class _Phase:
    """Context manager that marks the loop phase and the user's line that entered it."""

    __slots__ = ("recorder", "name")

    def __init__(self, recorder: CollectiveRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def __enter__(self) -> None:
        rec = self.recorder
        if rec.phase is None:  # nested phases (DDP forward inside step) keep the outer one
            rec.phase = (self.name, call_site(1), time.monotonic())
            rec._phase_owner = self

    def __exit__(self, *exc: Any) -> None:
        if self.recorder._phase_owner is self:
            self.recorder.phase = None
            self.recorder._phase_owner = None


class CollectiveRecorder:
    """Records the collectives this process enters while installed.

    Args:
        history: how many past collectives to keep.

    Example:
        >>> recorder = CollectiveRecorder().install()   # doctest: +SKIP
        >>> dist.all_reduce(t); recorder.last[-1].op     # doctest: +SKIP
        'all_reduce'
    """

    def __init__(self, *, history: int = _HISTORY) -> None:
        self.last: collections.deque[Entry] = collections.deque(maxlen=history)
        self.current: Entry | None = None
        """The blocking collective this rank is in now (async ones only enter ``last``)."""
        self.phase: tuple[str, str, float] | None = None
        """``(name, site, since)`` of the loop phase the Run is in, else None."""
        self.count = 0
        self._phase_owner: _Phase | None = None
        self._originals: dict[str, Callable[..., Any]] = {}

    def phase_scope(self, name: str) -> _Phase:
        """A context manager marking ``name`` (forward, backward, step) as the current phase."""
        return _Phase(self, name)

    # -- installation ----------------------------------------------------------
    def install(self) -> CollectiveRecorder:
        """Wrap the ``torch.distributed`` collectives; a second recorder leaves them alone."""
        for name in _TENSOR_ARG:
            original = getattr(dist, name, None)
            if original is None or hasattr(original, _WRAPPED):
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def close(self) -> None:
        """Restore the original functions (those still wrapped by this recorder)."""
        for name, original in self._originals.items():
            if getattr(getattr(dist, name, None), _WRAPPED, None) is self:
                setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        index, key = _TENSOR_ARG[name]
        params = list(inspect.signature(original).parameters)
        group_at = params.index("group") if "group" in params else -1
        async_at = params.index("async_op") if "async_op" in params else -1
        recorder = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = args[index] if 0 <= index < len(args) else kwargs.get(key)
            group = args[group_at] if 0 <= group_at < len(args) else kwargs.get("group")
            is_async = (args[async_at] if 0 <= async_at < len(args)
                        else kwargs.get("async_op", False))
            entry = Entry(name, describe(value), group, call_site(1), recorder.count,
                          time.monotonic())
            recorder.count += 1
            recorder.last.append(entry)
            if is_async:
                return original(*args, **kwargs)
            recorder.current = entry
            try:
                return original(*args, **kwargs)
            finally:
                recorder.current = None

        wrapper.__name__ = name
        wrapper.__doc__ = original.__doc__
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(wrapper, _WRAPPED, self)
        return wrapper

    # -- what the watchdog sends -------------------------------------------------
    def snapshot(self, *, now: float | None = None) -> dict[str, Any]:
        """Where this rank is, as plain data (JSON-able) for the cross-rank comparison."""
        now = time.monotonic() if now is None else now
        current, phase = self.current, self.phase
        last = self.last[-1] if self.last else None
        return {
            "current": _entry_dict(current, now) if current is not None else None,
            "phase": list(phase[:2]) + [round(now - phase[2], 1)] if phase else None,
            "last": _entry_dict(last, now) if last is not None else None,
            "count": self.count,
        }


def _entry_dict(entry: Entry, now: float) -> dict[str, Any]:
    return {"op": entry.op, "what": entry.what, "group": group_label(entry.group),
            "site": entry.site, "seq": entry.seq, "age": round(now - entry.start, 1)}
