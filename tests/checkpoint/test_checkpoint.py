import os
import pickle
import random

import numpy as np
import pytest
import torch

from paratrain.checkpoint import files as checkpoint
from paratrain.checkpoint.files import CheckpointError


def valid_state(step=1):
    return {"format": "paratrain", "global_step": step, "w": torch.arange(4.0)}


def test_atomic_save_and_safe_load_roundtrip(tmp_path):
    path = checkpoint.atomic_save(valid_state(), tmp_path / checkpoint.checkpoint_name(1))
    loaded = checkpoint.safe_load(path)
    assert torch.equal(loaded["w"], torch.arange(4.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000001.pt"]


def test_crash_during_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    good = checkpoint.atomic_save(valid_state(1), tmp_path / checkpoint.checkpoint_name(1))

    def exploding_save(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", exploding_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.atomic_save(valid_state(2), tmp_path / checkpoint.checkpoint_name(2))
    assert checkpoint.latest_checkpoint(tmp_path) == good
    assert sorted(os.listdir(tmp_path)) == ["step-000000001.pt"]  # no temp file left


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/paratrain-pwned",))


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    path = tmp_path / "step-000000003.pt"
    with open(path, "wb") as f:
        pickle.dump({"format": "paratrain", "payload": Exploit()}, f)
    with pytest.raises(CheckpointError, match="was refused"):
        checkpoint.safe_load(path)
    assert not os.path.exists("/tmp/paratrain-pwned")


def test_truncated_file_is_reported_as_corrupt(tmp_path):
    path = checkpoint.atomic_save(valid_state(), tmp_path / "step-000000001.pt")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        checkpoint.safe_load(path)


def test_foreign_file_is_rejected(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="not written by paratrain"):
        checkpoint.safe_load(path)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.safe_load(tmp_path / "nope.pt")


def test_latest_and_prune(tmp_path):
    for step in (3, 10, 7):
        checkpoint.atomic_save(valid_state(step), tmp_path / checkpoint.checkpoint_name(step))
    (tmp_path / ".step-000000011.pt.abc.tmp").write_bytes(b"incomplete")
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-000000010.pt"
    checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step-000000007.pt", "step-000000010.pt"]


def test_rng_state_roundtrip_through_a_checkpoint(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    random.gauss(0, 1)  # leave a cached gaussian in Python's state
    blob = checkpoint.rng_state()
    path = checkpoint.atomic_save({"format": "paratrain", "rng": blob}, tmp_path / "r.pt")
    expected = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2))
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    checkpoint.set_rng_state(checkpoint.safe_load(path)["rng"])
    got = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2))
    assert torch.equal(expected[0], got[0]) and expected[1:3] == got[1:3]
    assert np.array_equal(expected[3], got[3])
    assert blob.dtype == torch.uint8 and blob.numel() == checkpoint.rng_state().numel()


# -- files that are not checkpoints, and what the messages say ------------------------

def test_text_file_named_like_a_checkpoint_is_not_called_unsafe(tmp_path):
    path = tmp_path / "step-000000004.pt"
    path.write_text("hello, these are notes\n")
    with pytest.raises(checkpoint.CorruptCheckpoint, match="is not a torch checkpoint") as info:
        checkpoint.safe_load(path)
    assert "other than tensors" not in str(info.value)


def test_refusal_keeps_torchs_reason_whole(tmp_path):
    path = tmp_path / "step-000000003.pt"
    torch.save({"format": "paratrain", "payload": Exploit()}, path)
    with pytest.raises(CheckpointError, match="was refused") as info:
        checkpoint.safe_load(path)
    message = str(info.value)
    assert message.endswith("(Trying to load unsupported GLOBAL posix.system whose module posix "
                            "is blocked); only load files you trust with other tools")
    assert "Weights only load failed" not in message and "\n" not in message


def test_describe_mismatch_names_first_key_and_shape():
    model = {"0.weight": (16, 10), "0.bias": (16,), "2.weight": (3, 16)}
    saved = {"0.weight": (16, 12), "0.bias": (16,), "4.weight": (3, 16), "4.bias": (3,)}
    assert checkpoint.describe_mismatch(model, saved) == (
        "missing key '2.weight'; unexpected key '4.weight' (and 1 more); "
        "shape of '0.weight' is [16, 12] in the checkpoint but [16, 10] in the model")
    assert checkpoint.describe_mismatch(model, {**model, "4.bias": (3,)}, partial=True) is None


# -- through a Run (one process) ---------------------------------------------------------

def train_run(directory, *, strategy="single", steps=2, width=16, every=1, save_at_end=False):
    import torch.nn.functional as F
    from torch import nn

    import paratrain
    from paratrain.testing.reference import synthetic_classification

    with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=5,
                       checkpoint_dir=str(directory), checkpoint_every=every,
                       keep_checkpoints=3) as run:
        model = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 3))
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
        loader = run.loader(synthetic_classification(16), batch_size=8)
        for _ in run.epochs(1):
            for step, (x, y) in enumerate(loader):
                if step == steps:
                    break
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
        if save_at_end:
            run.save()
        return run.global_step


def test_checkpoint_dir_that_is_a_file_fails_at_construction(tmp_path):
    import paratrain

    target = tmp_path / "ckpt"
    target.write_text("")
    with pytest.raises(ValueError, match=r"^checkpoint_dir='.*ckpt' is a file, not a directory"):
        paratrain.Run(accelerator="cpu", checkpoint_dir=str(target))
    with pytest.raises(ValueError, match=r"^checkpoint_dir='.*ckpt/sub' cannot be written \("):
        paratrain.Run(accelerator="cpu", checkpoint_dir=str(target / "sub"))


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    assert train_run(tmp_path) == 2
    newest = tmp_path / "step-000000002.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    assert train_run(tmp_path, steps=0) == 1
    out = capsys.readouterr().out
    assert (f"paratrain: warning: checkpoint {newest} is corrupt or truncated" in out
            and f"resuming from the previous checkpoint {tmp_path / 'step-000000001.pt'} instead"
            in out)


def test_checkpoint_of_another_model_names_the_shape(tmp_path):
    train_run(tmp_path, steps=1)
    with pytest.raises(CheckpointError, match=r"shape of '0.weight' is \[16, 10\] in the "
                                              r"checkpoint but \[8, 10\] in the model"):
        train_run(tmp_path, steps=0, width=8)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_saving_a_saved_step_again_is_a_no_op_without_warnings(tmp_path, strategy):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train_run(tmp_path, strategy=strategy, steps=2, every=2, save_at_end=True) == 2
        assert train_run(tmp_path, strategy=strategy, steps=2, every=1) == 2  # resumes, loads
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "existing checkpoint" in m or "is disabled" in m], messages
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-000000002.pt"]
