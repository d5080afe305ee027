"""A stream (IterableDataset, generator) given to ``run.loader``/``run.eval_loader`` is
refused in one line naming what to do, instead of ``object has no len()``."""

from __future__ import annotations

import pytest
from torch.utils.data import IterableDataset

import paratrain


class Numbers(IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.parametrize("make, name", [(Numbers, "Numbers"),
                                        (lambda: (i for i in range(10)), "generator"),
                                        (lambda: iter(range(10)), "range_iterator")])
@pytest.mark.parametrize("method", ["loader", "eval_loader"])
def test_a_stream_is_refused_in_one_line(make, name, method):
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        with pytest.raises(ValueError) as refused:
            getattr(run, method)(make(), batch_size=2)
    assert str(refused.value) == (
        f"run.{method}() needs a dataset with len() and [index] (it shards one global order "
        f"of indices over the ranks and resumes at an exact sample), got a {name}; for a "
        "stream, materialise it (list(stream)) or wrap it in a torch.utils.data.Dataset "
        "with __len__ and __getitem__")


def test_a_materialised_stream_trains():
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        assert [b.tolist() for b in run.loader(list(Numbers()), batch_size=5,
                                               shuffle=False)] == [[0, 1, 2, 3, 4],
                                                                   [5, 6, 7, 8, 9]]
