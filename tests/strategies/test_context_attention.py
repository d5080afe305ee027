"""Context-parallel attention against one process: the sequence cut over 2 and 4 gloo
ranks, outputs and the gradients of q, k and v equal whole-sequence attention within
float32's reassociation bound, causal and bidirectional, ring and all-to-all."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.strategies.context.attention import METHODS
from paratrain.strategies.context.sequence import SequenceOrder
from paratrain.testing.numerics import assert_gradients_within
from paratrain.testing.pool import spawn

# name -> (method, causal, load_balanced, kv_heads)
CASES = {
    "ring-causal-balanced": ("ring", True, True, 4),
    "ring-causal-plain": ("ring", True, False, 4),
    "ring-bidirectional": ("ring", False, False, 4),
    "ring-causal-gqa": ("ring", True, True, 2),
    "all_to_all-causal-balanced": ("all_to_all", True, True, 4),
    "all_to_all-bidirectional": ("all_to_all", False, False, 2),
}
LENGTH, HEADS, DIM = 16, 4, 8


def whole_sequence(seed: int, kv_heads: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, HEADS, LENGTH, DIM), (2, kv_heads, LENGTH, DIM), (2, kv_heads, LENGTH, DIM)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def reference(seed: int, causal: bool, kv_heads: int) -> dict[str, torch.Tensor]:
    q, k, v = (t.requires_grad_() for t in whole_sequence(seed, kv_heads))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                         enable_gqa=kv_heads != HEADS)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def attention_worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    results = {}
    for seed, (name, (method, causal, balanced, kv_heads)) in enumerate(CASES.items()):
        order = SequenceOrder(cp=world_size, length=LENGTH, load_balanced=balanced)
        q, k, v = (order.slice(t, rank, dim=2).requires_grad_()
                   for t in whole_sequence(seed, kv_heads))
        out = METHODS[method](q, k, v, group=group, order=order, causal=causal)
        weights = order.slice(torch.linspace(-1, 1, 2 * HEADS * LENGTH * DIM)
                              .reshape(2, HEADS, LENGTH, DIM), rank, dim=2)
        (out * weights).sum().backward()
        results[name] = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_matches_whole_sequence(cp):
    per_rank = spawn(attention_worker, cp)
    for seed, (name, (_, causal, balanced, kv_heads)) in enumerate(CASES.items()):
        order = SequenceOrder(cp=cp, length=LENGTH, load_balanced=balanced)
        expected = reference(seed, causal, kv_heads)
        # The ranks' pieces, put back in position order, are the whole-sequence tensors.
        got = {key: torch.cat([per_rank[r][name][key] for r in range(cp)], dim=2)
                    .index_select(2, order.natural_order()) for key in expected}
        assert_gradients_within({f"{name}.{k}": v for k, v in got.items()},
                                {f"{name}.{k}": v for k, v in expected.items()})


def test_balanced_order_gives_each_rank_head_and_tail():
    order = SequenceOrder(cp=4, length=16)
    assert order.positions(0).tolist() == [0, 1, 14, 15]
    assert order.positions(3).tolist() == [6, 7, 8, 9]
    whole = torch.arange(16).unsqueeze(0)
    pieces = torch.cat([order.slice(whole, r) for r in range(4)], dim=1)
    assert torch.equal(pieces.index_select(1, order.natural_order()), whole)


def test_causal_work_is_balanced():
    # Query/key position pairs each rank scores under the causal mask: equal when
    # balanced, 1 : 3 : 5 : 7 of the diagonal blocks' share without it.
    def pairs(order, rank):
        q = order.positions(rank)
        return int((q[:, None] >= torch.arange(order.length)[None, :]).sum())

    balanced = [pairs(SequenceOrder(cp=4, length=16), r) for r in range(4)]
    plain = [pairs(SequenceOrder(cp=4, length=16, load_balanced=False), r) for r in range(4)]
    assert len(set(balanced)) == 1
    assert plain[-1] > 3 * plain[0]


def test_length_not_divisible_is_one_line():
    with pytest.raises(ValueError, match=r"divisible by 2 x cp = 4, got 10"):
        SequenceOrder(cp=2, length=10)
