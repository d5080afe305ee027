"""A one-node Slurm cluster on loopback, for tests and the preemption campaign.

``munged``, ``slurmctld`` and ``slurmd`` (Debian's ``munge`` and ``slurm-wlm``) run in the
foreground as children of this process, with a generated ``slurm.conf``, key and state
under one folder: one node ``localhost`` with ``CPUs=2``, ``select/cons_tres``,
``proctrack/linuxproc`` and no cgroups. ``cred_expire=10`` lets a requeued job start
again ~11 s after the requeue (Slurm's default waits 121 s). :meth:`SlurmCluster.stop`
cancels every job and ends the daemons, so that nothing outlives the test.

Example::

    with SlurmCluster(tmp_path) as cluster:      # SlurmUnavailable: one line why
        job = cluster.submit(["--wrap", "hostname"])
        cluster.wait(job, lambda info: info["JobState"] == "COMPLETED", timeout_s=60)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from paratrain.distributed.device import free_port

__all__ = ["SlurmCluster", "SlurmUnavailable"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CONF = """\
ClusterName=paratrain
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(RuntimeError):
    """The services cannot start here; the message says why in one line."""


def _sbin(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)


class SlurmCluster:
    """``munged`` + ``slurmctld`` + ``slurmd`` on loopback under ``root`` (a folder)."""

    def __init__(self, root: Path, *, cpus: int = 2) -> None:
        self.root = Path(root)
        self.cpus = cpus
        self._procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> None:
        missing = [n for n in (*DAEMONS, "sbatch", "scontrol") if _sbin(n) is None]
        if missing:
            raise SlurmUnavailable(f"{', '.join(missing)} not installed (apt-get install "
                                   "slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd needs root to start jobs as their user")
        for folder in ("state", "spool"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.root / "slurm.conf").write_text(CONF.format(
            root=self.root, cpus=self.cpus, ctld_port=free_port("127.0.0.1"),
            slurmd_port=free_port("127.0.0.1")))
        self._spawn([_sbin("munged"), "--foreground", "--force", f"--key-file={key}",
                     f"--socket={self.root}/munge.socket", f"--seed-file={self.root}/munge.seed",
                     f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log"])
        self._wait(lambda: (self.root / "munge.socket").exists(), timeout_s, "munged")
        self._spawn([_sbin("slurmctld"), "-D", "-i"])
        self._wait(lambda: self._run(["scontrol", "ping"]).returncode == 0, timeout_s,
                   "slurmctld")
        self._spawn([_sbin("slurmd"), "-D", "-N", "localhost"])
        self._wait(lambda: "idle" in self._run(["sinfo", "-h", "-o", "%T"]).stdout, timeout_s,
                   "slurmd")

    def _spawn(self, argv: list[str | None]) -> None:
        log = open(self.root / f"{Path(str(argv[0])).name}.out", "w")
        self._procs.append(subprocess.Popen([str(a) for a in argv], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _wait(self, ready: Callable[[], bool], timeout_s: float, name: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                log = self.root / f"{name}.log"
                tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
                why = f"exited {dead[0].returncode}" if dead else f"not ready in {timeout_s:g} s"
                raise SlurmUnavailable(f"{name} {why}" + (f" ({tail[0][:200]})" if tail else ""))
            time.sleep(0.2)

    def _run(self, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout_s)

    def command(self, *argv: str) -> str:
        """Run a Slurm client command against this cluster; its stdout (RuntimeError if it fails)."""
        done = self._run(list(argv))
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def submit(self, argv: list[str]) -> str:
        """``sbatch ARGV``; the job id."""
        out = self.command("sbatch", *argv)
        return re.search(r"Submitted batch job (\d+)", out).group(1)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ...)."""
        text = self.command("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, done: Callable[[dict[str, str]], bool], *,
             timeout_s: float) -> dict[str, str]:
        """Poll the job until ``done(info)``; TimeoutError with its last state."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if done(info):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} "
                                   f"({info.get('Reason')}) after {timeout_s:g} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel every job, then end the daemons (TERM, then KILL) and reap them."""
        if self._procs and len(self._procs) == len(DAEMONS):
            try:
                self._run(["scancel", "--full", "--user", "root"])
                deadline = time.monotonic() + 60
                while self._run(["squeue", "-h"]).stdout.strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
            except (OSError, subprocess.SubprocessError):
                pass
        for proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        self._procs.clear()
