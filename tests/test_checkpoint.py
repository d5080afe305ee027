import os
import pickle
import random

import numpy as np
import pytest
import torch

from paratrain import checkpoint
from paratrain.checkpoint import CheckpointError


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


def test_a_text_file_named_like_a_checkpoint_is_reported_as_damaged_not_as_unsafe(tmp_path):
    path = tmp_path / checkpoint.checkpoint_name(3)
    path.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(checkpoint.UnreadableCheckpoint, match="not a torch.save archive"):
        checkpoint.safe_load(path)


def test_long_torch_messages_are_cut_at_a_sentence():
    exc = RuntimeError("First sentence. " + "word " * 100)
    assert checkpoint.first_sentence(exc, limit=60) == "First sentence."


def test_describe_mismatch_names_the_first_key_and_shape():
    model = {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(4), "c": torch.zeros(1)}
    found = {"a.weight": torch.zeros(2, 5), "b.weight": torch.zeros(4), "d": torch.zeros(1),
             "e": torch.zeros(1)}
    text = checkpoint.describe_mismatch(model, found)
    assert "missing key 'c'" in text
    assert "unexpected key 'd' and 1 more" in text
    assert "shape of 'a.weight' is (2, 5) in the checkpoint, (2, 3) in the model" in text
    assert checkpoint.describe_mismatch(model, model) == ""


def test_checkpoint_dir_that_is_a_file_or_unwritable_fails_at_once(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="checkpoint_dir .* is a file, not a directory"):
        checkpoint.check_writable(a_file)
    with pytest.raises(ValueError, match="checkpoint_dir .* cannot be written"):
        checkpoint.check_writable(a_file / "below")
    checkpoint.check_writable(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir()
