"""The job of ``benchmarks/ft_kill_campaign.py``: one JSON line per optimizer step.

    ft_kill_job.py OUT_DIR SLEEP_S [CHECKPOINT_DIR CHECKPOINT_EVERY]

``tests/scripts/ft_train.py`` (with ``KILL_JOB_DILOCO=H``: DiLoCo every H steps) with two
additions: an optional checkpoint directory (for
the elastic-restart comparison, where the restarted workers resume from it) and an end
chosen while it runs: it trains until the global step written to ``OUT_DIR/stop_at``
(written well ahead, so that every rank and group stops after the same step). Each
process appends ``{"step", "t", "digest", "pid", "epoch", "restart"}`` to
``OUT_DIR/group<G>-rank<R>.jsonl`` after every step; the digest is a sha256 of this
rank's parameters, so that groups can be compared bitwise step by step.
"""

import hashlib
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain

out = sys.argv[1]
sleep_s = float(sys.argv[2])
checkpoint_dir = sys.argv[3] if len(sys.argv) > 3 else None
checkpoint_every = int(sys.argv[4]) if len(sys.argv) > 4 else None
generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(512, 8, generator=generator),
                     torch.randn(512, 1, generator=generator))
# KILL_JOB_DILOCO=H: DiLoCo every H steps; the replicas are the replica groups under
# --fault-tolerant (dp_replicate=1 in each), else the ranks of the one job.
every = int(os.environ.get("KILL_JOB_DILOCO", "0") or 0)
parallel = None
if every:
    fault_tolerant = "PARATRAIN_REPLICA_GROUP" in os.environ
    parallel = paratrain.Parallel(dp_replicate=1 if fault_tolerant else -1,
                                  semi_sync=paratrain.DiLoCo(every=every))
run = paratrain.Run(strategy="auto" if every else "ddp", parallel=parallel, progress=False,
                    stragglers=False, checkpoint_dir=checkpoint_dir,
                    checkpoint_every=checkpoint_every)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
loader = run.loader(data, batch_size=16)
group = os.environ.get("PARATRAIN_REPLICA_GROUP", "0/1").split("/")[0]
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
log = open(os.path.join(out, f"group{group}-rank{run.rank}.jsonl"), "a")
stop_file = os.path.join(out, "stop_at")


def digest() -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def stop_at() -> float:
    try:
        with open(stop_file) as f:
            return int(f.read().strip() or "0") or float("inf")
    except (OSError, ValueError):
        return float("inf")


done = False
for epoch in run.epochs(100_000):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        log.write(json.dumps({"step": run.global_step, "t": time.time(), "digest": digest(),
                              "pid": os.getpid(), "epoch": epoch, "restart": restart}) + "\n")
        log.flush()
        if run.global_step >= stop_at():
            done = True
            break
        time.sleep(sleep_s)
    if done:
        break
run.close()
