"""``run.log`` takes NumPy scalars (JSON has no np.float32) and ``run.print`` takes
``print``'s keyword arguments."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import paratrain


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_numpy_scalars_and_tensors_are_logged_as_numbers(tmp_path, suffix):
    path = tmp_path / f"metrics{suffix}"
    with paratrain.Run(accelerator="cpu", progress=False, metrics_path=str(path)) as run:
        run.log({"loss": np.float32(0.5), "count": np.int64(3), "acc": np.array([0.25]),
                 "lr": torch.tensor(0.125), "note": "text"})
    text = path.read_text()
    if suffix == ".jsonl":
        assert json.loads(text) == {"step": 0, "loss": 0.5, "count": 3, "acc": 0.25,
                                    "lr": 0.125, "note": "text"}
    else:
        assert text.splitlines() == ["step,loss,count,acc,lr,note", "0,0.5,3,0.25,0.125,text"]


def test_print_takes_prints_keyword_arguments(capsys):
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        run.print("a", "b", sep="-", end="!\n", flush=True)
        run.print("c", flush=False)
    assert capsys.readouterr().out == "a-b!\nc\n"


def test_print_above_a_progress_bar_keeps_sep_and_end(capsys):
    with paratrain.Run(accelerator="cpu", progress=True) as run:
        for _ in run.progress(run.loader(list(range(4)), batch_size=2)):
            run.print("x", 1, sep=":", end=";\n", flush=True)
    assert capsys.readouterr().out.count("x:1;\n") == 2
