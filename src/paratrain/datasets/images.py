"""Real datasets that work offline: Fashion-MNIST from its IDX files."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from paratrain.settings import Settings

FASHION_MNIST_ENV = "PARATRAIN_DATA_DIR"
FASHION_MNIST_DIRS = (
    "/usr/share/datasets/fashion-mnist",  # Debian: apt-get install dataset-fashion-mnist
    "~/.cache/paratrain/fashion-mnist",
)
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
# Mean and standard deviation of the training pixels in [0, 1].
_MEAN, _STD = 0.2860, 0.3530
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class DatasetNotFound(FileNotFoundError):
    """A dataset is not on disk; the message says how to get it."""


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file (optionally gzipped) of unsigned bytes into a uint8 tensor."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, num_dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    shape = struct.unpack(f">{num_dims}I", data[4 : 4 + 4 * num_dims])
    body = data[4 + 4 * num_dims :]
    expected = 1
    for size in shape:
        expected *= size
    if len(body) != expected:
        raise ValueError(f"{path} is truncated: {len(body)} bytes, expected {expected}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(shape)


def _find_file(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx")):
        candidate = directory / name
        if candidate.exists():
            return candidate
    return None


def find_fashion_mnist(data_dir: str | os.PathLike | None = None) -> Path:
    """The first directory holding the Fashion-MNIST IDX files; DatasetNotFound otherwise."""
    candidates = [Path(data_dir)] if data_dir else []
    configured = Settings.from_environ().data_dir
    if configured:
        candidates.append(Path(configured))
    candidates += [Path(d).expanduser() for d in FASHION_MNIST_DIRS]
    for directory in candidates:
        for sub in (directory, directory / "FashionMNIST" / "raw"):
            if all(_find_file(sub, stem) for pair in _FILES.values() for stem in pair):
                return sub
    searched = ", ".join(str(c) for c in candidates)
    raise DatasetNotFound(
        f"Fashion-MNIST not found (looked in {searched}): run `apt-get install "
        f"dataset-fashion-mnist` or put the four *-ubyte.gz files in a folder and pass "
        f"--data-dir DIR (or set {FASHION_MNIST_ENV})"
    )


def fashion_mnist(
    split: str = "train", *, data_dir: str | os.PathLike | None = None, limit: int | None = None
) -> TensorDataset:
    """Fashion-MNIST as a TensorDataset of normalised ``(1, 28, 28)`` float images and labels.

    Example:
        >>> train = fashion_mnist("train")       # doctest: +SKIP
        >>> image, label = train[0]              # doctest: +SKIP
    """
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    directory = find_fashion_mnist(data_dir)
    image_stem, label_stem = _FILES[split]
    images = read_idx(_find_file(directory, image_stem))
    labels = read_idx(_find_file(directory, label_stem))
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    x = (images.float().div_(255.0).sub_(_MEAN).div_(_STD)).unsqueeze(1)
    return TensorDataset(x, labels.long())
