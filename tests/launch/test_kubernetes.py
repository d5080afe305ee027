"""Kubernetes: the flags a Kubeflow pod's environment sets, with fake environments."""

import os
import subprocess
import sys

import pytest

from paratrain.launch import kubernetes, preflight
from paratrain.launch.launcher import build_parser

TRAINER = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}
LEGACY = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0",
          "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}


def parse_with(environ, *argv):
    """The launcher's args for ``argv`` in a pod with ``environ``, and the notices."""
    parser = build_parser()
    argv = [*argv, "train.py"]
    args = parser.parse_args(argv)
    notices = kubernetes.apply(args, kubernetes.explicit_options(parser, argv),
                               kubernetes.detect(environ))
    return args, notices


def test_kubeflow_trainer_environment_needs_no_flags():
    args, notices = parse_with(TRAINER)
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr,
            args.master_port) == ("2", "4", 1, "job-node-0-0.job", 29400)
    assert notices == []


def test_older_pytorchjob_world_size_counts_pods():
    args, _ = parse_with(LEGACY)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        "3", 2, "job-master-0", 23456)
    assert args.nproc_per_node == "1"  # the launcher's default: WORLD_SIZE is not processes


@pytest.mark.parametrize("drop, add", [
    ("KUBERNETES_SERVICE_HOST", {}),  # not in a pod: MASTER_ADDR etc. may be anyone's
    (None, {"LOCAL_RANK": "0"}),  # a worker of some launcher, not a pod's launcher
])
def test_legacy_names_are_read_only_in_a_pod_outside_a_worker(drop, add):
    environ = {k: v for k, v in LEGACY.items() if k != drop} | add
    assert not kubernetes.detect(environ)


def test_pet_variables_win_over_the_legacy_ones():
    pod = kubernetes.detect({**LEGACY, "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2",
                             "WORLD_SIZE": "6"})  # a newer operator: WORLD_SIZE is processes
    assert (pod.values["nnodes"], pod.sources["nnodes"]) == ("3", "PET_NNODES=3")
    assert pod.values["node_rank"] == 2  # RANK: no PET_NODE_RANK given


def test_explicit_flags_win_and_a_conflict_is_one_line():
    args, notices = parse_with(TRAINER, "--nproc-per-node", "2", "--master-port", "29400")
    assert args.nproc_per_node == "2" and args.nnodes == "2"
    assert notices == ["--nproc-per-node 2 on the command line wins over PET_NPROC_PER_NODE=4 "
                       "set by Kubernetes; drop the flag to use the job's value"]


def test_a_node_count_conflict_is_left_to_the_preflight_check():
    args, notices = parse_with(TRAINER, "--nnodes", "3")
    assert args.nnodes == "3" and notices == []
    assert preflight.scheduler_problems(args.nnodes, args.node_rank, TRAINER) == [
        "--nnodes is 3 but the Kubernetes job has 2 node(s) (PET_NNODES=2); drop --nnodes to "
        "use the job's"]


def test_explicit_options_are_those_on_the_command_line():
    parser = build_parser()
    given = kubernetes.explicit_options(parser, ["--nnodes", "1", "--check", "t.py", "--lr"])
    assert given == {"nnodes", "check", "script", "script_args"}


def test_a_bad_pod_variable_is_one_line():
    with pytest.raises(kubernetes.KubernetesError) as info:
        kubernetes.detect({"PET_NODE_RANK": "one"})
    assert str(info.value) == ("PET_NODE_RANK='one' is not a valid int for --node-rank; fix the "
                               "job's environment or pass the flag")


def test_launch_in_a_fake_pod_takes_the_process_count_from_it(tmp_path):
    script = tmp_path / "hello.py"
    # One write per line: the two workers share the launcher's stdout, and print()'s
    # separate writes of its arguments interleaved there ('hellohello 0 2', ' 1 2').
    script.write_text("import os, sys\nsys.stdout.write('hello %s %s\\n' % (os.environ['RANK'], "
                      "os.environ['WORLD_SIZE']))\n")
    env = {**os.environ, "PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0"}
    result = subprocess.run([sys.executable, "-m", "paratrain.cli", "launch", str(script)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    hellos = [line for line in result.stdout.splitlines() if line.startswith("hello")]
    assert sorted(hellos) == ["hello 0 2", "hello 1 2"]
