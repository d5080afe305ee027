"""Bad input and lost peers: one line, non-zero exit, bounded time, no orphan processes.

Every failure story of docs/reliability.md runs here as a real process (the launcher or a
training script), tagged through its environment so that any process it leaves behind is
found. Refusals that differ only in their message (bad flags, bad settings, bad
checkpoints) are checked in-process through the function that prints them
(``launcher.main``, the training script under the excepthook ``Run`` installs), and one
of each kind end to end, through a real process.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from paratrain.distributed.device import free_port
from paratrain.launch import launcher
from paratrain.reliability import signals

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TRAIN = str(SCRIPTS / "fault_train.py")
LIMIT_S = 10.0
CLI = [sys.executable, "-m", "paratrain.cli"]


@functools.lru_cache(maxsize=1)
def startup_s() -> float:
    """What a run of the test script that trains nothing costs, measured now (interpreter,
    torch import, Run set-up). On a busy shared machine this alone can exceed 10 s, so the
    limits below are a budget on top of it (one start-up per process level)."""
    started = time.monotonic()
    subprocess.run(script("--epochs", "0"), check=True, timeout=240, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.monotonic() - started



@dataclass
class Outcome:
    returncode: int
    stderr: str
    elapsed: float
    orphans: list[str]

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PARATRAIN_TEST_TAG") == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _reap(tag: str) -> list[str]:
    """Processes still carrying ``tag`` 2 s after exit; they are killed, then reported."""
    deadline = time.monotonic() + 2.0
    left = _tagged(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _tagged(tag)
    names = []
    for proc in left:
        try:
            names.append(" ".join(proc.cmdline())[:120])
            proc.kill()
        except psutil.Error:
            pass
    return names


def start(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    tag = uuid.uuid4().hex
    full_env = {**os.environ, "PARATRAIN_TEST_TAG": tag, "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, tag


def finish(proc: subprocess.Popen, tag: str, started: float, timeout: float = 240) -> Outcome:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        _, err = proc.communicate()
    return Outcome(proc.returncode, err, time.monotonic() - started, _reap(tag))


def run(argv: list[str], env: dict[str, str] | None = None) -> Outcome:
    started = time.monotonic()
    proc, tag = start(argv, env)
    return finish(proc, tag, started)


def assert_one_line_failure(out: Outcome, expected: str, limit: float = LIMIT_S,
                            levels: int = 1) -> None:
    """Non-zero exit, no orphans, no traceback, the last line names ``expected``, and it
    took less than ``limit`` s beyond ``levels`` process start-ups (launcher, workers;
    0 for a check in this process)."""
    if levels:
        limit += levels * startup_s()
    report = (f"rc={out.returncode} {out.elapsed:.1f}s (limit {limit:.1f}s) "
              f"stderr:\n{out.stderr[-3000:]}")
    assert out.returncode != 0, report
    assert out.orphans == [], report
    assert "Traceback (most recent call last)" not in out.stderr, report
    assert expected in out.lines[-1], report  # the last thing the user reads names it
    assert out.elapsed < limit, report


def launch(*argv: str) -> list[str]:
    return [*CLI, "launch", *argv]


def script(*argv: str) -> list[str]:
    return [sys.executable, TRAIN, *argv]


# -- the launcher refuses before anything starts --------------------------------------

@pytest.fixture
def in_process(capsys, monkeypatch):
    """``paratrain launch ARGV`` as ``launcher.main`` in this process: its exit code and
    what it printed to stderr (the process-level checks are the end-to-end test's)."""
    monkeypatch.setattr(signals, "_forwarded", [])
    usr1 = signal.getsignal(signal.SIGUSR1)  # main() forwards it once past validate()

    def launch_here(*argv: str, env: dict[str, str] | None = None) -> Outcome:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        started = time.monotonic()
        try:
            code = launcher.main(list(argv))
        finally:
            signal.signal(signal.SIGUSR1, usr1)
        return Outcome(code, capsys.readouterr().err, time.monotonic() - started, [])

    return launch_here


def test_launcher_refusal_reaches_the_user_in_one_line():
    # End to end, through `python -m paratrain.cli launch`: the refusals below reach the
    # user this way (exit code, one line, no traceback, no process left behind).
    out = run(launch("--nproc-per-node", "0", TRAIN))
    assert_one_line_failure(out, "--nproc-per-node must be an integer >= 1")
    assert out.lines == [out.lines[-1]] and out.lines[-1].startswith("paratrain launch: ")


@pytest.mark.parametrize("argv, expected", [
    (["--nproc-per-node", "0", TRAIN], "--nproc-per-node must be an integer >= 1"),
    (["--nnodes", "2", "--node-rank", "2", TRAIN], "--node-rank 2 is out of range"),
    (["no_such_script.py"], "script 'no_such_script.py' not found"),
    (["--nnodes", "0", TRAIN], "--nnodes must be N >= 1"),
    (["--nnodes", "1:2", TRAIN], "--nnodes MIN:MAX needs --rdzv-backend c10d"),
    (["--max-restarts", "-1", TRAIN], "--max-restarts must be >= 0"),
], ids=["nproc-0", "node-rank", "script-missing", "nnodes-0", "nnodes-range-static",
        "max-restarts"])
def test_launcher_refuses(in_process, argv, expected):
    out = in_process(*argv)
    assert_one_line_failure(out, expected, levels=0)
    assert out.lines == [out.lines[-1]] and out.lines[-1].startswith("paratrain launch: ")


def test_port_in_use(in_process):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = in_process("--master-port", str(port), TRAIN)
    assert_one_line_failure(out, f"port {port} on 127.0.0.1 is in use", levels=0)


WAIT_REPORT = {"PARATRAIN_WAIT_REPORT_S": "1"}


def test_unreachable_master(in_process):
    # Loopback only: a port nobody listens on stands for a master that is not there.
    out = in_process("--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port()), "--join-timeout", "3", TRAIN,
                     env=WAIT_REPORT)
    assert_one_line_failure(out, "master 127.0.0.1:", levels=0)
    assert "unreachable after 3 s" in out.lines[-1]
    notices = out.lines[:-1]
    assert len(notices) >= 2, out.stderr  # one at the start, then one a second
    assert all(n.startswith("paratrain launch: node 1 is waiting for the master 127.0.0.1:")
               and "--join-timeout sets the wait" in n for n in notices), out.stderr


def test_peers_that_never_join_node_0(in_process):
    out = in_process("--nnodes", "2", "--node-rank", "0", "--master-port", str(free_port()),
                     "--join-timeout", "3", TRAIN, env=WAIT_REPORT)
    assert_one_line_failure(out, "node(s) 1 of --nnodes 2 did not check in within 3 s",
                            levels=0)  # pre-flight
    assert "--join-timeout sets the wait" in out.lines[-1]
    notices = out.lines[:-1]
    assert notices and all(n.startswith("paratrain launch: node 0 is waiting for the other 1 "
                                        "node(s) of --nnodes 2 to join at 127.0.0.1:")
                           for n in notices), out.stderr


@pytest.mark.slow
def test_rank_stuck_before_init():
    # Rank 1 sleeps before Run(): rank 0 waits in init_process_group, saying so.
    out = run(launch("--nproc-per-node", "2", str(SCRIPTS / "late_rank.py")),
              {**WAIT_REPORT, "PARATRAIN_TIMEOUT_S": "4"})
    assert_one_line_failure(out, "rank 0: the process group did not form within 4 s",
                            levels=2)
    assert "PARATRAIN_TIMEOUT_S sets the wait" in out.lines[-1]
    notices = [n for n in out.lines if "waiting for the other 1 rank(s) to join" in n]
    assert notices and notices[0].startswith("paratrain: rank 0: waiting for"), out.stderr


@pytest.mark.slow
def test_peer_lost_during_prepare():
    # Without the launcher, whose agent would stop rank 0 as soon as rank 1 dies.
    port = str(free_port())
    script = [sys.executable, str(SCRIPTS / "lose_peer_in_prepare.py")]
    started = time.monotonic()
    procs = [start(script, {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": port}) for r in (0, 1)]
    survivor, killed = [finish(proc, tag, started) for proc, tag in procs]
    assert killed.returncode == -9
    assert_one_line_failure(survivor, "rank 0: a collective failed (", levels=1)
    assert "lost rank 1 (host 127.0.0.1)" in survivor.lines[-1]
    assert len(survivor.lines) == 1, survivor.stderr


# -- the training script refuses (single process, no launcher) -------------------------

def script_here(*argv: str) -> Outcome:
    """The training script run in this process, to the error it ends with, which is then
    reported by the hook ``Run`` installs as ``sys.excepthook`` (as at a process's end).

    Under ``pytest.MonkeyPatch`` (``sys.argv`` and the hook's record are put back).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [TRAIN, *argv])
        patch.setattr(sys, "excepthook", sys.excepthook)
        patch.setattr(signals, "_reported", [])
        started = time.monotonic()
        error = None
        try:
            runpy.run_path(TRAIN, run_name="__main__")
        except Exception as exc:  # the uncaught error of the script
            error = exc
        elapsed = time.monotonic() - started
        if error is None:
            return Outcome(0, "", elapsed, [])
        hook = signals.OneLineErrors(sys.__excepthook__, show_traceback=False, launched=False)
        err = io.StringIO()
        patch.setattr(sys, "stderr", err)
        hook(type(error), error, error.__traceback__)
    return Outcome(1, err.getvalue(), elapsed, [])


@pytest.mark.parametrize("argv, env, expected", [
    (["--strategy", "nope"], {}, "unknown strategy 'nope'"),
    (["--batch-size", "0"], {}, "batch_size must be >= 1"),
    ([], {"PARATRAIN_TIMEOUT_S": "soon"}, "PARATRAIN_TIMEOUT_S='soon' must be a number"),
    ([], {"PARATRAIN_KILL_AT_STEP": "x"}, "PARATRAIN_KILL_AT_STEP='x' must be an integer"),
    ([], {"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not set for a 2-process job"),
], ids=["unknown-strategy", "batch-size-0", "timeout-env", "fault-env", "no-launcher"])
def test_script_refuses(monkeypatch, argv, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = script_here(*argv)
    assert_one_line_failure(out, expected, levels=0)
    assert len(out.lines) == 1 and out.lines[0].startswith("paratrain: "), out.stderr


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of the 32-unit model (one short single-process run, here)."""
    directory = tmp_path_factory.mktemp("good")
    out = script_here("--epochs", "1", "--num-samples", "16", "--checkpoint-dir",
                      str(directory), "--checkpoint-every", "2")
    assert out.returncode == 0, out.stderr
    return directory / "step-000000002.pt"


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/paratrain-reliability-pwned",))


def damaged(tmp_path: Path, good_checkpoint: Path, damage: str) -> tuple[Path, list[str]]:
    """A copy of the good checkpoint, damaged; the script's arguments that resume from it."""
    target = tmp_path / good_checkpoint.name
    shutil.copy(good_checkpoint, target)
    argv = ["--checkpoint-dir", str(tmp_path), "--num-samples", "16"]
    if damage == "other-model":
        argv += ["--hidden", "16"]
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:200])
    else:
        with open(target, "wb") as f:
            pickle.dump({"format": "paratrain", "payload": Exploit()}, f)
    return target, argv


@pytest.mark.parametrize("damage, expected", [
    ("other-model", "does not match the model"),
    ("truncated", "is corrupt or truncated"),
    ("malicious", "was refused"),
])
def test_bad_checkpoint(tmp_path, good_checkpoint, damage, expected):
    target, argv = damaged(tmp_path, good_checkpoint, damage)
    out = script_here(*argv)
    assert_one_line_failure(out, expected, levels=0)
    assert str(target) in out.lines[-1]
    assert not os.path.exists("/tmp/paratrain-reliability-pwned")


@pytest.mark.slow
def test_script_refusal_reaches_the_user_in_one_line():
    # End to end, in a real process: the refusals above (arguments, settings, checkpoints)
    # end the script this way (exit code, one line, no traceback, no process left behind).
    out = run(script("--strategy", "nope"))
    assert_one_line_failure(out, "unknown strategy 'nope'")
    assert len(out.lines) == 1 and out.lines[0].startswith("paratrain: "), out.stderr


# -- through the launcher, with peers --------------------------------------------------

@pytest.mark.slow
def test_dataset_smaller_than_world_size():
    out = run(launch("--nproc-per-node", "2", TRAIN, "--num-samples", "1"))
    assert_one_line_failure(out, "dataset has 1 samples but there are 2 data-parallel ranks",
                            levels=2)
    assert out.lines[-1].startswith("paratrain launch: worker rank")


def two_nodes(node_args: list[list[str]], env: dict[str, str] | None = None) -> list[Outcome]:
    """``paratrain launch --nnodes 2`` twice on loopback, one process each."""
    port = str(free_port())
    started = time.monotonic()
    running = [start(launch("--nnodes", "2", "--node-rank", str(k), "--master-addr",
                            "127.0.0.1", "--master-port", port, "--join-timeout", "20",
                            TRAIN, *args), env)
               for k, args in enumerate(node_args)]
    return [finish(proc, tag, started) for proc, tag in running]


@pytest.mark.slow
def test_mismatched_config_across_nodes():
    outs = two_nodes([["--seed", "5"], ["--seed", "6"]])
    for out in outs:
        assert_one_line_failure(out, "rank 1 (host 127.0.0.1) was started with a different "
                                     "configuration than rank 0 (host 127.0.0.1): seed differs",
                                limit=LIMIT_S + 5, levels=2)


@pytest.mark.slow
def test_ranks_that_resumed_from_different_checkpoints_are_named(tmp_path):
    # One run leaves checkpoints at steps 2 and 4; node 1's own disk only has step 2. Caught
    # at resume, before a step (the health check named it later, "global step 3 vs 5").
    first = tmp_path / "node0"
    out = script_here("--epochs", "1", "--num-samples", "32", "--checkpoint-dir", str(first),
                      "--checkpoint-every", "2")
    assert out.returncode == 0, out.stderr
    second = tmp_path / "node1"
    second.mkdir()
    shutil.copy(first / "step-000000002.pt", second)
    outs = two_nodes([["--checkpoint-dir", str(first)], ["--checkpoint-dir", str(second)]],
                     env={"PARATRAIN_HEALTH_EVERY": "1"})
    for out in outs:
        assert_one_line_failure(out, "the ranks see different newest checkpoints (rank 0: "
                                     "step-000000004.pt, rank 1: step-000000002.pt)",
                                limit=LIMIT_S + 5, levels=2)
