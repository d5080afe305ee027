"""Reliability pieces without processes: stop signals become stop requests, wait notices,
config fingerprints and the first rank that diverged."""

from __future__ import annotations

import os
import time

import pytest
import torch

from paratrain.reliability.health import first_divergent

# -- pure logic --------------------------------------------------------------------------

def test_first_divergent_rank():
    assert first_divergent([[1, 2], [1, 2], [1, 2]]) is None
    assert first_divergent([[1, 2], [1, 3], [1, 2]]) == (1, 0)
    assert first_divergent([[9], [1], [1]]) == (0, 1)  # the majority is the reference
    assert first_divergent([[1], [2]]) == (1, 0)  # a tie: rank 0's row


def test_config_fingerprint_ignores_object_addresses_and_local_paths():
    from paratrain.config import RunConfig
    from paratrain.reliability.health import config_fingerprint

    def fingerprint(**kwargs):
        return config_fingerprint(RunConfig(**kwargs))[1]

    assert torch.equal(fingerprint(checkpoint_dir="/a"), fingerprint(checkpoint_dir="/b"))
    names, base = config_fingerprint(RunConfig())
    changed = fingerprint(seed=1)
    assert [n for n, a, b in zip(names, base, changed) if a != b] == ["seed"]


@pytest.mark.parametrize("signum, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_stop_signal_becomes_a_stop_request_and_the_handler_is_restored(signum, code):
    import signal as signals_module

    from paratrain.reliability.signals import GracefulStop

    signum = getattr(signals_module, signum)
    before = signals_module.getsignal(signum)
    stop = GracefulStop(group=None, enabled=True)
    try:
        assert stop.installed and not stop.should_stop()
        os.kill(os.getpid(), signum)  # would end pytest without the handler
        time.sleep(0.1)
        assert stop.should_stop()
        assert stop.signal == signum and stop.exit_code == code
    finally:
        stop.close()
    assert signals_module.getsignal(signum) == before


def test_wait_notices_come_at_the_interval(capsys):
    from paratrain.reliability import waits
    from paratrain.settings import Settings

    with pytest.raises(ValueError, match="PARATRAIN_WAIT_REPORT_S='0' must be a number"):
        Settings.from_environ({"PARATRAIN_WAIT_REPORT_S": "0"})
    assert Settings.from_environ({}).wait_report_s == 30.0
    with waits.reporting(lambda s: f"waited {s:.1f}", interval_s=0.3, first_after_s=0.1):
        time.sleep(0.85)
    lines = capsys.readouterr().err.splitlines()
    assert 2 <= len(lines) <= 4 and all(line.startswith("waited ") for line in lines), lines
    with waits.reporting(lambda s: "never", interval_s=0.1, first_after_s=0.1,
                         done=lambda: True):
        time.sleep(0.7)
    assert capsys.readouterr().err == ""


def test_a_run_that_fails_late_in_its_set_up_leaves_no_signal_handler(monkeypatch, tmp_path):
    import signal as signals_module

    import paratrain
    from paratrain.run import build

    def broken_metrics(*args, **kwargs):
        raise OSError("metrics file not writable")

    # The last pieces are built after SIGTERM/SIGINT handlers are installed.
    monkeypatch.setattr(build, "MetricsLog", broken_metrics)
    before = {sig: signals_module.getsignal(sig)
              for sig in (signals_module.SIGTERM, signals_module.SIGINT)}
    with pytest.raises(OSError, match="metrics file not writable"):
        paratrain.Run(strategy="single", accelerator="cpu", progress=False,
                      checkpoint_dir=str(tmp_path / "ckpt"),
                      metrics_path=str(tmp_path / "metrics.jsonl"))
    assert {sig: signals_module.getsignal(sig) for sig in before} == before


def test_grace_seconds_must_be_positive():
    from paratrain.settings import Settings

    for raw in ("-1", "0", "soon"):
        with pytest.raises(ValueError, match=f"PARATRAIN_TERM_GRACE_S='{raw}' must be a "
                                             "number of seconds > 0"):
            Settings.from_environ({"PARATRAIN_TERM_GRACE_S": raw})
    assert Settings.from_environ({"PARATRAIN_TERM_GRACE_S": "2.5"}).term_grace_s == 2.5
