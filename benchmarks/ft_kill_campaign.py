"""Replica-group kills (torchft mode) against the elastic restart, on the same job.

Fault tolerant: ``paratrain launch --fault-tolerant --replica-groups 2 --max-restarts K+2``
runs ``benchmarks/ft_kill_job.py`` (one rank per group, gloo on CPU). K times, at a random
moment (a seeded delay after the last victim trained again, a seeded choice of group),
one group's worker is SIGKILLed; its torchrun restarts it and it heals from the live group.
Per kill: the survivor's longest stall (largest gap between its step lines, from its last
step before the kill until two steps after the victim's first healed step), steps lost or
repeated on the survivor in that window (step numbers not consecutive, or a step whose
parameters did not change: an update not committed), seconds from the kill to the
victim's first step again, the heal time torchft reported, and whether every step of the
healed process equals the survivor's at the same step, bitwise.

Elastic: the same job under ``paratrain launch --nproc-per-node 2 --max-restarts K+2``
with a checkpoint every ``--checkpoint-every`` steps; rank 1 is SIGKILLed after the same
seeded delays; torchrun restarts both workers, which resume from the newest checkpoint.
Downtime: on rank 0's log, the time between its last step before the kill and its first
step after the restart; also the steps redone and the time until it passes its pre-kill
step again.

With ``--diloco H`` both jobs run DiLoCo every H steps (the replicas: the two groups,
or the two ranks); the groups meet only at syncs, so a healed process is compared with
the survivor at the sync steps (multiples of H), where both hold the synchronised
parameters.

    python benchmarks/ft_kill_campaign.py --kills 10 --seed 1
    python benchmarks/ft_kill_campaign.py --quick          # 2 kills each
    python benchmarks/ft_kill_campaign.py --kills 10 --diloco 4 --elastic-kills 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

JOB = Path(__file__).resolve().with_name("ft_kill_job.py")
HEALED = re.compile(r"replica group (\d+) healed from a live peer at step (\d+).* in ([\d.]+) s")


class Failed(RuntimeError):
    """The campaign could not go on (the job ended, or a wait timed out)."""


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


class Job:
    """A launcher in its own session, logging to a file; on exit, nothing left behind:
    SIGTERM to the launcher, then SIGKILL to every descendant still alive (torchrun starts
    its workers in sessions of their own, so a process-group kill alone would miss them)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log

    def __enter__(self) -> Job:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PARATRAIN_TIMEOUT_S": "30"}
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        return self

    def check(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise Failed(f"the job ended (exit {self.proc.returncode}) while waiting for {what}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise Failed(f"the job did not end within {timeout:g} s of stop_at") from None

    def __exit__(self, *exc: object) -> None:
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.out.close()


def wait_for(job: Job, what: str, found, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        job.check(what)
        time.sleep(0.02)
    raise Failed(f"no {what} within {timeout:g} s")


def new_rows(path: Path, old_pids: set[int], n: int):
    """The first row of a process not in old_pids, once it has logged n rows."""
    fresh = [r for r in rows(path) if r["pid"] not in old_pids]
    return fresh[0] if len(fresh) >= n else None


def stop(job: Job, out: Path, timeout: float) -> None:
    """Ends the job after a step every rank is still ahead of (all stop at the same one)."""
    last = max((r["step"] for p in out.glob("*.jsonl") for r in rows(p)), default=0)
    (out / "stop_at").write_text(str(last + 25))
    code = job.wait(timeout)
    if code != 0:
        print(f"note: the job exited with code {code}; see {job.log}")


def ft_campaign(work: Path, plan: list[tuple[float, int]], sleep_s: float,
                timeout: float, every: int = 1) -> list[dict]:
    out = work / "ft"
    out.mkdir()
    argv = [sys.executable, "-m", "paratrain.cli", "launch", "--fault-tolerant",
            "--replica-groups", "2", "--max-restarts", str(len(plan) + 2), str(JOB), str(out),
            str(sleep_s)]
    logs = [out / "group0-rank0.jsonl", out / "group1-rank0.jsonl"]
    kills: list[dict] = []
    with Job(argv, work / "ft.log") as job:
        try:
            for g in (0, 1):
                wait_for(job, f"group {g}'s step 3", lambda g=g: new_rows(logs[g], set(), 3),
                         timeout)
            dead: set[int] = set()
            for i, (delay, victim) in enumerate(plan):
                time.sleep(delay)
                last = rows(logs[victim])[-1]
                survivor_last = rows(logs[1 - victim])[-1]
                t_kill = time.time()
                os.kill(last["pid"], signal.SIGKILL)
                dead.add(last["pid"])
                kill = {"victim": victim, "pid": last["pid"], "t": t_kill, "step": last["step"],
                        "survivor_step": survivor_last["step"]}
                kills.append(kill)
                print(f"  ft kill {i + 1}: group {victim} (pid {last['pid']}) after its step "
                      f"{last['step']}", flush=True)
                old = {r["pid"] for r in rows(logs[victim])}
                kill["back"] = wait_for(job, f"group {victim} training again",
                                        lambda v=victim, o=old: new_rows(logs[v], o, 3), timeout)
            stop(job, out, timeout)
        except Failed as exc:
            print(f"FAILED (fault tolerant): {exc}; log {job.log}", flush=True)
    analyse_ft(kills, logs, (work / "ft.log").read_text(), every=every)
    return kills


def analyse_ft(kills: list[dict], logs: list[Path], output: str, every: int = 1) -> None:
    final = [rows(p) for p in logs]
    heals = {0: [], 1: []}
    for m in HEALED.finditer(output):
        heals[int(m.group(1))].append((int(m.group(2)), float(m.group(3))))
    for kill in kills:
        v = kill["victim"]
        surv = final[1 - v]
        kill["heal_s"] = heals[v].pop(0)[1] if heals[v] else None
        back = kill.get("back")
        if back is None:
            continue
        kill["back_s"] = back["t"] - kill["t"]
        a = max((i for i, r in enumerate(surv) if r["t"] <= kill["t"]), default=0)
        b = next((i for i, r in enumerate(surv) if r["step"] >= back["step"] + 2), len(surv) - 1)
        window = surv[a:b + 1]
        pairs = list(zip(window, window[1:]))
        kill["stall_s"] = max((y["t"] - x["t"] for x, y in pairs), default=None)
        kill["lost_or_repeated"] = sum(y["step"] != x["step"] + 1 or y["pid"] != x["pid"]
                                       for x, y in pairs)
        kill["uncommitted"] = sum(y["digest"] == x["digest"] for x, y in pairs)
        by_step = {r["step"]: r["digest"] for r in surv}
        healed = [r for r in final[v] if r["pid"] == back["pid"] and r["step"] in by_step
                  and r["step"] % every == 0]  # DiLoCo: equal right after each sync only
        kill["compared"] = len(healed)
        kill["bitwise"] = bool(healed) and all(by_step[r["step"]] == r["digest"] for r in healed)
        kill["first_mismatch"] = next((r["step"] for r in healed
                                       if by_step[r["step"]] != r["digest"]), None)


def elastic_campaign(work: Path, delays: list[float], sleep_s: float, every: int,
                     timeout: float) -> list[dict]:
    out = work / "elastic"
    out.mkdir()
    argv = [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2",
            "--max-restarts", str(len(delays) + 2), str(JOB), str(out), str(sleep_s),
            str(work / "ckpt"), str(every)]
    log0, log1 = out / "group0-rank0.jsonl", out / "group0-rank1.jsonl"
    kills: list[dict] = []
    with Job(argv, work / "elastic.log") as job:
        try:
            wait_for(job, "rank 1's step 3", lambda: new_rows(log1, set(), 3), timeout)
            for i, delay in enumerate(delays):
                time.sleep(delay)
                last = rows(log1)[-1]
                old0 = {r["pid"] for r in rows(log0)}
                t_kill = time.time()
                os.kill(last["pid"], signal.SIGKILL)
                kill = {"t": t_kill, "step": last["step"], "pid": last["pid"], "old0": old0}
                kills.append(kill)
                print(f"  elastic kill {i + 1}: rank 1 (pid {last['pid']}) after its step "
                      f"{last['step']}", flush=True)
                kill["back"] = wait_for(job, "rank 0 training again",
                                        lambda o=old0: new_rows(log0, o, 1), timeout)
                old1 = {r["pid"] for r in rows(log1) if r["t"] <= t_kill}
                wait_for(job, "rank 1 training again", lambda o=old1: new_rows(log1, o, 3),
                         timeout)
            stop(job, out, timeout)
        except Failed as exc:
            print(f"FAILED (elastic): {exc}; log {job.log}", flush=True)
    final = rows(log0)
    for kill in kills:
        if kill.get("back") is None:
            continue
        before = [r for r in final if r["pid"] in kill["old0"]][-1]
        after = kill["back"]
        kill["before_step"], kill["after_step"] = before["step"], after["step"]
        kill["redone"] = before["step"] - after["step"] + 1
        kill["downtime_s"] = after["t"] - before["t"]
        regained = next((r for r in final if r["t"] > kill["t"] and r["pid"] == after["pid"]
                         and r["step"] > before["step"]), None)
        kill["regain_s"] = regained["t"] - kill["t"] if regained else None
    return kills


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report_ft(kills: list[dict], seed: int, output: str, every: int = 0) -> list[float]:
    mode = every or None
    print(f"\nFault tolerant (torchft), 2 replica groups x 1 rank"
          f"{f', DiLoCo every {mode} steps' if mode else ''}, {len(kills)} kills, seed {seed}")
    print("| kill | group killed | its last step | survivor's step | survivor's longest stall "
          "(s) | survivor's step numbers skipped/repeated | survivor's updates not applied "
          "| kill -> victim training again (s) | heal (s, log) | healed bitwise |\n"
          + "|---" * 10 + "|")
    for i, k in enumerate(kills, 1):
        bit = "-" if "bitwise" not in k else (
            f"yes ({k['compared']} steps)" if k["bitwise"]
            else f"NO (first at step {k['first_mismatch']})")
        print(f"| {i} | {k['victim']} | {k['step']} | {k['survivor_step']} | "
              f"{fmt(k.get('stall_s'))} | {k.get('lost_or_repeated', '-')} | "
              f"{k.get('uncommitted', '-')} | {fmt(k.get('back_s'))} | {fmt(k.get('heal_s'))} "
              f"| {bit} |")
    stalls = [k["stall_s"] for k in kills if k.get("stall_s") is not None]
    backs = [k["back_s"] for k in kills if k.get("back_s") is not None]
    if stalls:
        print(f"\ntotals: {len(stalls)}/{len(kills)} kills recovered; survivor's longest stall "
              f"max {max(stalls):.2f} s, median {statistics.median(stalls):.2f} s, "
              f"{sum(s >= 10 for s in stalls)} >= 10 s; step numbers skipped/repeated on the survivors "
              f"{sum(k.get('lost_or_repeated', 0) for k in kills)}, updates not applied "
              f"{sum(k.get('uncommitted', 0) for k in kills)}; healed bitwise "
              f"{sum(bool(k.get('bitwise')) for k in kills)}/{len(kills)}; kill -> victim "
              f"training again median {statistics.median(backs):.2f} s, max {max(backs):.2f} s")
        skipped = [int(m) for m in re.findall(r"step (\d+) not committed", output)]
        print(f"the log's uncommitted steps (update skipped on every group): {skipped}")
    return stalls


def report_elastic(kills: list[dict], every: int) -> list[float]:
    print(f"\nElastic restart (torchrun, 2 ranks, checkpoint every {every} steps), "
          f"{len(kills)} kills of rank 1")
    print("| kill | rank 1's last step | rank 0's last step before | its first step after | "
          "steps redone | downtime (s) | kill -> past the pre-kill step (s) |\n"
          + "|---" * 7 + "|")
    for i, k in enumerate(kills, 1):
        print(f"| {i} | {k['step']} | {k.get('before_step', '-')} | {k.get('after_step', '-')} "
              f"| {k.get('redone', '-')} | {fmt(k.get('downtime_s'))} | "
              f"{fmt(k.get('regain_s'))} |")
    down = [k["downtime_s"] for k in kills if k.get("downtime_s") is not None]
    if down:
        print(f"\ntotals: {len(down)}/{len(kills)} restarts resumed; downtime max "
              f"{max(down):.2f} s, median {statistics.median(down):.2f} s; steps redone "
              f"{sum(k['redone'] for k in kills if 'redone' in k)}")
    return down


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--kills", type=int, default=10, help="kills in the fault-tolerant run")
    add("--elastic-kills", type=int, default=None,
        help="kills in the elastic run (default: --kills; 0: skip it)")
    add("--quick", action="store_true", help="2 kills each")
    add("--seed", type=int, default=1, help="seed of the kill moments and victims")
    add("--min-delay", type=float, default=1.0, help="seconds, after the last victim's "
        "third step again, before the next kill (uniform between min and max)")
    add("--max-delay", type=float, default=6.0)
    add("--sleep-s", type=float, default=0.1, help="the job's sleep after each step")
    add("--checkpoint-every", type=int, default=10, help="elastic run's checkpoint interval")
    add("--timeout", type=float, default=240.0, help="longest wait for one event (s)")
    add("--diloco", type=int, default=0, metavar="H", help="DiLoCo every H steps (0: DDP)")
    args = parser.parse_args()
    if args.diloco:
        os.environ["KILL_JOB_DILOCO"] = str(args.diloco)  # read by the jobs
    if args.quick:
        args.kills, args.elastic_kills = 2, 2
    elastic_kills = args.kills if args.elastic_kills is None else args.elastic_kills
    rng = random.Random(args.seed)
    delays = [rng.uniform(args.min_delay, args.max_delay) for _ in range(max(args.kills,
                                                                             elastic_kills))]
    victims = [rng.randrange(2) for _ in range(args.kills)]
    work = Path(tempfile.mkdtemp(prefix="kc_", dir="/tmp"))
    print(f"seed {args.seed}; delays (s) {[round(d, 2) for d in delays]}; victims {victims}; "
          f"work dir {work}; load average {os.getloadavg()[0]:.1f}", flush=True)
    started = time.monotonic()
    ft = ft_campaign(work, list(zip(delays, victims)), args.sleep_s, args.timeout,
                     every=args.diloco or 1)
    el = (elastic_campaign(work, delays[:elastic_kills], args.sleep_s, args.checkpoint_every,
                           args.timeout) if elastic_kills else [])
    stalls = report_ft(ft, args.seed, (work / "ft.log").read_text(), every=args.diloco)
    ft_steps = rows(work / "ft" / "group0-rank0.jsonl")
    gaps = sorted(y["t"] - x["t"] for x, y in zip(ft_steps, ft_steps[1:]))
    if gaps:
        print(f"median interval between group 0's steps over the whole run "
              f"{statistics.median(gaps):.3f} s (sleep {args.sleep_s} s)")
    down = report_elastic(el, args.checkpoint_every) if el else []
    if stalls and down:
        print(f"\nratio: elastic downtime / survivor's longest stall, medians "
              f"{statistics.median(down) / statistics.median(stalls):.1f}x, maxima "
              f"{max(down) / max(stalls):.1f}x")
    print(f"\nwall time {time.monotonic() - started:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f}; logs in {work}")
    ok = (len(stalls) == len(ft) == args.kills and max(stalls, default=0) < 10
          and all(k.get("bitwise") and not k.get("lost_or_repeated") and not k.get("uncommitted")
                  for k in ft))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
