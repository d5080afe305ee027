"""The launcher: fail-fast checks (pure), then real jobs through torch.distributed.run."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from paratrain.launch import launcher as launch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def parse(*argv):
    return launch.build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing.py"], "script 'missing.py' not found"),
        (["--nproc-per-node", "0", __file__], "--nproc-per-node must be an integer >= 1"),
        (["--nproc-per-node", "two", __file__], "--nproc-per-node must be"),
        (["--nnodes", "2", "--node-rank", "2", __file__], "--node-rank 2 is out of range"),
        (["--nnodes", "0", __file__], "--nnodes must be"),
        (["--nnodes", "1:2", __file__], "needs --rdzv-backend c10d"),
        (["--max-restarts", "-1", __file__], "--max-restarts must be >= 0"),
        (["--ps-servers", "0", __file__], "--ps-servers must be >= 1"),
    ],
)
def test_invalid_requests_are_named(argv, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.validate(parse(*argv))


def test_port_in_use_is_detected():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(launch.LaunchError, match=f"port {port} on 127.0.0.1 is in use"):
            launch.validate(parse("--master-port", str(port), __file__))


def test_torchrun_argv_picks_free_port_for_single_node():
    argv = launch.torchrun_argv(parse("--nproc-per-node", "2", __file__, "--lr", "1"))
    assert argv[argv.index("--master-port") + 1].isdigit()
    assert argv[-1] == __file__
    assert launch.script_args(parse(__file__, "--", "--lr", "1")) == ["--lr", "1"]


def test_threads_split_cores_among_processes():
    from paratrain.distributed.device import cpu_threads_per_process

    assert cpu_threads_per_process(1) >= cpu_threads_per_process(2) >= 1
    assert cpu_threads_per_process(10_000) == 1


def run_cli(*argv, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "paratrain.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_bad_launch_exits_fast_with_one_line():
    start = time.monotonic()
    result = run_cli("launch", "--nproc-per-node", "2", "no_such_script.py", timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "paratrain launch: script 'no_such_script.py' not found; check the path"]
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_plain_ddp_script_runs_unchanged():
    result = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "plain_ddp.py"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "plain ddp rank 0/2 ok threads=1" in result.stdout
    assert "plain ddp rank 1/2 ok" in result.stdout


@pytest.mark.slow
def test_failed_worker_is_reported_in_one_line(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = run_cli("launch", "--nproc-per-node", "2", str(script))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("paratrain launch: worker rank 1 (local rank 1) failed first with exit code 3")


def tiny(tmp_path, name, *extra, env=None):
    out = tmp_path / f"{name}.pt"
    result = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "train_tiny.py"),
                     "--out", str(out), *extra, env=env)
    return result, out


@pytest.mark.slow
def test_kill_and_resume_mid_epoch_is_bitwise_identical(tmp_path):
    # The uninterrupted run is the same script on pool ranks (what it computes, not the
    # launcher, is the reference); the killed and the resumed runs go through the launcher.
    from paratrain.testing.pool import run_script

    full_out = tmp_path / "full.pt"
    full = run_script(str(SCRIPTS / "train_tiny.py"), "--out", str(full_out))
    assert [r.returncode for r in full] == [0, 0], full[0].stderr[-2000:]
    ckpt = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    # 200 samples / (8 x 2) = 13 steps per epoch: step 10 is mid-epoch 0, last save at 8.
    env = {**os.environ, "PARATRAIN_KILL_AT_STEP": "10", "PARATRAIN_KILL_RANK": "1"}
    killed, _ = tiny(tmp_path, "killed", *args, env=env)
    assert killed.returncode != 0
    assert "worker rank 1 (local rank 1) failed first with signal SIGKILL" in killed.stderr
    assert "the process was killed and left no traceback" in killed.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000000004.pt", "step-000000008.pt"]
    resumed, resumed_out = tiny(tmp_path, "resumed", *args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "step-000000008.pt" in resumed.stdout
    expected, got = torch.load(full_out), torch.load(resumed_out)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# -- how a job ends: signals, failures, interpreter exit ---------------------------------

def test_failure_summary_names_the_signal_and_the_first_error(tmp_path):
    from paratrain.launch.report import describe_failure

    def failure(rank, exitcode, timestamp, message=None, when=None):
        error_file = ""
        if message is not None:
            error_file = tmp_path / f"error-{rank}.json"
            error_file.write_text("{}")
            extra = {"py_callstack": f"Traceback ...\n{message}", "timestamp": str(timestamp)}
            if when is not None:
                extra["paratrain_time"] = repr(when)
            message = {"message": message, "extraInfo": extra}
        return SimpleNamespace(local_rank=rank, exitcode=exitcode, timestamp=timestamp,
                               error_file=str(error_file), message=message or "",
                               signal_name=lambda: signal.Signals(-exitcode).name)

    killed = SimpleNamespace(failures={1: failure(1, -signal.SIGABRT, 100),
                                       0: failure(0, -signal.SIGTERM, 100)})
    assert describe_failure(killed) == ("", "worker rank 1 (local rank 1) failed first with "
                                            "signal SIGABRT (1 other worker(s) also failed): "
                                            "the process was killed and left no traceback")
    # Both errors carry the same whole second: the sub-second time decides.
    errors = SimpleNamespace(failures={0: failure(0, 1, 100, "ValueError: late", 100.7),
                                       1: failure(1, 1, 100, "ValueError: early", 100.2)})
    stack, line = describe_failure(errors)
    assert stack == "Traceback ...\nValueError: early"
    assert line.startswith("worker rank 1 (local rank 1) failed first with exit code 1")
    assert line.endswith(": ValueError: early")


@pytest.mark.slow
def test_worker_error_is_printed_once_from_the_first_failed_rank():
    result = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "fail_ranks.py"), "error")
    assert result.returncode == 1
    assert result.stderr.count("Traceback (most recent call last)") == 1, result.stderr
    assert result.stderr.count("ValueError: bad input on rank") == 2, result.stderr  # + summary
    assert "bad input on rank 0" not in result.stderr, result.stderr
    assert "runpy" not in result.stderr and "launch_worker" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "paratrain launch: worker rank 1 (local rank 1) failed first with exit code 1")


@pytest.mark.slow
def test_abort_is_named_without_a_traceback():
    result = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "fail_ranks.py"),
                     "SIGABRT")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("paratrain launch: worker rank 1 (local rank 1) failed first with "
                           "signal SIGABRT"), result.stderr
    assert last.endswith("the process was killed and left no traceback"), result.stderr
    assert "traceback is above" not in result.stderr


@pytest.mark.slow
def test_group_left_to_interpreter_exit_is_released_first():
    # A cycle holding the process group (DDP's reducer) is collected and the group
    # destroyed before interpreter shutdown, where tearing gloo down could abort.
    result = run_cli("launch", "--nproc-per-node", "1", str(SCRIPTS / "exit_cleanup.py"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["rank 0 done", "cycle collected",
                                          "destroyed, still initialized=True"]


def interrupt(tmp_path, signum, *extra):
    """Start a 2-process training, send ``signum`` to the launcher after step 2."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2",
         str(SCRIPTS / "fault_train.py"), "--log-steps", "--step-sleep", "0.2",
         "--epochs", "50", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step 2 "):
            proc.send_signal(signum)
            break
    rest, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(out) + rest, err


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_ends_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out, err = interrupt(tmp_path, signal.SIGINT, "--checkpoint-dir", str(ckpt))
    assert code == 130, err
    assert err.strip().splitlines() == ["paratrain launch: interrupted; workers were stopped"]
    saved = [line for line in out.splitlines() if line.startswith("paratrain: SIGINT received")]
    assert len(saved) == 1 and f"to {ckpt}, exiting" in saved[0], out
    step = int(saved[0].split("saved step ")[1].split()[0])
    assert (ckpt / f"step-{step:09d}.pt").is_file()


