"""The lost-peer line says what happens next: torchrun's restart, or how to get one."""

import pytest

from paratrain.distributed.topology import Topology
from paratrain.reliability.health import HealthMonitor
from paratrain.settings import Settings


@pytest.mark.parametrize("restarts_left, then", [
    (0, "use `paratrain launch --max-restarts N` to restart from the last checkpoint"),
    (2, "torchrun restarts it from the last checkpoint"),
])
def test_the_line_names_the_restart_only_when_one_is_left(restarts_left, then):
    monitor = HealthMonitor(topology=Topology.from_env({}, accelerator="cpu"), every=0,
                            restarts_left=restarts_left)
    line = str(monitor.lost_peer_error(RuntimeError("[pair.cc:1] Connection closed by peer"),
                                       wait_s=0.1))
    assert "a collective failed (Connection closed by peer)" in line
    assert line.endswith(f"the job stops ({then})")


def test_restarts_left_come_from_torchrun():
    env = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"}
    settings = Settings.from_environ(env)
    assert settings.max_restarts - settings.restart_count == 2
