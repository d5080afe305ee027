"""The GPU recipe's switches, checked without a GPU: the TF32 choice and its restoring,
the optimizer notice (the CUDA device is only named, nothing runs on it)."""

import pytest
import torch
from torch import nn

import paratrain
from paratrain.precision import Precision
from paratrain.run.misuse import optimizer_notice

CUDA = torch.device("cuda", 0)


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def params():
    return nn.Linear(3, 2).parameters()


def test_tf32_is_turned_on_for_cuda_and_restored(matmul_precision):
    torch.set_float32_matmul_precision("highest")
    precision = Precision("bf16-mixed", "cuda")
    assert torch.get_float32_matmul_precision() == "high"
    precision.restore()
    assert torch.get_float32_matmul_precision() == "highest"


def test_tf32_leaves_cpu_an_explicit_choice_and_an_opt_out_alone(matmul_precision):
    torch.set_float32_matmul_precision("highest")
    Precision("32", "cpu")  # CPU "high" may mean bf16 products: never touched
    assert torch.get_float32_matmul_precision() == "highest"
    Precision("32", "cuda", tf32=False)
    assert torch.get_float32_matmul_precision() == "highest"
    torch.set_float32_matmul_precision("medium")
    Precision("32", "cuda").restore()
    assert torch.get_float32_matmul_precision() == "medium"  # the user's choice stands


def test_tf32_is_validated_with_one_line():
    with pytest.raises(ValueError, match="tf32 must be True or False, got 'yes'"):
        paratrain.Run(accelerator="cpu", progress=False, tf32="yes")


class OneAtATime(torch.optim.Optimizer):
    def __init__(self, parameters):
        super().__init__(parameters, {"lr": 0.1})


@pytest.mark.parametrize("optimizer, suggested", [
    (lambda: torch.optim.AdamW(params(), foreach=False), "foreach=False"),
    (lambda: OneAtATime(params()), "no foreach or fused form"),
    (lambda: torch.optim.AdamW(params()), None),  # foreach by default on CUDA
    (lambda: torch.optim.AdamW(params(), fused=True), None),
    (lambda: torch.optim.SGD(params(), lr=0.1, foreach=True), None),
])
def test_optimizer_notice_names_a_one_tensor_at_a_time_optimizer(optimizer, suggested):
    notice = optimizer_notice(optimizer(), CUDA)
    if suggested is None:
        assert notice is None
    else:
        assert suggested in notice and "fused=True" in notice and "\n" not in notice
    assert optimizer_notice(optimizer(), torch.device("cpu")) is None
