"""A small training job for the fault-tolerance tests: one JSON line per step.

    ft_train.py OUT_DIR [SLEEP_S] [EPOCHS]

Each process appends ``{"step", "t", "digest", "pid", "epoch", "samples"}`` to
``OUT_DIR/group<G>-rank<R>.jsonl`` after every step, where the digest is a hash of this
rank's parameters (its shards under FSDP), so that tests can compare replica groups
bitwise, step by step, and see stalls, repeats and gaps.
"""

import dataclasses
import hashlib
import json
import os
import sys
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import paratrain

out = sys.argv[1]
sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
strategy = os.environ.get("FT_TEST_STRATEGY", "ddp")
generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(512, 8, generator=generator),
                     torch.randn(512, 1, generator=generator), torch.arange(512))
options = json.loads(os.environ.get("FT_TEST_OPTIONS", "null"))  # Run(fault_tolerance=...)
checkpoints = os.environ.get("FT_TEST_CHECKPOINT_DIR") or None
# FT_TEST_SEMI_SYNC: {"kind": "DiLoCo" | "LocalSGD", its fields...}; the replicas are the
# replica groups under --fault-tolerant (dp_shard=-1), else the ranks (dp_replicate=-1).
semi = json.loads(os.environ.get("FT_TEST_SEMI_SYNC", "null"))
parallel = None
if semi is not None:
    mode = getattr(paratrain, semi.pop("kind"))(**semi)
    fault_tolerant = "PARATRAIN_REPLICA_GROUP" in os.environ
    parallel = paratrain.Parallel.parse(os.environ.get("FT_TEST_PARALLEL") or (
        "dp_shard=-1" if fault_tolerant else "dp_replicate=-1"))
    parallel = dataclasses.replace(parallel, semi_sync=mode)
    strategy = "auto"
run = paratrain.Run(strategy=strategy, parallel=parallel, progress=False, stragglers=False,
                    fault_tolerance=options, checkpoint_dir=checkpoints,
                    checkpoint_every=8 if checkpoints else None)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
loader = run.loader(data, batch_size=16)
group = os.environ.get("PARATRAIN_REPLICA_GROUP", "0/1").split("/")[0]
log = open(os.path.join(out, f"group{group}-rank{run.rank}.jsonl"), "a")


def digest() -> str:
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()


for epoch in run.epochs(epochs):
    for x, y, index in loader:
        loss = nn.functional.mse_loss(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        log.write(json.dumps({"step": run.global_step, "t": time.time(), "digest": digest(),
                              "pid": os.getpid(), "epoch": epoch,
                              "samples": index.tolist()}) + "\n")
        log.flush()
        time.sleep(sleep_s)
run.close()
