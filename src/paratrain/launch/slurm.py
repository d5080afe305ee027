"""Slurm: ``paratrain launch train.py`` with no flags inside a Slurm allocation.

Slurm describes the allocation in each task's environment; the launcher reads it once:

* ``--nnodes``: ``SLURM_STEP_NUM_NODES`` inside an ``srun`` step, else
  ``SLURM_JOB_NUM_NODES`` (``SLURM_NNODES`` on old versions);
* ``--node-rank``: ``SLURM_NODEID``;
* ``--master-addr``: the first host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``,
  expanded by ``scontrol show hostnames`` where it exists, else by :func:`expand_hostlist`
  (``node[01-04,07]`` forms);
* ``--nproc-per-node``: the GPUs of this node (``SLURM_GPUS_ON_NODE``), else
  ``SLURM_NTASKS_PER_NODE`` outside a step (inside one it counts launchers, see below);
* ``--master-port``: ``20000 + job id % 10000`` for multi-node jobs (every node computes
  the same one; a single node keeps a free port, so a requeued job never meets its own
  old port in TIME_WAIT).

``paratrain launch`` runs once per node and starts the node's processes itself, so an
``srun`` step must have one task per node; a step with more, or a multi-node job
launched outside ``srun`` (the batch script runs on the first node only), is refused
in one line. A flag on the command line wins over Slurm's value; where the two differ,
:func:`apply` returns one line saying so.

Example::

    >>> expand_hostlist("gpu[01-03,07],login1")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']
    >>> job = detect({"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
    ...               "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS_PER_NODE": "4"},
    ...              hostnames=expand_hostlist)
    >>> job.values["master_addr"], job.values["master_port"], job.sources["nproc_per_node"]
    ('gpu07', 24242, 'SLURM_NTASKS_PER_NODE=4')
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from paratrain.launch.kubernetes import CHECKED_BY_PREFLIGHT

__all__ = ["SlurmError", "SlurmJob", "apply", "detect", "expand_hostlist", "hostnames",
           "master_port"]

PORT_BASE, PORT_SPAN = 20000, 10000  # below Linux's ephemeral range (32768-60999)


class SlurmError(ValueError):
    """A Slurm allocation ``paratrain launch`` cannot run in; the message says how to fix it."""


@dataclass(frozen=True)
class SlurmJob:
    """Launcher options read from Slurm's variables: typed values and where each came from."""

    job_id: str = ""
    in_step: bool = False
    """Inside an ``srun`` step (``SLURM_STEP_ID``), not the batch script or ``salloc``'s shell."""
    values: dict[str, object] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # option -> "SLURM_NODEID=1"

    def __bool__(self) -> bool:
        return bool(self.job_id)


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def expand_hostlist(expression: str) -> list[str]:
    """Slurm's compressed host list as names: ``n[1-3,7]`` -> ``n1 n2 n3 n7``.

    Zero padding follows the range's first bound (``n[01-03]`` -> ``n01``); several
    bracket groups multiply (``r[1-2]n[1-2]``). ValueError names a malformed expression.
    """
    hosts: list[str] = []
    for item in _split_top(expression):
        match = re.match(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$", item)
        if match is None:
            if "[" in item or "]" in item:
                raise SlurmError(f"cannot read the Slurm host list {expression!r} (at {item!r})")
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        tails = expand_hostlist(rest) if rest else [""]
        for part in ranges.split(","):
            low, _, high = part.strip().partition("-")
            if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
                raise SlurmError(f"cannot read the Slurm host list {expression!r} (at {part!r})")
            for number in range(int(low), int(high or low) + 1):
                hosts += [f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails]
    return hosts


def hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST`` where ``scontrol`` exists, else :func:`expand_hostlist`."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                                  text=True, timeout=30, check=True)
            names = done.stdout.split()
            if names:
                return names
        except (OSError, subprocess.SubprocessError):
            pass  # a broken client: the pure-Python reading handles the usual forms
    return expand_hostlist(nodelist)


def master_port(job_id: str) -> int:
    """The rendezvous port every node of job ``job_id`` computes alike."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def _count(environ: Mapping[str, str], name: str) -> int | None:
    """The leading count of a Slurm count variable (``2``, ``2(x3)``, ``2,1``), or None."""
    match = re.match(r"^\s*(\d+)", environ.get(name, ""))
    return int(match.group(1)) if match else None


def detect(environ: Mapping[str, str], *,
           hostnames: Callable[[str], list[str]] = hostnames) -> SlurmJob:
    """The launcher options a Slurm allocation sets (empty outside one, or in a worker)."""
    job_id = environ.get("SLURM_JOB_ID", "").strip() or environ.get("SLURM_JOBID", "").strip()
    if not job_id or "LOCAL_RANK" in environ:  # a worker of a launcher sees them too
        return SlurmJob()
    values: dict[str, object] = {}
    sources: dict[str, str] = {}

    def take(option: str, name: str, value: object) -> None:
        values[option], sources[option] = value, f"{name}={environ[name].strip()}"

    in_step = bool(environ.get("SLURM_STEP_ID", "").strip())
    names = ("SLURM_STEP_NUM_NODES",) if in_step else ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    nodes_name = next((n for n in names if _count(environ, n)), None)
    if nodes_name:
        take("nnodes", nodes_name, str(_count(environ, nodes_name)))
    if _count(environ, "SLURM_NODEID") is not None:
        take("node_rank", "SLURM_NODEID", _count(environ, "SLURM_NODEID"))
    list_name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                      if environ.get(n, "").strip() and (in_step or "STEP" not in n)), None)
    if list_name:
        hosts = hostnames(environ[list_name].strip())
        if hosts:
            take("master_addr", list_name, hosts[0])
    if int(values.get("nnodes", "1")) > 1 and job_id.isdigit():
        values["master_port"] = master_port(job_id)
        sources["master_port"] = f"SLURM_JOB_ID={job_id}"
    gpus = _count(environ, "SLURM_GPUS_ON_NODE")
    tasks = _count(environ, "SLURM_STEP_TASKS_PER_NODE" if in_step else "SLURM_NTASKS_PER_NODE")
    if gpus:
        take("nproc_per_node", "SLURM_GPUS_ON_NODE", str(gpus))
    elif tasks and not in_step:
        take("nproc_per_node", "SLURM_NTASKS_PER_NODE", str(tasks))
    if in_step and tasks and tasks > 1:
        raise SlurmError(
            f"srun started {tasks} tasks on this node (SLURM_STEP_TASKS_PER_NODE="
            f"{environ['SLURM_STEP_TASKS_PER_NODE']}), each a paratrain launch; start one per "
            "node: srun --ntasks-per-node=1 paratrain launch --nproc-per-node N ...")
    return SlurmJob(job_id, in_step, values, sources)


def apply(args: argparse.Namespace, explicit: set[str], job: SlurmJob) -> list[str]:
    """Set the options of ``args`` not in ``explicit`` from ``job``; one line per conflict.

    A flag given on the command line keeps its value; where it differs from Slurm's, the
    returned line names both. A multi-node job outside ``srun`` is a :class:`SlurmError`
    (unless ``--nnodes`` is given): its batch script runs on the first node only.
    """
    if not job:
        return []
    nodes = job.values.get("nnodes", "1")
    if "nnodes" not in explicit and int(nodes) > 1 and not job.in_step:
        raise SlurmError(
            f"this Slurm job has {nodes} nodes ({job.sources['nnodes']}) but paratrain launch "
            "runs outside srun, on one node only; start it on every node with srun "
            "--ntasks-per-node=1 paratrain launch ... (or pass --nnodes)")
    notices = []
    for option, value in job.values.items():
        if option not in explicit:
            setattr(args, option, value)
        elif str(getattr(args, option)) != str(value) and option not in CHECKED_BY_PREFLIGHT:
            flag = f"--{option.replace('_', '-')} {getattr(args, option)}"
            notices.append(f"{flag} on the command line wins over {job.sources[option]} set by "
                           "Slurm; drop the flag to use the job's value")
    return notices
