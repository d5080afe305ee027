"""Rank 1 is stuck for a minute before it creates its Run (as if loading data)."""

import os
import time

import paratrain

if os.environ["RANK"] == "1":
    time.sleep(60)
with paratrain.Run(accelerator="cpu", progress=False) as run:
    print("joined", flush=True)
