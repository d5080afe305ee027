"""``verify`` probes its factorizations on local ranks through ``paratrain.distributed.spawn``.

What the probes find is this folder's subject, so its in-process tests run them on the
persistent rank pool (``paratrain.testing.pool``); ``test_verify.py``'s command-line tests
start ``paratrain verify`` as a process, which spawns fresh ranks as users get them.
"""

import pytest

from paratrain.testing import pool
from paratrain.verify import replay, resume, runner


@pytest.fixture(autouse=True)
def probes_on_the_pool(monkeypatch):
    for module in (replay, resume, runner):
        monkeypatch.setattr(module, "spawn", pool.spawn)
