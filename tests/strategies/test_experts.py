"""Expert parallel against one process: the MoE GPT with its experts split over ep ranks
that are also the data-parallel ranks (ep=2 on 2, ep=4 on 4, ep=2 inside 4 data ranks).
Dropless routing with the global-batch balance loss: the loss, the replicated gradients
and the experts' gradients equal one process's on the global batch within float32's
reassociation bound; each rank holds 1/ep of the expert weights."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.models import GPT
from paratrain.strategies.experts.apply import (
    apply_expert_parallel,
    average_expert_gradients,
    expert_parameters,
    whole_experts,
)
from paratrain.strategies.experts.moe import MoE, balance_loss, router_statistics
from paratrain.testing.numerics import REASSOCIATION, assert_gradients_within
from paratrain.testing.pool import spawn

EXPERTS, LENGTH, VOCAB, ALPHA = 4, 8, 64, 0.01


def build() -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=2, n_embd=16,
                experts=EXPERTS, top_k=2)
    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.global_balance = True
    return model


def global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2 * world, LENGTH + 1),
                           generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, tokens, targets):
    logits = model(tokens)
    task = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return task + ALPHA * balance_loss(model)


def one_process(world: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = build()
    loss = loss_of(model, *global_batch(world))
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def expert_worker(rank, world_size, ep):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # Expert groups: consecutive ranks; expert replicas: same position in each group.
    expert_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world_size, ep)]
    replica_groups = [dist.new_group(list(range(p, world_size, ep))) for p in range(ep)]
    group = expert_groups[rank // ep]
    model = build()
    apply_expert_parallel(model, group, balance_group=dist.group.WORLD)
    tokens, targets = (t.chunk(world_size)[rank] for t in global_batch(world_size))
    loss = loss_of(model, tokens, targets)
    loss.backward()
    experts = expert_parameters(model)
    for param in model.parameters():
        if id(param) in experts:
            if world_size > ep:  # the same experts on other groups saw other tokens
                dist.all_reduce(param.grad, group=replica_groups[rank % ep])
        else:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    average_expert_gradients(model, world_size)
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad for n, p in model.named_parameters() if id(p) not in experts}
    for param in model.parameters():
        if id(param) in experts:
            param.data = param.grad  # gather the gradients the way the weights are
    grads.update(whole_experts(model, group))
    held = sum(p.numel() for p in model.parameters() if id(p) in experts)
    return float(total) / world_size, grads, held, router_statistics(model)


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_expert_parallel_matches_one_process(world, ep):
    loss, grads = one_process(world)
    results = spawn(expert_worker, world, ep)
    whole_experts_numel = sum(m.w_in.numel() + m.w_out.numel()
                              for m in build().modules() if isinstance(m, MoE))
    for got_loss, got_grads, held, stats in results:
        assert abs(got_loss - loss) <= REASSOCIATION * abs(loss), (got_loss, loss)
        assert_gradients_within(got_grads, grads)
        assert held * ep == whole_experts_numel
        assert stats["router_tokens"] == 2 * LENGTH * 2 * ep  # 2 copies of every token


def test_expert_count_not_divisible_is_one_line():
    model = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=1, n_head=2, n_embd=16,
                experts=3)

    class Group:  # world size 2, rank 0, without a process group
        pass

    import unittest.mock as mock
    with mock.patch.object(dist, "get_world_size", return_value=2), \
            mock.patch.object(dist, "get_rank", return_value=0), \
            pytest.raises(ValueError, match="ep=2 splits each MoE layer's 3 experts"):
        apply_expert_parallel(model, Group())


def test_balance_loss_is_one_for_an_even_router():
    layer = MoE(dim=4, hidden=8, num_experts=4, top_k=1)
    torch.nn.init.zeros_(layer.router.weight)  # equal probabilities: every tie alike
    layer(torch.randn(1, 8, 4))
    # All tokens on one expert, probabilities even: E * 1 * 1/4 = 1.
    assert float(layer.balance_loss.detach()) == pytest.approx(1.0)
    assert sorted(layer.tokens_per_expert.tolist()) == [0.0, 0.0, 0.0, 8.0]
