"""Offline real datasets: Fashion-MNIST (:mod:`~paratrain.datasets.images`) and Rotten
Tomatoes snippets (:mod:`~paratrain.datasets.text`). Nothing is downloaded."""

from paratrain.datasets.images import (
    FASHION_MNIST_CLASSES,
    DatasetNotFound,
    fashion_mnist,
    find_fashion_mnist,
    read_idx,
)

__all__ = ["FASHION_MNIST_CLASSES", "DatasetNotFound", "fashion_mnist", "find_fashion_mnist",
           "read_idx"]
