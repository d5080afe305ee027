"""The one error every guard in this package raises when torch lacks a private API."""

from __future__ import annotations

import torch


def missing(api: str) -> RuntimeError:
    """One line naming the private API ``api`` and the installed torch version."""
    return RuntimeError(f"torch {torch.__version__} lacks {api}, which paratrain needs here; "
                        "install a torch version paratrain supports (>= 2.6)")
