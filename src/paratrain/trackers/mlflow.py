"""MLflow through its own client (``mlflow.MlflowClient``).

Embedded by default: a SQLite store in the run's tracker directory (under
``checkpoint_dir``), read with ``mlflow ui --backend-store-uri sqlite:///...``. A
tracking server (``mlflow server``) is the same code with another URI.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from paratrain.trackers.base import Tracker

_PARAM_CHARS = 6000  # MLflow's limit on one parameter value


class MLflowTracker(Tracker):
    """Log to MLflow: parameters once, metrics with the optimizer step.

    Args:
        tracking_uri: ``http://host:5000`` for a server, ``sqlite:///path.db`` or a
            folder; None: ``MLFLOW_TRACKING_URI`` when set, else
            ``sqlite:///<checkpoint_dir>/trackers/mlflow.db``.
        experiment: experiment name (created if missing).
        run_name: the run's display name (MLflow picks one when None).
        tags: tags set on the run when it is created.
    """

    name = "mlflow"
    package = "mlflow"

    def __init__(self, tracking_uri: str | None = None, *, experiment: str = "paratrain",
                 run_name: str | None = None, tags: dict[str, str] | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None

    def start(self, *, params: dict[str, Any], directory: Path,
              resume: dict[str, Any] | None) -> dict[str, int] | None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            directory.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(directory / 'mlflow.db').resolve()}"
            # Else MLflow puts artifacts in ./mlruns of whatever the working directory is.
            artifacts = (directory / "mlflow-artifacts").resolve().as_uri()
        self._client = client = MlflowClient(tracking_uri=uri)
        if resume is not None and resume.get("run_id"):
            self.run_id = resume["run_id"]
            run = client.get_run(self.run_id)
            client.update_run(self.run_id, status="RUNNING")
            # Steps after the checkpoint that reached MLflow before the interruption.
            return {key: max(m.step for m in client.get_metric_history(self.run_id, key))
                    for key in run.data.metrics}
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else \
            client.create_experiment(self.experiment, artifact_location=artifacts)
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        client.log_batch(self.run_id, params=[Param(k, str(v)[:_PARAM_CHARS])
                                              for k, v in params.items()])
        return None

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                     for k, v in metrics.items()])

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def finish(self, *, failed: bool) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")

    def __repr__(self) -> str:
        return f"MLflowTracker(tracking_uri={self.tracking_uri!r}, experiment={self.experiment!r})"
