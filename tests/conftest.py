"""Test hygiene: every test starts with a clean environment and no process group.

Tests compute on the CPU also where a GPU is visible, so the suite behaves the same
on a laptop and on a GPU box: every test except those marked ``gpu`` runs with
``PARATRAIN_ACCELERATOR=cpu``, which the processes it starts inherit. Tests marked
``gpu`` run on CUDA and are skipped with one line where none is visible.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paratrain.distributed.device import free_port
from paratrain.testing import pool

REPO = Path(__file__).resolve().parents[1]
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests, with one line, where no CUDA device is visible."""
    # Asked here, before any test changes the environment, and once: CUDA keeps
    # its first answer for the life of the process anyway.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, request):
    """Restore os.environ after each test and start without launcher variables.

    Outside ``gpu`` tests every process computes on the CPU, GPU or not.
    """
    saved = dict(os.environ)
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    # SLURM_*: the suite run inside a Slurm job must not configure its launches from it.
    for name in [n for n in os.environ if n.startswith(("PARATRAIN_", "SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("PARATRAIN_ACCELERATOR", "cpu")
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def destroy_process_groups():
    """No test may leak a process group into the next."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def paratrain_cmd() -> list[str]:
    return [sys.executable, "-m", "paratrain.cli"]


@pytest.fixture(autouse=True, scope="session")
def rank_pools():
    """The persistent rank pools live for the session and stop with it."""
    yield
    pool.close_pools()


def pytest_terminal_summary(terminalreporter):
    """How much the rank pools were reused, and why any was replaced."""
    stats = pool.STATS
    if not stats["tasks"]:
        return
    terminalreporter.write_line(
        f"rank pool: {stats['tasks']} spawn calls on {stats['pools_started']} pool starts; "
        f"{len(stats['retired'])} pools retired; largest worker "
        f"{stats['max_rss'] / 2**30:.1f} GiB")
    for reason in stats["retired"]:
        terminalreporter.write_line(f"  retired after {reason}")
