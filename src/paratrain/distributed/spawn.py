"""Run a function on N local gloo ranks and collect what each returns.

Used by the test suite (and usable by anyone testing a strategy): the worker
is a module-level function ``fn(rank, world_size, *args)``; each rank gets the
launcher environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` on a free port,
...) so code under test discovers its topology exactly as under torchrun.

Ranks compute on the CPU unless asked otherwise, also on a machine with GPUs:
``accelerator="cpu"`` sets ``PARATRAIN_ACCELERATOR=cpu`` and hides the GPUs
(``CUDA_VISIBLE_DEVICES=""``) from the children, so a CPU test behaves the same
with or without a GPU. ``accelerator="cuda"`` leaves the GPUs visible.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing as mp

from paratrain.distributed.device import free_port


class WorkerFailed(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback or exit code."""

def _entry(fn: Callable[..., Any], rank: int, world_size: int, env: dict[str, str],
           results: Any, args: tuple) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    try:
        value = fn(rank, world_size, *args)
        # Tensors are sent as bytes: torch's shared-memory passing would need the
        # child alive until the parent has read them.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        from paratrain.distributed.process_group import destroy_process_group

        destroy_process_group()  # collects DDP reducers first (see its docstring)

@contextmanager
def environment_at_start(changes: dict[str, str]) -> Iterator[None]:
    """Set ``changes`` in os.environ while children start, then restore it.

    A spawned child inherits the environment it starts with. CUDA reads
    ``CUDA_VISIBLE_DEVICES`` once, possibly while the child imports the worker's
    module (a ``skipif(torch.cuda.is_available())``), before ``_entry`` runs.
    """
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch_environment(world_size: int, accelerator: str = "cpu") -> dict[str, str]:
    """The variables torchrun would give ``world_size`` local ranks (``RANK`` aside),
    a free ``MASTER_PORT`` and one thread per rank; ``accelerator`` as in ``spawn``."""
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ValueError(f"accelerator must be 'auto', 'cpu' or 'cuda', got {accelerator!r}")
    visibility = {}
    if accelerator != "auto":
        visibility["PARATRAIN_ACCELERATOR"] = accelerator
    if accelerator == "cpu":
        visibility["CUDA_VISIBLE_DEVICES"] = ""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
        **visibility,
    }


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
          env: dict[str, str] | None = None, accelerator: str = "cpu") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``accelerator`` is ``cpu`` (the default: GPUs hidden from the ranks), ``cuda``
    (GPUs visible, ``PARATRAIN_ACCELERATOR=cuda``) or ``auto`` (the environment as is).
    Raises WorkerFailed naming the first rank that failed; every child is killed
    before returning, so nothing is left behind.

    Example:
        >>> spawn(worker, 2)                                            # doctest: +SKIP
        >>> spawn(worker, 1, accelerator="cuda")                        # doctest: +SKIP
    """
    base_env = {**launch_environment(world_size, accelerator), **(env or {})}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, base_env, results, args))
        for rank in range(world_size)
    ]
    # Visibility is fixed at start (see environment_at_start), also a caller's CUDA_VISIBLE_DEVICES.
    at_start = ("PARATRAIN_ACCELERATOR", "CUDA_VISIBLE_DEVICES")
    with environment_at_start({name: base_env[name] for name in at_start if name in base_env}):
        for proc in procs:
            proc.start()
    collected: dict[int, Any] = {}
    try:

        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerFailed(f"timed out after {timeout:.0f} s waiting for ranks "
                                   f"{sorted(set(range(world_size)) - set(collected))}")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in collected]
                if dead:
                    raise WorkerFailed(f"rank {dead[0]} died with exit code "
                                       f"{procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise WorkerFailed(f"rank {rank} raised:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [collected[r] for r in range(world_size)]
