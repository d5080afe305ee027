"""Device and host utilities shared by the loop, the launcher and the tools."""

from __future__ import annotations

import os
import resource
import socket

import torch

__all__ = ["cpu_threads_per_process", "free_port", "peak_memory_bytes"]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA max allocated, or peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def cpu_threads_per_process(local_world_size: int) -> int:
    """Cores divided evenly among the processes of a node, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_world_size))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
