"""Checkpoints of a model whose experts are split (``ep``): the split expert weights are
DTensors of the whole ``(E, ...)`` weight, so a sharded checkpoint names each layer's
experts once. Save under ``ep=2`` -> resume under ``ep=2`` continues bit for bit; the same
checkpoint loads under another layout (``dp_shard=2``, no ep) to the same whole state.
"""

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain.models import GPT
from paratrain.testing.language import token_dataset
from paratrain.testing.pool import spawn

VOCAB, LENGTH = 16, 8


def batches():
    data = token_dataset(16, VOCAB, LENGTH)
    return [(data.tensors[0][i:i + 4], data.tensors[1][i:i + 4]) for i in range(0, 16, 4)]


def prepared(spec, seed, directory):
    run = paratrain.Run(parallel=spec, progress=False, accelerator="cpu", seed=5,
                        checkpoint_dir=directory, max_grad_norm=0.5)
    torch.manual_seed(seed)
    model = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=2, n_embd=16,
                experts=4, top_k=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = run.prepare(model, optimizer)
    return run, model, optimizer


def steps(run, model, optimizer, pieces):
    rank = run.strategy.data_parallel_rank
    for x, y in pieces:
        x, y = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]  # this data rank's half
        run.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        run.step(optimizer)


def whole(run, model):
    return {k: v.detach().clone() for k, v in run.strategy.full_state_dict(model).items()}


def worker(rank, world_size, directory):
    data = batches()
    run, model, optimizer = prepared("ep=2", 0, directory)
    steps(run, model, optimizer, data[:2])
    run.save(wait=True)
    path = f"{directory}/step-{run.global_step:09d}.pt"  # save() names it on rank 0 only
    saved = whole(run, model)
    steps(run, model, optimizer, data[2:])
    uninterrupted = whole(run, model)
    run.close()

    run, model, optimizer = prepared("ep=2", 1, directory)  # other initial weights
    run.load(path)
    loaded = whole(run, model)
    steps(run, model, optimizer, data[2:])
    resumed = whole(run, model)
    run.close()

    run, model, optimizer = prepared("dp_shard=2", 2, directory)
    run.load(path)
    other_layout = whole(run, model)
    run.close()
    return saved, loaded, uninterrupted, resumed, other_layout


@pytest.mark.slow
def test_split_experts_save_resume_and_load_under_another_layout(tmp_path):
    for saved, loaded, uninterrupted, resumed, other in spawn(worker, 2, str(tmp_path),
                                                             timeout=300):
        experts = [k for k in saved if ".experts." in k]
        assert experts and all(saved[k].shape[0] == 4 for k in experts)  # whole: 4 experts
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), name
            assert torch.equal(other[name], saved[name]), name
            assert torch.equal(resumed[name], uninterrupted[name]), name
        assert any(not torch.equal(uninterrupted[k], saved[k]) for k in experts)  # it trained
