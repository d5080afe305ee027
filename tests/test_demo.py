"""The demo end to end through the real launcher, on real Fashion-MNIST."""

import json
import subprocess
import sys

import pytest

from paratrain.datasets.images import DatasetNotFound, find_fashion_mnist


def have_data():
    try:
        find_fashion_mnist()
        return True
    except DatasetNotFound:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not have_data(), reason="Fashion-MNIST missing: apt-get install dataset-fashion-mnist")
def test_demo_two_workers(tmp_path):
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "demo", "--nproc", "2", "--epochs", "1",
         "--train-samples", "6000", "--json", str(summary_path), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert summary["test_accuracy"] > 0.70  # 1 epoch on a tenth of the data
    assert len(summary["peak_memory_bytes_per_rank"]) == 2
    assert summary["samples_per_s"] > 0
    # Rank 0 alone prints: one line per epoch, not one per rank.
    assert result.stdout.count("epoch 0:") == 1


def test_missing_data_is_one_clear_line(tmp_path, monkeypatch, capfd):
    # In this process: the demo stops at the data check, before any Run or launcher.
    import paratrain.datasets.images as images
    from paratrain.demo import main

    env_dir = tmp_path / "empty"
    env_dir.mkdir()
    monkeypatch.setattr(images, "FASHION_MNIST_DIRS", ())
    assert main(["--data-dir", str(env_dir)]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "apt-get install dataset-fashion-mnist" in lines[0]
