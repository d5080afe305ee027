"""The outer step across fault-tolerant replica groups, in one process.

A stand-in for torchft's round adds the other groups' messages to this group's; what is
checked is the arithmetic of :meth:`OuterSync._sync_groups`: a group healed since the
last sync sends zeros and a count of 0, and the outer step is then the mean over the
groups that sent, bit for bit the step those groups would take alone.
"""

import pytest
import torch
from torch import nn

from paratrain import DiLoCo, LocalSGD
from paratrain.fault_tolerance.rounds import RoundSums
from paratrain.strategies.semisync.outer import OuterSync


class OtherGroups:
    """Sums this group's messages with ``others`` (each a list like the messages)."""

    def __init__(self, others: list[list[torch.Tensor]] | None = None,
                 groups: int | None = None) -> None:
        self.others = others or []
        self.groups = groups or 1 + len(self.others)
        self.sent: list[list[torch.Tensor]] = []

    def outer_round(self, step, messages):
        groups = self.groups
        sends = messages(groups)
        self.sent.append([t.clone() for t in sends])
        for other in self.others:
            for mine, theirs in zip(sends, other):
                mine.add_(theirs)
        *totals, count = sends
        return RoundSums(totals, groups, round(float(count.item())))


def _trained(mode, groups, *, fresh=False, seed=0):
    """A linear layer's parameters after ``mode.every`` inner steps and one sync."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    outer = OuterSync(mode, [list(layer.parameters())], group=None, replicas=1,
                      device=torch.device("cpu"), groups=groups)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(mode.every):
        outer.before_step()
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=0.1)
        if fresh:
            outer.fresh = {0}
        outer.after_step()
    return [p.detach().clone() for p in layer.parameters()]


MODES = [DiLoCo(every=3), DiLoCo(every=3, comm_dtype="bf16"), LocalSGD(every=3),
         DiLoCo(every=3, outer_lr=1.0, outer_momentum=0.0)]


@pytest.mark.parametrize("mode", MODES, ids=["diloco", "diloco-bf16", "localsgd", "lr1"])
def test_a_healed_group_leaves_the_survivors_own_outer_step(mode):
    alone = _trained(mode, OtherGroups())
    # The healed group sends what a fresh group sends: zeros and a count of 0.
    healed = OtherGroups(groups=2)
    _trained(mode, healed, fresh=True)
    [messages] = healed.sent
    assert all(not t.any() for t in messages)
    with_healed = _trained(mode, OtherGroups([messages]))
    for a, b in zip(alone, with_healed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES[:3], ids=["diloco", "diloco-bf16", "localsgd"])
def test_two_groups_that_sent_average_both(mode):
    other = OtherGroups(groups=2)
    _trained(mode, other, seed=1)
    both = _trained(mode, OtherGroups(other.sent))
    alone = _trained(mode, OtherGroups())
    assert not all(torch.equal(a, b) for a, b in zip(both, alone))  # the other group counts
    # Symmetric: the other group, summing ours, lands on the same parameters.
    mine = OtherGroups(groups=2)
    _trained(mode, mine)
    theirs = _trained(mode, OtherGroups(mine.sent), seed=1)
    for a, b in zip(both, theirs):
        assert torch.equal(a, b)
