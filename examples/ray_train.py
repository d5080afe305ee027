"""One paratrain training function, run as a Ray Train job or under ``paratrain launch``.

    python examples/ray_train.py --workers 2                         # local Ray cluster, 2 CPU workers
    python examples/ray_train.py --address auto --workers 8 --gpu    # an existing Ray cluster
    paratrain launch --nproc-per-node 2 examples/ray_train.py        # no Ray: the same function

``train(config)`` is an ordinary paratrain script's body; nothing in it knows about Ray.
Ray's ``TorchTrainer`` calls it in each of its workers after forming the process group
and setting ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/...; ``paratrain.Run``
reads those and reuses that group (docs/clusters.md). With the same seed, data and
threads per worker, both ways compute the same bits (tests/cluster/test_ray.py).

The task is a small classifier on synthetic data, so the script runs anywhere in
seconds. ``--checkpoint-dir`` must be a path every worker can write (one machine, or a
shared filesystem on a multi-node cluster); ``--json`` receives the per-step losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.cluster.ray import require as require_ray


def make_data(samples: int, seed: int) -> TensorDataset:
    """Points in 8 dimensions labelled by the largest of 4 fixed random projections."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    projection = torch.randn(8, 4, generator=generator)
    return TensorDataset(x, (x @ projection).argmax(dim=1))


def train(config: dict) -> None:
    """The training function: the same on every worker, under Ray or any launcher."""
    run = paratrain.Run(strategy=config.get("strategy", "auto"), seed=config.get("seed", 0),
                        accelerator=config.get("accelerator", "auto"), progress=False,
                        checkpoint_dir=config.get("checkpoint_dir"))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=0.9)
    model, optimizer = run.prepare(model, optimizer)
    data = make_data(config.get("samples", 256), config.get("seed", 0))
    losses = []
    for epoch in run.epochs(config.get("epochs", 2)):
        for x, y in run.loader(data, batch_size=config.get("batch_size", 16)):
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(optimizer)
            losses.append(run.mean(loss))  # over the workers: the global batch's loss
        run.print(f"epoch {epoch}: loss {losses[-1]:.4f} ({run.world_size} workers)")
        if config.get("checkpoint_dir"):
            run.save()
    if config.get("json") and run.is_main:
        with open(config["json"], "w") as f:
            json.dump({"world_size": run.world_size, "strategy": run.strategy.name,
                       "global_steps": run.global_step, "losses": losses}, f)
    run.close()


def fit_on_ray(config: dict, *, workers: int, use_gpu: bool = False,
               address: str | None = None, storage_path: str | None = None) -> None:
    """Run ``train(config)`` on ``workers`` Ray Train workers (a local cluster unless
    ``address`` names one); Ray keeps its records in ``storage_path`` (~/ray_results)."""
    import ray.train

    from paratrain.cluster.ray import ScalingConfig, TorchTrainer

    started = not ray.is_initialized()
    if started:
        # A local cluster gets a CPU per worker, and one for Ray Train's V1 trainer actor,
        # even on a smaller machine: Ray would otherwise wait for CPUs that never come.
        local = {} if address else {"num_cpus": max(workers + 1, os.cpu_count() or 1)}
        ray.init(address=address or "local", include_dashboard=False, **local)
    try:
        trainer = TorchTrainer(train, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=workers,
                                                            use_gpu=use_gpu),
                               run_config=ray.train.RunConfig(storage_path=storage_path))
        trainer.fit()
    finally:
        if started:
            ray.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--workers", type=int, default=2, help="Ray Train workers (ignored when launched)")
    add("--gpu", action="store_true", help="one GPU per Ray worker (NCCL)")
    add("--address", default=None, help="a running Ray cluster (default: start a local one)")
    add("--no-ray", action="store_true", help="run train() in this process, without Ray")
    add("--storage-path", default=None, help="where Ray keeps its records (~/ray_results)")
    add("--epochs", type=int, default=2)
    add("--samples", type=int, default=256)
    add("--batch-size", type=int, default=16, help="per worker")
    add("--lr", type=float, default=0.1)
    add("--seed", type=int, default=0)
    add("--strategy", default="auto")
    add("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    add("--checkpoint-dir", default=None)
    add("--json", default=None, metavar="PATH", help="write the per-step losses here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = {name: getattr(args, name) for name in (
        "epochs", "samples", "batch_size", "lr", "seed", "strategy", "accelerator",
        "checkpoint_dir", "json")}
    if args.no_ray or "RANK" in os.environ:  # started by a launcher: it made the processes
        train(config)
        return 0
    try:
        require_ray()
    except RuntimeError as exc:
        sys.exit(f"paratrain: {exc}")  # Ray Train not installed: one line naming the extra
    fit_on_ray(config, workers=args.workers, use_gpu=args.gpu, address=args.address,
               storage_path=args.storage_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