@pytest.mark.slow
def test_sigterm_without_checkpoints_ends_with_one_line(tmp_path):
    code, _, err = interrupt(tmp_path, signal.SIGTERM)
    assert code == 143, err
    assert err.strip().splitlines() == ["paratrain launch: stopped by SIGTERM; workers were stopped"]


def test_agent_log_lines_that_the_summary_repeats_are_dropped():
    import logging

    from paratrain.launch.report import quiet_agent_logs

    logger = logging.getLogger("torch.distributed.elastic.agent.server.api")
    quiet_agent_logs()
    quiet_agent_logs()  # idempotent
    try:
        def passes(msg):
            return logger.filter(logging.LogRecord(logger.name, logging.WARNING, "", 0, msg,
                                                   None, None))

        assert not passes("Received %s death signal, shutting down workers")
        assert passes("[%s] Worker group FAILED. %s/%s attempts left; will restart worker group")
        assert len(logger.filters) == 1
    finally:
        logger.filters.clear()


def test_closing_the_reporter_ends_its_progress_bar():
    import io

    from paratrain.run.reporting import Reporter

    class Terminal(io.StringIO):
        def isatty(self):  # the bar is drawn on terminals only (a log gets plain lines)
            return True

    reporter = Reporter(is_main=True, show_progress=True, metrics=None, stream=Terminal())
    batches = reporter.progress(range(10), total_samples=10, samples_per_batch=1, desc="e")
    next(batches)
    bar = reporter._bar
    reporter.close()  # a stop message printed now must not be followed by the bar
    assert reporter._bar is None and bar.disable
    batches.close()


def test_launcher_flag_after_the_script_is_named(tmp_path):
    """torchrun's rule: after the script, flags are the script's. The job ran one process
    without a word; now one line says where the flag went."""
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint('world', os.environ['WORLD_SIZE'], sys.argv[1:])\n")
    result = run_cli("launch", str(script), "--nproc-per-node", "2", timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "world 1 ['--nproc-per-node', '2']" in result.stdout  # as torchrun: the script's
    assert (f"paratrain launch: --nproc-per-node appears after the script {script}, so it goes "
            "to the script, not to the launcher; put launcher flags before the script"
            ) in result.stderr.splitlines()


@pytest.mark.parametrize("argv, flags", [
    (["train.py", "--lr", "1", "--nnodes=2", "--nproc_per_node", "2"],
     "--nnodes, --nproc_per_node appear"),
    (["train.py", "--", "--nnodes", "2"], None),  # `--`: meant for the script
    (["train.py", "--lr", "1", "--help"], None),
])
def test_misplaced_flags_notice(argv, flags):
    from paratrain.launch.argv import misplaced_flags_notice

    notice = misplaced_flags_notice(parse(*argv), argv)
    assert (notice if notice is None else notice.split(" after ")[0]) == flags
