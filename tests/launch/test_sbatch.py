"""``paratrain slurm ... -- script.py``: the batch script it writes, and its one-line errors."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from paratrain.launch import sbatch


@pytest.fixture
def script(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return path


def test_the_script_asks_for_nodes_signal_requeue_and_runs_srun_paratrain_launch(script,
                                                                                capsys):
    code = sbatch.main(["--nodes", "2", "--gpus-per-node", "4", "--time", "4:00:00", "-p", "gpu",
                        "--qos", "high", "--mem=64G", "--", "--parallel", "dp_shard=-1,tp=2",
                        "train.py", "--epochs", "3"])
    assert code == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == script.parent / "train.sbatch"
    text = path.read_text()
    assert [line for line in text.splitlines() if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=train", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=4", "#SBATCH --gpus-per-node=4", "#SBATCH --time=4:00:00",
        "#SBATCH --partition=gpu", "#SBATCH --output=slurm-%x-%j.out",
        "#SBATCH --open-mode=append", "#SBATCH --signal=USR1@90", "#SBATCH --requeue",
        "#SBATCH --qos=high", "#SBATCH --mem=64G"]
    assert text.startswith("#!/bin/bash\n")
    srun = text.splitlines()[-1]
    assert srun.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 ")
    assert srun.endswith(" launch --nproc-per-node 4 --parallel dp_shard=-1,tp=2 train.py "
                         "--epochs 3")
    assert "PARATRAIN_REQUEUE_SIGNAL" not in text  # USR1 is the default


def test_another_signal_is_exported_to_the_runs(script, capsys):
    assert sbatch.main(["--signal", "usr2@300", "--no-requeue", "--nproc-per-node", "2",
                        "--write", "job.sh", "--", "train.py"]) == 0
    text = (script.parent / "job.sh").read_text()
    assert "#SBATCH --signal=USR2@300" in text and "#SBATCH --no-requeue" in text
    assert "#SBATCH --cpus-per-task=2" in text
    assert "export PARATRAIN_REQUEUE_SIGNAL=USR2\n" in text


def test_submit_hands_the_script_to_sbatch(script, monkeypatch, capsys):
    fake = script.parent / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text('#!/bin/sh\necho "Submitted batch job 31 ($1)"\n')
    (fake / "sbatch").chmod(0o755 | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(fake))
    assert sbatch.main(["--submit", "--", "train.py"]) == 0
    path = script.parent / "train.sbatch"
    assert capsys.readouterr().out.splitlines() == [str(path), f"Submitted batch job 31 ({path})"]


@pytest.mark.parametrize("argv, line", [
    (["train.py"], "put the launch command after --: paratrain slurm [sbatch options] -- "
                   "[launch flags] train.py [args]"),
    (["--"], "nothing to run after --; give the training script: paratrain slurm ... -- "
             "train.py [args]"),
    (["--", "missing.py"], "script 'missing.py' not found; check the path"),
    (["--time", "1h", "--", "train.py"],
     "--time '1h' is not a Slurm time; use MINUTES, HH:MM:SS or DAYS-HH:MM:SS"),
    (["--signal", "B:USR1@60", "--", "train.py"],
     "--signal 'B:USR1@60': B: would not reach the training processes; use e.g. USR1@90 "
     "(sent to the srun step)"),
    (["--signal", "TERM@60", "--", "train.py"],
     "--signal 'TERM@60' must be SIG[@SECONDS] with a catchable signal other than TERM/INT, "
     "e.g. USR1@90"),
    (["--nodes", "0", "--", "train.py"], "--nodes must be >= 1, got 0"),
    (["--", "--nnodes", "2", "train.py"],
     "--nnodes after -- would contradict the Slurm allocation; give --nodes before -- instead"),
    (["--", "--master-port", "2", "train.py"],
     "--master-port after -- would contradict the Slurm allocation; drop it: Slurm's value is "
     "used"),
    (["high", "--", "train.py"], "'high' before -- is neither an option nor an option's value; "
                                 "put the script and its arguments after --"),
])
def test_bad_requests_are_one_line(script, capsys, argv, line):
    assert sbatch.main(argv) == 2
    assert capsys.readouterr().err == f"paratrain slurm: {line}\n"
    assert not (script.parent / "train.sbatch").exists()


def test_paratrain_slurm_is_a_command():
    from paratrain.cli import COMMANDS

    assert COMMANDS["slurm"][0] == "paratrain.launch.sbatch:main"
