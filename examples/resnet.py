"""ResNet-18 on Fashion-MNIST (or CIFAR-10) with paratrain.

    paratrain launch --nproc-per-node 2 examples/resnet.py --epochs 6
    paratrain launch --nproc-per-node 2 examples/resnet.py --dataset cifar10 --data-dir ~/data

torchvision's ResNet-18 with its stem adapted to small images (``--stem``), standard
augmentation (random crop with padding, horizontal flip) and SGD with a one-cycle
learning rate. The same script runs as one process, as many processes on one machine or
across machines: only the launch command changes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset
from torchvision.transforms import v2

import paratrain
from paratrain.datasets import DatasetNotFound, find_fashion_mnist, read_idx

# Per-channel mean and std of the training pixels in [0, 1].
STATS = {"fashion-mnist": ((0.2860,), (0.3530,)),
         "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))}
# Resolution of layer1's feature maps decides the cost: see build_model.
STEMS = ("auto", "cifar", "pool", "imagenet")


class AugmentedImages(Dataset):
    """uint8 images ``(N, C, H, W)`` and labels, transformed per sample when read."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: v2.Transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[index]), self.labels[index]


def transforms(dataset: str, *, train: bool) -> v2.Transform:
    size, padding = (28, 2) if dataset == "fashion-mnist" else (32, 4)
    mean, std = STATS[dataset]
    augment = [v2.RandomCrop(size, padding=padding), v2.RandomHorizontalFlip()] if train else []
    return v2.Compose([*augment, v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def load_images(dataset: str, data_dir: str | None, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images ``(N, C, H, W)`` and int64 labels of ``split`` (train or test)."""
    if dataset == "fashion-mnist":
        directory = find_fashion_mnist(data_dir)
        prefix = "train" if split == "train" else "t10k"
        images = read_idx(_idx_file(directory, f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(_idx_file(directory, f"{prefix}-labels-idx1-ubyte"))
        return images.unsqueeze(1), labels.long()
    root = os.path.expanduser(data_dir or "~/data")
    try:
        cifar = torchvision.datasets.CIFAR10(root, train=split == "train", download=False)
    except RuntimeError:
        raise DatasetNotFound(
            f"CIFAR-10 not found in {root}: extract cifar-10-python.tar.gz there so that "
            f"{os.path.join(root, 'cifar-10-batches-py')} exists, and pass --data-dir {root}"
        ) from None
    images = torch.from_numpy(cifar.data).permute(0, 3, 1, 2).contiguous()
    return images, torch.tensor(cifar.targets, dtype=torch.long)


def _idx_file(directory, stem: str):
    for name in (stem + ".gz", stem):
        if (directory / name).exists():
            return directory / name
    raise DatasetNotFound(f"{stem}(.gz) missing in {directory}")


class _NoStatsUpdate:
    """While active, BatchNorm layers normalise with batch statistics but leave the
    running statistics alone (momentum 0): activation checkpointing recomputes the
    forward, which would otherwise count every batch twice."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def __enter__(self) -> None:
        self.saved = [(m.momentum, None if m.num_batches_tracked is None
                       else m.num_batches_tracked.clone()) for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0

    def __exit__(self, *exc: object) -> None:
        for m, (momentum, tracked) in zip(self.norms, self.saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


class Checkpointed(nn.Module):
    """Run ``inner`` under activation checkpointing in training: its activations are
    recomputed during backward instead of kept, trading compute for memory."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self.inner(x)
        return checkpoint(self.inner, x, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), _NoStatsUpdate(self.inner)))


def build_model(*, in_channels: int, stem: str, activation_checkpointing: bool = False) -> nn.Module:
    """torchvision's ResNet-18 for small images.

    ``cifar``: 3x3 conv, stride 1, no max-pool (layer1 at full resolution, the usual
    CIFAR-10 choice). ``pool``: 3x3 conv then a 2x2 max-pool (layer1 at 14x14 for 28x28
    input: about 4x cheaper than ``cifar``). ``imagenet``: torchvision's 7x7/2 conv and
    3x3/2 max-pool (layer1 at 7x7; cheapest, least accurate on 28x28).
    """
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    if stem == "imagenet":
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    else:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.MaxPool2d(2) if stem == "pool" else nn.Identity()
    if activation_checkpointing:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, Checkpointed(getattr(model, name)))
    return model


def default_workers(device: torch.device, local_world_size: int) -> int:
    """Loader processes per training process."""
    cores = len(os.sched_getaffinity(0)) // max(1, local_world_size)
    if device.type == "cuda":
        # The GPU waits for data otherwise; leave one core for the training process.
        return max(1, min(4, cores - 1))
    # On CPU the cores train: augmenting a small image costs far less than its
    # forward/backward, so extra loader processes would only take cores away.
    return 0 if cores <= 2 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--dataset", choices=tuple(STATS), default="fashion-mnist")
    add("--data-dir", default=None, help="dataset folder (Fashion-MNIST IDX files or CIFAR-10)")
    add("--stem", choices=STEMS, default="auto", help="auto: pool for Fashion-MNIST, cifar for CIFAR-10")
    add("--epochs", type=int, default=6)
    add("--batch-size", type=int, default=128, help="per worker")
    add("--lr", type=float, default=0.05, help="peak learning rate of the one-cycle schedule")
    add("--weight-decay", type=float, default=5e-4)
    add("--strategy", default="auto")
    add("--precision", default="32", help="32, bf16-mixed, 16-mixed or bf16-true")
    add("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    add("--activation-checkpointing", action="store_true",
        help="recompute each residual stage in backward instead of storing its activations")
    add("--workers", type=int, default=None, help="loader processes per worker (default: auto)")
    add("--train-samples", type=int, default=None, help="use only the first N training images")
    add("--test-samples", type=int, default=None, help="use only the first N test images")
    add("--checkpoint-dir", default=None, help="save every epoch here and resume from it")
    add("--seed", type=int, default=0)
    add("--json", default=None, metavar="PATH", help="write a summary of the run here")
    add("--no-progress", action="store_true")
    return parser


def train(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    stem = args.stem if args.stem != "auto" else ("pool" if args.dataset == "fashion-mnist" else "cifar")
    with paratrain.Run(strategy=args.strategy, precision=args.precision, seed=args.seed,
                       accumulate=args.accumulate, checkpoint_dir=args.checkpoint_dir,
                       progress=not args.no_progress) as run:
        train_images, train_labels = load_images(args.dataset, args.data_dir, "train")
        test_images, test_labels = load_images(args.dataset, args.data_dir, "test")
        train_set = AugmentedImages(train_images[:args.train_samples], train_labels[:args.train_samples],
                                    transforms(args.dataset, train=True))
        test_set = AugmentedImages(test_images[:args.test_samples], test_labels[:args.test_samples],
                                   transforms(args.dataset, train=False))
        workers = args.workers if args.workers is not None else default_workers(
            run.device, run.topology.local_world_size)
        loader = run.loader(train_set, batch_size=args.batch_size, num_workers=workers)
        test_loader = run.eval_loader(test_set, batch_size=256, num_workers=workers)

        model = build_model(in_channels=train_images.shape[1], stem=stem,
                            activation_checkpointing=args.activation_checkpointing)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                    weight_decay=args.weight_decay)
        steps_per_epoch = -(-len(loader) // args.accumulate)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=args.lr, total_steps=max(1, args.epochs * steps_per_epoch),
            pct_start=0.25)
        model, optimizer = run.prepare(model, optimizer, scheduler)
        run.print(f"ResNet-18 ({stem} stem) on {args.dataset}: {len(train_set)} training images, "
                  f"{run.world_size} worker(s), strategy {run.strategy.name}, global batch "
                  f"{loader.global_batch_size * args.accumulate}, {workers} loader process(es) each")
        history = []
        for epoch in run.epochs(args.epochs):
            loss_sum, num_batches = torch.zeros((), device=run.device), 0
            for x, y in run.progress(loader):
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                loss_sum += loss.detach()
                num_batches += 1
            speed = run.epoch_throughput()
            metrics = run.evaluate(model, test_loader)
            row = {"epoch": epoch, "train_loss": run.mean(loss_sum / max(1, num_batches)),
                   "test_loss": metrics["loss"], "test_accuracy": metrics["accuracy"],
                   "samples_per_s": speed["samples_per_s"], "epoch_seconds": speed["seconds"]}
            history.append(row)
            run.log(row)
            run.print(f"epoch {epoch}: train loss {row['train_loss']:.4f}, test accuracy "
                      f"{metrics['accuracy']:.2%}, {speed['samples_per_s']:.0f} samples/s")
            if args.checkpoint_dir:
                run.save()
        summary = {"dataset": args.dataset, "stem": stem, "world_size": run.world_size,
                   "strategy": run.strategy.name, "precision": args.precision,
                   "global_steps": run.global_step, "test_count": len(test_set),
                   "history": history, "seconds": time.perf_counter() - started}
        if history:
            summary["test_accuracy"] = history[-1]["test_accuracy"]
        if args.json and run.is_main:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("epochs", "batch_size", "accumulate"):
        if getattr(args, name) < 1:
            print(f"resnet.py: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        train(args)
    except DatasetNotFound as exc:
        print(f"resnet.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
