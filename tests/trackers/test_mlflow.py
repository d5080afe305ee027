"""MLflow through its own client: the embedded SQLite store under the checkpoint
directory, and a real ``mlflow server`` on loopback (started once for the module)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from trainer import STEPS_PER_EPOCH, Crash, train

from paratrain.distributed.device import free_port
from paratrain.trackers import MLflowTracker

mlflow = pytest.importorskip("mlflow", reason="pip install 'paratrain[trackers]'")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on a free loopback port with a SQLite backend; killed at the end."""
    directory = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = (directory / "server.log").open("w")
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
         "--default-artifact-root", (directory / "artifacts").as_uri()],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=1).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start: {(directory / 'server.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield uri
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the server and its workers; nothing to keep
        process.wait()
        log.close()


def only_run(uri):
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("paratrain")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def steps(client, run, key):
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def test_embedded_store_holds_configuration_layout_and_metrics(tmp_path):
    losses = train(tmp_path, loggers=["mlflow"], tokens_per_sample=3)
    store = tmp_path / "trackers" / "mlflow.db"
    assert store.is_file()  # under the checkpoint directory
    client, run = only_run(f"sqlite:///{store}")
    params = run.data.params
    assert (params["layout_strategy"], params["world_size"], params["tokens_per_sample"]) == (
        "single", "1", "3")
    assert params["layout"] == "single: 1 data-parallel of 1"
    assert steps(client, run, "loss") == sorted(losses.items())
    assert [s for s, _ in steps(client, run, "samples_per_s")] == [STEPS_PER_EPOCH, 12]
    assert [s for s, _ in steps(client, run, "throughput/tokens_per_s")] == list(range(1, 13))
    assert {"memory/peak_mb", "epoch", "seconds"} <= set(run.data.metrics)
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_server_run_with_each_step_once(tmp_path, server):
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    # Checkpoint at step 4; steps 5 and 6 reach the server, then the run dies.
    with pytest.raises(Crash):
        train(tmp_path / "run", loggers=[MLflowTracker(server)], crash_after=6)
    client, crashed = only_run(server)
    assert crashed.info.status == "FAILED"
    assert [s for s, _ in steps(client, crashed, "loss")] == [1, 2, 3, 4, 5, 6]
    train(tmp_path / "run", loggers=[MLflowTracker(server)])
    client, run = only_run(server)  # the same run, no second one
    assert run.info.run_id == crashed.info.run_id and run.info.status == "FINISHED"
    assert steps(client, run, "loss") == sorted(reference.items())  # each step once, exact
    assert [s for s, _ in steps(client, run, "samples_per_s")] == [STEPS_PER_EPOCH, 12]


def test_a_server_that_is_gone_warns_once_and_training_goes_on(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail now, not in minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    gone = f"http://127.0.0.1:{free_port()}"
    assert train(tmp_path / "run", loggers=[MLflowTracker(gone)]) == reference
    warnings = [line for line in capfd.readouterr().err.splitlines() if "tracker" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("paratrain: warning: tracker mlflow failed (")
    assert warnings[0].endswith("); it is off for the rest of this run, training goes on")


@pytest.mark.slow
def test_a_killed_run_resumes_the_same_run_with_each_step_once(tmp_path):
    # SIGKILL right after step 6 (before it is logged): nothing is flushed at the end, so
    # what reached MLflow after the checkpoint at step 4 is whatever the thread had sent.
    script = (f"from trainer import train; train({str(tmp_path / 'run')!r}, "
              "loggers=['mlflow'])")
    killed = subprocess.run(
        [sys.executable, "-c", script], cwd=Path(__file__).parent, capture_output=True,
        text=True, timeout=300, env={**os.environ, "PARATRAIN_KILL_AT_STEP": "6"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    store = f"sqlite:///{tmp_path / 'run' / 'trackers' / 'mlflow.db'}"
    client, before = only_run(store)
    # Steps before the checkpoint were flushed at the save; step 4's row (logged after its
    # own save) and later ones reached the store or not, depending on the thread's timing.
    assert [s for s, _ in steps(client, before, "loss")][:3] == [1, 2, 3]
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    train(tmp_path / "run", loggers=["mlflow"])
    client, run = only_run(store)
    assert run.info.run_id == before.info.run_id and run.info.status == "FINISHED"
    got, want = steps(client, run, "loss"), sorted(reference.items())
    assert len({step for step, _ in got}) == len(got)  # no step twice
    # Known gap (docs/trackers.md): the row of the checkpoint's own step is logged after
    # that save, so a SIGKILL before the tracker thread sends it loses it for good.
    assert [row for row in got if row[0] != 4] == [row for row in want if row[0] != 4]
