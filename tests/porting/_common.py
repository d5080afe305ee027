"""Shared by the porting scripts: a tiny classification task and a parameter fingerprint."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def dataset(num_samples=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 8, generator=g)
    return TensorDataset(x, (x[:, :2].sum(dim=1) > 0).long())


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def fingerprint(module):
    """A number that changes with any parameter (printed by every rank)."""
    return sum(float((p.detach().double() * (i + 1)).sum()) for i, p in enumerate(module.parameters()))
