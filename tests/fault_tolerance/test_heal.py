"""What a healing peer receives: a live rank's state, put into a freshly started one."""

import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paratrain.data.loader import DataCursor
from paratrain.fault_tolerance import heal


class _Precision:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


def _rank(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = SimpleNamespace(models=[model], optimizers=[optimizer], schedulers=[scheduler],
                            nonfinite_batches=[], loss_spikes={"window": [], "met": []},
                            global_step=0)
    return state, _Precision(float(seed))


def _sent(snapshot: dict) -> dict:
    """What arrives: torchft's transport serialises the snapshot (torch.save)."""
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _train(state, steps: int, seed: int) -> None:
    model, optimizer = state.models[0], state.optimizers[0]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        state.schedulers[0].step()
        state.global_step += 1


def test_a_restarted_rank_continues_bitwise_as_the_live_one():
    live, live_precision = _rank(seed=0)
    _train(live, steps=5, seed=1)
    live.nonfinite_batches.append({"step": 3})
    live.loss_spikes["window"].extend([0.5, 0.4])
    sent = _sent(heal.snapshot(live, live_precision, DataCursor(epoch=1, offset=96)))

    fresh, fresh_precision = _rank(seed=7)  # other weights, no optimizer state yet
    cursor = heal.restore(fresh, fresh_precision, sent)

    assert cursor == DataCursor(epoch=1, offset=96)
    assert fresh.global_step == 5 and fresh_precision.scale == 0.0
    assert fresh.nonfinite_batches == [{"step": 3}] and fresh.loss_spikes["window"] == [0.5, 0.4]
    assert fresh.schedulers[0].get_last_lr() == live.schedulers[0].get_last_lr()
    # The same next steps on both: bitwise the same weights and buffers (Adam's moments,
    # step counts and BatchNorm's running statistics came across).
    _train(live, steps=3, seed=2)
    _train(fresh, steps=3, seed=2)
    for (name, a), b in zip(live.models[0].state_dict().items(),
                            fresh.models[0].state_dict().values()):
        assert torch.equal(a, b), name


def test_another_model_is_refused_in_one_line():
    live, precision = _rank(seed=0)
    sent = heal.snapshot(live, precision, DataCursor(epoch=0, offset=0))
    other = SimpleNamespace(**{**vars(_rank(seed=0)[0]), "models": [nn.Linear(4, 1)]})
    with pytest.raises(RuntimeError, match="the healing peer's model differs from this one"):
        heal.restore(other, precision, sent)


def test_a_peer_healing_after_an_epochs_last_batch_starts_the_next_epoch():
    """The cursor a live rank sends is the one its checkpoint would hold: after the last
    batch of epoch 0, (1, 0), not epoch 0 at its end (which a loader starts over)."""
    import paratrain

    run = paratrain.Run(strategy="single", progress=False, stragglers=False)
    joined = []

    class Replicas(type(run._replicas)):
        def join(self, state, precision, cursor, *, restarted=False):
            joined.append(cursor)

    run._replicas = Replicas()
    model = nn.Linear(2, 1)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    loader = run.loader(data, batch_size=4, shuffle=False)
    seen = []
    for _ in run.epochs(1):
        for x, y in loader:
            run.backward(nn.functional.mse_loss(model(x), y))
            run.step(optimizer)
            seen.append(joined[0]())
    run.close()
    assert seen == [DataCursor(epoch=0, offset=4), DataCursor(epoch=1, offset=0)]
