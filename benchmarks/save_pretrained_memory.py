"""Extra memory per rank of ``run.save_pretrained`` and ``run.load_pretrained`` under fsdp.

paratrain's GPT at GPT-2-small size (12 blocks, width 768, vocabulary 50257, 1024
positions; its head is not tied, so 163M parameters, 651 MB in float32) is exported once
in one process (the reference files). Then on 2 gloo ranks it is built under
``empty_weights`` (parameters on meta), prepared with ``fsdp`` (each rank materialises
its half), filled by ``load_pretrained`` from the reference files and written again by
``save_pretrained``. A thread samples each rank's resident memory every millisecond;
"extra" is the peak during the call minus the resident memory just before it. The bound
is the largest output file plus the largest tensor (one gathered tensor in flight while a
file's tensors are held). The files must equal the reference byte for byte.

    python benchmarks/save_pretrained_memory.py                     # 100MB, 200MB, 5GB
    python benchmarks/save_pretrained_memory.py --shards 200MB      # one size
"""

from __future__ import annotations

import argparse
import filecmp
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

import paratrain
from paratrain.checkpoint import huggingface
from paratrain.checkpoint.meta_init import empty_weights
from paratrain.distributed.spawn import spawn
from paratrain.models import GPT

MB = 10**6


def gpt2_small() -> GPT:
    return GPT(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def anonymous_rss() -> int:
    """Resident anonymous memory (tensors, heap): unlike RSS, not the pages of the
    safetensors files that reading maps in (the page cache holds those, not the process)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return psutil.Process().memory_info().rss  # not Linux: all resident memory


def extra_memory(fn: Callable[[], Any]) -> int:
    """Peak anonymous resident bytes while ``fn`` runs, above those just before it."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_rss())
            time.sleep(0.001)

    before = anonymous_rss()
    peak[0] = before
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], anonymous_rss()) - before


def worker(rank: int, world_size: int, reference: str, out: str, shard: str) -> dict:
    torch.set_num_threads(1)
    with paratrain.Run(strategy="fsdp", accelerator="cpu", progress=False, seed=0) as run:
        with empty_weights():
            model = gpt2_small()
        model = run.prepare(model)
        # Materialised memory is untouched until written: write it now, so that loading
        # does not count this rank's own shards as extra.
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().zero_()
        load = extra_memory(lambda: run.load_pretrained(reference))
        save = extra_memory(lambda: run.save_pretrained(out, max_shard_size=shard))
    return {"load": load, "save": save}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="100MB,200MB,5GB", help="max_shard_size values")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = gpt2_small()
        state = model.state_dict()
        largest = max(t.numel() * t.element_size() for t in state.values())
        total = sum(t.numel() * t.element_size() for t in state.values())
        print(f"model: paratrain GPT at GPT-2-small size, {total / MB:.0f} MB float32, "
              f"largest tensor {largest / MB:.0f} MB; fsdp on 2 gloo ranks")
        print(f"{'max_shard_size':>14} {'files':>5} {'largest file MB':>15} {'bound MB':>8} "
              f"{'save extra MB r0/r1':>19} {'load extra MB r0/r1':>19} {'within':>6} "
              f"{'bytes equal':>11}")
        for shard in args.shards.split(","):
            reference, out = Path(tmp, f"ref-{shard}"), Path(tmp, f"out-{shard}")
            huggingface.save_pretrained(reference, model, max_shard_size=shard)
            results = spawn(worker, 2, str(reference), str(out), shard, timeout=1800)
            files = sorted(p.name for p in reference.iterdir())
            biggest = max(os.path.getsize(reference / f) for f in files
                          if f.endswith(".safetensors"))
            bound = biggest + largest
            equal = files == sorted(p.name for p in out.iterdir()) and all(
                filecmp.cmp(reference / f, out / f, shallow=False) for f in files)
            saves = [r["save"] for r in results]
            loads = [r["load"] for r in results]
            print(f"{shard:>14} {len(files):>5} {biggest / MB:>15.0f} {bound / MB:>8.0f} "
                  f"{'/'.join(f'{s / MB:.0f}' for s in saves):>19} "
                  f"{'/'.join(f'{s / MB:.0f}' for s in loads):>19} "
                  f"{'yes' if max(saves) <= bound else 'NO':>6} {'yes' if equal else 'NO':>11}")


if __name__ == "__main__":
    main()
