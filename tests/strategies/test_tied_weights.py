"""Tied weights (a Hugging Face GPT-2's embedding and head) stay tied under sharding.

torch refuses a parameter managed by two FSDP units; ``shard_units`` keeps a tied
parameter with the unit that encloses every use of it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.strategies.dtensor_params import shared_outside
from paratrain.testing.pool import spawn

transformers = pytest.importorskip("transformers")


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(7)
    return transformers.GPT2LMHeadModel(config)


def tokens(batch):
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, 64, (batch, 12), generator=g)


def train(strategy, world_size, steps=3):
    run = paratrain.Run(strategy=strategy, progress=False, seed=1)
    model = gpt2()
    # SGD: parameters differ from one process by lr x rounding of the gradient.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = run.prepare(model, optimizer)
    data = tokens(8)
    per_rank = 8 // world_size
    mine = data[run.rank * per_rank:(run.rank + 1) * per_rank]
    losses = []
    for _ in range(steps):
        logits = model(mine[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        run.backward(loss)
        run.step(optimizer)
        losses.append(run.mean(loss))
    inner = run.strategy.unwrap(model)
    tied = inner.lm_head.weight is inner.transformer.wte.weight
    state = run.strategy.full_state_dict(model) if hasattr(run.strategy, "full_state_dict") \
        else inner.state_dict()
    head = state["lm_head.weight"].detach().clone() if "lm_head.weight" in state else None
    embedding = state["transformer.wte.weight"].detach().clone()
    run.close()
    return losses, tied, head, embedding


def worker(rank, world_size, strategy):
    return train(strategy, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_tied_embedding_and_head_train_as_one_process(strategy):
    ref_losses, _, _, ref_embedding = train("single", 1)
    for losses, tied, head, embedding in spawn(worker, 2, strategy, timeout=240):
        assert tied
        if head is not None:
            assert torch.equal(head, embedding)
        # Float32 sums of 8 sequences' gradients in another order: a few ulps, times lr.
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert (embedding - ref_embedding).abs().max().item() < 1e-5


def test_a_unit_that_shares_a_parameter_with_the_outside_is_not_its_own_unit():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10))
    model[2].weight = model[0].weight
    shared = shared_outside(model)
    assert shared("0", model[0]) and shared("2", model[2])
    assert not shared("1", model[1])
