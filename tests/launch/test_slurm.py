"""``paratrain launch`` inside a Slurm allocation reads Slurm's variables (fake environments)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from paratrain.launch import slurm
from paratrain.launch.kubernetes import explicit_options
from paratrain.launch.launcher import build_parser

# What sbatch --nodes=2 --ntasks-per-node=1 and srun give node 1 of job 4242.
STEP = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
        "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]"}


@pytest.mark.parametrize("expression, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("gpu[1-2],cpu[003-004]", ["gpu1", "gpu2", "cpu003", "cpu004"]),
    ("r[1-2]n[1-2]-ib", ["r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"]),
    ("login,x[9]", ["login", "x9"]),
])
def test_host_lists_expand_like_scontrol(expression, hosts):
    assert slurm.expand_hostlist(expression) == hosts


def test_a_malformed_host_list_is_one_line():
    with pytest.raises(slurm.SlurmError, match=r"^cannot read the Slurm host list 'n\[3-1\]' "
                                               r"\(at '3-1'\)$"):
        slurm.expand_hostlist("n[3-1]")


def _fake_command(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_hostnames_asks_scontrol_first_and_falls_back_to_python(tmp_path, monkeypatch):
    _fake_command(tmp_path, "scontrol", 'echo "from-scontrol"; echo "second"')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm.hostnames("n[1-2]") == ["from-scontrol", "second"]
    _fake_command(tmp_path, "scontrol", "exit 1")  # a broken client
    assert slurm.hostnames("n[1-2]") == ["n1", "n2"]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert slurm.hostnames("n[1-2]") == ["n1", "n2"]


def _apply(argv: list[str], environ: dict[str, str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    job = slurm.detect(environ, hostnames=slurm.expand_hostlist)
    return args, slurm.apply(args, explicit_options(parser, argv), job)


def test_an_srun_step_sets_nodes_rank_master_and_a_port_from_the_job_id():
    args, notices = _apply(["train.py"], {**STEP, "SLURM_GPUS_ON_NODE": "4"})
    assert notices == []
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        "2", 1, "gpu07", 20000 + 4242 % 10000)
    assert args.nproc_per_node == "4"  # the node's GPUs, not the step's one task per node


def test_the_batch_script_takes_processes_from_tasks_per_node_and_keeps_a_free_port():
    batch = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
             "SLURM_JOB_NODELIST": "cn3", "SLURM_NTASKS_PER_NODE": "3"}
    args, _ = _apply(["train.py"], batch)
    assert (args.nnodes, args.nproc_per_node, args.master_addr) == ("1", "3", "cn3")
    assert args.master_port is None  # one node: a free port, never the last attempt's


def test_old_slurm_without_job_num_nodes_uses_nnodes():
    args, _ = _apply(["train.py"], {"SLURM_JOBID": "9", "SLURM_NNODES": "1",
                                    "SLURM_NODELIST": "n1"})
    assert (args.nnodes, args.master_addr) == ("1", "n1")


def test_explicit_flags_win_and_a_conflict_is_one_line():
    args, notices = _apply(["--nproc-per-node", "2", "--master-port", "29999", "train.py"],
                           {**STEP, "SLURM_GPUS_ON_NODE": "4"})
    assert (args.nproc_per_node, args.master_port, args.nnodes) == ("2", 29999, "2")
    assert sorted(notices) == [
        "--master-port 29999 on the command line wins over SLURM_JOB_ID=4242 set by Slurm; "
        "drop the flag to use the job's value",
        "--nproc-per-node 2 on the command line wins over SLURM_GPUS_ON_NODE=4 set by Slurm; "
        "drop the flag to use the job's value"]
    _, notices = _apply(["--nproc-per-node", "4", "train.py"], {**STEP, "SLURM_GPUS_ON_NODE": "4"})
    assert notices == []  # the same value is no conflict


def test_several_launchers_per_node_are_refused_in_one_line():
    step = {**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS_PER_NODE": "4"}
    with pytest.raises(slurm.SlurmError, match=r"^srun started 4 tasks on this node \("
                       r"SLURM_STEP_TASKS_PER_NODE=4\(x2\)\), each a paratrain launch; start "
                       r"one per node: srun --ntasks-per-node=1 paratrain launch "):
        _apply(["train.py"], step)


def test_a_multi_node_job_outside_srun_is_refused_unless_nnodes_is_given():
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(slurm.SlurmError, match=r"^this Slurm job has 2 nodes \("
                       r"SLURM_JOB_NUM_NODES=2\) but paratrain launch runs outside srun"):
        _apply(["train.py"], batch)
    args, _ = _apply(["--nnodes", "1", "train.py"], batch)
    assert args.nnodes == "1"


def test_workers_and_non_slurm_environments_are_left_alone():
    assert not slurm.detect({**STEP, "LOCAL_RANK": "0"})
    args, notices = _apply(["train.py"], {"HOME": "/root"})
    assert (args.nnodes, args.master_addr, notices) == ("1", "127.0.0.1", [])


def test_launch_check_reports_slurm_processes_per_node(tmp_path, monkeypatch, capsys):
    """Wired into ``paratrain launch``: the pre-flight report counts Slurm's processes."""
    from paratrain.launch.launcher import main

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for name, value in {"SLURM_JOB_ID": "11", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
                        "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS_PER_NODE": "3"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", os.defpath)
    assert main(["--check", str(script)]) == 0
    assert "3 process(es)" in capsys.readouterr().out
