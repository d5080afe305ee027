"""On CUDA: gpu-check's GPT section (benchmarks/gpu_check_gpt.py) at a tiny size."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
import torch

from paratrain.run.flops import match_device

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = pytest.mark.gpu


def test_gpt_section_measures_tokens_mfu_eager_compiled_and_raw(tmp_path, capsys):
    import gpu_check_gpt

    out = tmp_path / "gpt.json"
    # The eager backend walks the compile variant's path without inductor's code generation
    # (the full section compiles with inductor; tests/gpu/test_gpu_compile.py covers it).
    rc = gpu_check_gpt.main(["--accelerator", "cuda", "--layers", "2", "--width", "128",
                             "--seq-len", "128", "--batch-size", "4", "--warmup", "2",
                             "--steps", "3", "--compile-backend", "eager", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["precision"] == "bf16-mixed"
    assert data["device"] == torch.cuda.get_device_name()
    assert [r["variant"] for r in data["rows"]] == ["eager", "compile", "raw+compile"]
    assert [r["traced"] for r in data["rows"]] == [False, True, True]  # Dynamo traced both
    for row in data["rows"]:
        assert row["tokens_per_s"] > 0 and row["peak_mib"] > 0
        assert math.isfinite(row["final_loss"])
        assert row["flops_per_sample"] == data["rows"][0]["flops_per_sample"]
        if match_device(data["device"]) is not None:  # a GPU paratrain knows the peak of
            assert row["flops_per_sample"] > 0 and 0 < row["mfu"] < 1
    assert "| eager | 4 x 128 | 3 |" in capsys.readouterr().out
