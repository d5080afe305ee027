"""Ray Train: a paratrain training function in a ``TorchTrainer`` job computes the same bits
as under ``paratrain launch``; without Ray, one line names the extra.

The job runs on a local Ray cluster started once for this module (CPU, 2 workers) and
shut down at its end, with every process it started gone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_train.py"
MISSING = ("Ray Train is not installed (ray is missing); install the ray extra: "
           "pip install 'paratrain[ray]'")


def load_example():
    spec = importlib.util.spec_from_file_location("example_ray_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def without_ray(monkeypatch):
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as when not installed


def test_without_ray_the_helper_and_the_example_name_the_extra(monkeypatch):
    without_ray(monkeypatch)
    from paratrain.cluster import ray as cluster_ray

    with pytest.raises(RuntimeError) as error:
        cluster_ray.TorchTrainer  # noqa: B018 - the lazy import is what is tested
    assert str(error.value) == MISSING
    with pytest.raises(SystemExit) as exit_:
        load_example().main(["--workers", "2"])
    assert exit_.value.code == f"paratrain: {MISSING}"


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed: "
                        "pip install 'paratrain[ray]' (make install does)")
    import psutil
    import ray

    before = set(psutil.Process().children(recursive=True))
    try:
        # "local": a cluster of its own, never one another session started on this machine.
        # 3 CPUs: 2 workers and Ray Train V1's trainer actor (Ray < 2.5x, RAY_TRAIN_V2_ENABLED=0).
        ray.init(address="local", num_cpus=3, include_dashboard=False)
    except Exception as exc:  # noqa: BLE001 - any failure to start means: skip, in one line
        ray.shutdown()
        pytest.skip(f"a local Ray cluster did not start: {str(exc).strip().splitlines()[0]}")
    names = [p.name() for p in psutil.Process().children(recursive=True) if p not in before]
    assert "raylet" in names and "gcs_server" in names
    yield ray
    # Taken last: the workers and actors the jobs started are the raylet's children too.
    started = [p for p in psutil.Process().children(recursive=True) if p not in before]
    ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert [p.name() for p in alive] == []  # no raylet, gcs_server or worker left behind


@pytest.mark.slow
def test_a_ray_train_job_computes_what_paratrain_launch_computes(ray_cluster, tmp_path):
    example = load_example()
    # Ray ships the training function to its workers by value: this module is no package.
    ray_cluster.cloudpickle.register_pickle_by_value(example)
    config = {"epochs": 2, "samples": 64, "batch_size": 8, "lr": 0.1, "seed": 3,
              "strategy": "ddp", "accelerator": "cpu"}
    args = [f"--{name.replace('_', '-')}={value}" for name, value in config.items()]
    # Ray gives each 1-CPU worker one thread; the same here, so every kernel runs the
    # same arithmetic (and gloo's sum of two ranks is exact in either order). Started
    # first: both jobs spend most of their time starting processes.
    launched = subprocess.Popen(
        [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2", str(EXAMPLE),
         *args, f"--checkpoint-dir={tmp_path / 'launch'}", f"--json={tmp_path / 'launch.json'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        example.fit_on_ray({**config, "checkpoint_dir": str(tmp_path / "ray"),
                            "json": str(tmp_path / "ray.json")}, workers=2,
                           storage_path=str(tmp_path / "ray_results"))
        _, stderr = launched.communicate(timeout=240)
    finally:
        launched.kill()  # only still running when the Ray job failed or it timed out
    assert launched.returncode == 0, stderr[-3000:]

    on_ray = json.loads((tmp_path / "ray.json").read_text())
    under_launch = json.loads((tmp_path / "launch.json").read_text())
    # 64 samples / (8 per worker x 2 workers) = 4 steps an epoch, 2 epochs.
    assert on_ray["world_size"] == 2 and on_ray["strategy"] == "ddp"
    assert on_ray["global_steps"] == 8 and len(on_ray["losses"]) == 8
    assert on_ray == under_launch  # every loss, bit for bit
    # Both wrote their checkpoints into the directory given, on this machine's filesystem.
    saved = sorted(p.name for p in (tmp_path / "ray").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "launch").iterdir())
    assert saved == ["step-000000004.pt", "step-000000008.pt"]
    final = [torch.load(tmp_path / where / saved[-1], weights_only=False)
             for where in ("ray", "launch")]
    for got, want in zip(final[0]["models"][0].values(), final[1]["models"][0].values()):
        assert torch.equal(got, want)
    for got, want in zip(final[0]["optimizers"][0]["state"].values(),
                         final[1]["optimizers"][0]["state"].values()):
        assert torch.equal(got["momentum_buffer"], want["momentum_buffer"])
