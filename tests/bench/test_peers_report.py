"""The pure parts of benchmarks/gpu_peers.py: sizes, variants, ratios and the table."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

from peers_report import (  # noqa: E402
    Result,
    interleaved,
    job_precision,
    job_size,
    markdown_table,
    ratios_to_best_peer,
    variants,
)


def test_cuda_sizes_are_the_named_jobs_and_cpu_sizes_are_small():
    gpt = job_size("gpt", accelerator="cuda")
    assert (gpt.n_layer, gpt.n_embd, gpt.seq_len, gpt.batch_size) == (12, 768, 1024, 8)
    assert job_size("resnet18", accelerator="cuda").batch_size == 256
    assert job_size("convnet", accelerator="cuda").samples is None
    cpu = job_size("gpt", accelerator="cpu")
    assert (cpu.n_layer, cpu.n_embd, cpu.seq_len) == (2, 128, 128)
    assert job_size("convnet", accelerator="cpu").samples == 2_000


def test_overrides_replace_fields_and_keep_64_wide_heads():
    size = job_size("gpt", accelerator="cpu", batch_size=4, n_embd=192)
    assert (size.batch_size, size.n_embd, size.n_head) == (4, 192, 3)
    # GPT knobs do not leak into the image jobs.
    assert job_size("convnet", accelerator="cpu", seq_len=64).seq_len == 0
    with pytest.raises(ValueError, match="job must be one of"):
        job_size("vgg", accelerator="cpu")


def test_variants_per_accelerator():
    assert "paratrain+cudagraphs" in variants(accelerator="cuda")
    assert "paratrain+compile" not in variants(accelerator="cpu")
    on_cpu = variants(accelerator="cpu", compile_on_cpu=True)
    assert "paratrain+compile" in on_cpu and "paratrain+cudagraphs" not in on_cpu
    assert interleaved(("a", "b"), 0) == ("a", "b") and interleaved(("a", "b"), 1) == ("b", "a")


def test_ratio_is_to_the_fastest_peer_of_the_same_job():
    results = [Result("convnet", "raw", [100.0, 120.0, 110.0]),
               Result("convnet", "fabric", [200.0]),
               Result("convnet", "paratrain", [300.0]),
               Result("gpt", "accelerate", [10.0]),
               Result("gpt", "paratrain", [5.0])]
    ratios = ratios_to_best_peer(results)
    assert ratios[("convnet", "raw")] == pytest.approx(0.55)
    assert ratios[("convnet", "fabric")] == 1.0
    assert ratios[("convnet", "paratrain")] == 1.5
    assert ratios[("gpt", "paratrain")] == 0.5


def test_table_rows_and_missing_values():
    results = [Result("convnet", "raw", [100.0, 300.0], [None, None]),
               Result("convnet", "paratrain", [400.0], [12.4]),
               Result("convnet", "fabric", [], [])]
    table = markdown_table(results, memory_label="peak MiB")
    lines = table.splitlines()
    assert lines[0].endswith("| peak MiB |") and len(lines) == 4  # the empty result is left out
    assert lines[2] == "| convnet | raw | 200.0 | 100.0-300.0 | 1.00 | n/a |"
    assert lines[3] == "| convnet | paratrain | 400.0 | 400.0-400.0 | 2.00 | 12 |"
    no_peer = markdown_table([Result("gpt", "paratrain", [1.0])], memory_label="m")
    assert "| n/a | n/a |" in no_peer


def test_precision_is_bf16_on_cuda_float32_on_cpu_unless_given():
    assert job_precision("gpt", accelerator="cuda") == "bf16-mixed"
    assert job_precision("convnet", accelerator="cuda") == "32"
    assert job_precision("resnet18", accelerator="cpu") == "32"
    assert job_precision("resnet18", accelerator="cpu", override="bf16-mixed") == "bf16-mixed"
    with pytest.raises(ValueError, match="precision must be"):
        job_precision("gpt", accelerator="cpu", override="16-mixed")
