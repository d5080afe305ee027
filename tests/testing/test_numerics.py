"""``paratrain.testing.numerics``: the bound tolerates another machine's rounding where
Adam amplifies it, and still catches a real difference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_gradients_within,
    assert_losses_within,
    assert_params_within,
)

STEPS = 4


class ShiftedLinear(nn.Module):
    """Logits plus one shift shared by every class: softmax ignores it, so its exact
    gradient is zero and float32 leaves rounding noise (as a key bias in attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4)
        self.shift = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.linear(x) + self.shift


def train(make_optimizer, *, rounding=0.0, bug=False):
    """STEPS steps; ``rounding``: noise of that many units of roundoff of the step's
    largest gradient element added to every gradient (another machine's kernels)."""
    torch.manual_seed(0)
    model = ShiftedLinear()
    optimizer = make_optimizer(model.parameters())
    bound = TrainingBound(model, optimizer)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        largest = max(float(p.grad.abs().max()) for p in model.parameters())
        for p in model.parameters():
            p.grad += rounding * 2.0 ** -24 * largest * torch.randn(p.shape, generator=g)
        if bug and step == 2:
            model.linear.weight.grad[0] = 0  # a gradient that did not arrive
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, bound


def adam(params):
    return torch.optim.AdamW(params, lr=1e-2)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_adam_amplifies_rounding_in_a_zero_gradient_and_the_bound_allows_for_it():
    reference, bound = train(adam)
    other, _ = train(adam, rounding=8.0)
    # A fixed tolerance fails on the shift: Adam divides its noise by its own size.
    assert (other["shift"] - reference["shift"]).abs().item() > 1e-4
    with pytest.raises(AssertionError):
        torch.testing.assert_close(other["shift"], reference["shift"], atol=1e-5, rtol=1e-5)
    assert_params_within(other, reference, bound)
    # The elements with a real gradient keep a bound far below an lr-sized difference.
    assert bound.tolerances()["linear.weight"].max() < 1e-2 * 1e-2 * STEPS


@pytest.mark.parametrize("make_optimizer", [adam, sgd], ids=["adamw", "sgd"])
def test_a_missing_gradient_is_caught(make_optimizer):
    reference, bound = train(make_optimizer)
    assert_params_within(train(make_optimizer, rounding=8.0)[0], reference, bound)
    broken, _ = train(make_optimizer, bug=True)
    with pytest.raises(AssertionError, match=r"linear.weight\[\d+\]"):
        assert_params_within(broken, reference, bound)


def test_untrained_entries_must_be_equal_and_other_optimizers_are_refused():
    reference, bound = train(sgd)
    with pytest.raises(AssertionError, match="untrained entry differs"):
        assert_params_within({"buffer": torch.ones(1)}, {"buffer": torch.zeros(1)}, bound)
    with pytest.raises(ValueError, match="models SGD and Adam"):
        TrainingBound(nn.Linear(1, 1), torch.optim.RMSprop(nn.Linear(1, 1).parameters()))


def test_gradients_and_losses_within_reassociation():
    reference = {"w": torch.tensor([0.5, -0.25])}
    assert_gradients_within({"w": reference["w"] + 0.25 * REASSOCIATION}, reference)
    with pytest.raises(AssertionError, match="w: gradient differs"):
        assert_gradients_within({"w": reference["w"] + REASSOCIATION}, reference)
    assert_losses_within([2.0 * (1 + 0.5 * REASSOCIATION)], [2.0])
    with pytest.raises(AssertionError, match="step 0"):
        assert_losses_within([2.0 * (1 + 2 * REASSOCIATION)], [2.0])
